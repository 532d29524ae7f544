"""``mrl plugins``: the installed console script (subprocess) and ``main([...])`` in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mrl_plugins.cli.main import main

MRL = Path(sys.executable).parent / "mrl"
BUILTINS = {
    "upstream": "rollout, weight_sync, comm",
    "mrl.rollout": "rollout",
    "mrl.weight_sync": "weight_sync",
    "mrl.comm": "comm",
}


@pytest.fixture(autouse=True)
def _no_plugin_env(monkeypatch):
    for var in ("MRL_PLUGINS", "MRL_DISABLED_PLUGINS", "MRL_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(var, raising=False)


def _registered(output: str) -> dict[str, dict[str, str]]:
    """The registry listing after the table: ``key (what)`` -> {name: description}."""
    listed: dict[str, dict[str, str]] = {}
    section = None
    for line in output.split("\n\n", 1)[1].splitlines():
        if line and not line.startswith(" "):
            section = listed.setdefault(line.rstrip(":"), {})
        elif line.strip():
            name, _, desc = line.strip().partition(" ")
            section[name] = desc.strip()
    return listed


def _rows(output: str) -> dict[str, dict[str, str]]:
    """Parse the table: plugin -> {source, stages, active}; column starts come from the header line."""
    lines = output.splitlines()
    header = lines[0]
    assert header.split()[:3] == ["plugin", "source", "stages"] and header.rstrip().endswith("active for")
    starts = [header.index("source"), header.index("stages"), header.index("active for")]
    rows = {}
    for line in lines[1:]:
        if not line.strip():
            break
        rows[line[: starts[0]].strip()] = {
            "source": line[starts[0] : starts[1]].strip(),
            "stages": line[starts[1] : starts[2]].strip(),
            "active": line[starts[2] :].strip(),
        }
    return rows


def _run_mrl(*args: str) -> subprocess.CompletedProcess:
    if not MRL.exists():
        pytest.fail(f"console script {MRL} is not installed (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    return subprocess.run([str(MRL), *args], capture_output=True, text=True, timeout=120, env=env, cwd="/tmp")


def _in_process(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plugins", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_lists_builtins():
    proc = _run_mrl("plugins")
    assert proc.returncode == 0, proc.stderr
    rows = _rows(proc.stdout)
    for name, stages in BUILTINS.items():
        assert rows[name]["stages"] == stages
        assert rows[name]["source"] == "builtin"
    assert rows["mrl.rollout"]["active"] == "rollout"
    assert rows["mrl.weight_sync"]["active"] == "weight_sync"
    assert rows["mrl.comm"]["active"] == "comm"
    assert rows["upstream"]["active"] == "-"
    listed = _registered(proc.stdout)  # every name the config can select, each with its description
    assert set(listed["comm.codec (comm codecs)"]) == {"auto", "raw", "fp16", "bf16"}
    assert set(listed["plugins.comm (comm plugins)"]) == {"mrl", "upstream"}
    assert listed["weight_sync.transport (weight-sync transports)"]["shm"].startswith("shared memory")
    assert all(desc != "-" for names in listed.values() for desc in names.values())


def test_console_script_unknown_plugin_exit_2():
    proc = _run_mrl("plugins", "--plugins", "rollout=nosuch")
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "nosuch" in lines[0] and "'mrl'" in lines[0] and "'upstream'" in lines[0]


def test_in_process_default(capsys):
    code, out, _ = _in_process(capsys)
    assert code == 0
    rows = _rows(out)
    assert {name: r["stages"] for name, r in rows.items() if name in BUILTINS} == BUILTINS
    assert rows["mrl.rollout"]["active"] == "rollout" and rows["upstream"]["active"] == "-"


def test_plugins_option_changes_active_column(capsys):
    code, out, _ = _in_process(capsys, "--plugins", "weight_sync=upstream")
    assert code == 0
    rows = _rows(out)
    assert rows["upstream"]["active"] == "weight_sync"
    assert rows["mrl.weight_sync"]["active"] == "-"
    assert rows["mrl.comm"]["active"] == "comm"
    # TRL's own rollout beside mrl's weight sync: the combination enable() refuses, refused here the same way
    code, out, err = _in_process(capsys, "--plugins", "rollout=upstream")
    assert code == 2 and out == "" and "plugins.weight_sync: 'mrl' needs a separate inference copy" in err
    code, out, _ = _in_process(capsys, "--plugins", "rollout=upstream,weight_sync=upstream,comm=upstream")
    assert code == 0
    assert _rows(out)["upstream"]["active"] == "rollout, weight_sync, comm"


def test_config_option_and_override(capsys):
    code, out, _ = _in_process(capsys, "--config", "upstream")
    assert code == 0 and _rows(out)["upstream"]["active"] == "rollout, weight_sync, comm"
    code, out, _ = _in_process(capsys, "--config", "upstream", "--plugins", "rollout=mrl")
    assert code == 0
    rows = _rows(out)
    assert rows["upstream"]["active"] == "weight_sync, comm" and rows["mrl.rollout"]["active"] == "rollout"


def test_disable_shows_blocked(capsys):
    code, out, _ = _in_process(capsys, "--disable", "mrl.comm", "--plugins", "comm=upstream")
    assert code == 0
    rows = _rows(out)
    assert rows["mrl.comm"]["active"] == "blocked"
    assert rows["upstream"]["active"] == "comm"
    assert rows["mrl.rollout"]["active"] == "rollout"


def test_disable_selected_plugin_is_an_error(capsys):
    code, out, err = _in_process(capsys, "--disable", "mrl.comm")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "blocked" in err and "plugins.comm" in err


def test_env_disable_shows_blocked(capsys, monkeypatch):
    monkeypatch.setenv("MRL_DISABLED_PLUGINS", "mrl")
    code, out, _ = _in_process(capsys, "--config", "upstream")
    assert code == 0
    rows = _rows(out)
    assert rows["mrl"]["active"] == "blocked"
    assert not any(name.startswith("mrl.") for name in rows)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--plugins", "rollout=nosuch"], ["nosuch", "'mrl'", "'upstream'"]),
        (["--plugins", "rollout"], ["--plugins", "STAGE=PLUGIN", "'rollout'"]),
        (["--plugins", "bogus=mrl"], ["'bogus'", "plugins"]),
        (["--config", "nosuch"], ["'nosuch'", "'colocate'"]),
    ],
)
def test_bad_selection_exit_2_one_line(capsys, args, expected):
    code, out, err = _in_process(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1, err
    assert err.startswith("mrl plugins: error: ")
    for word in expected:
        assert word in err, (word, err)


COMM_PLUG = """
    from mrl_plugins.hookspecs import Capabilities, StagePlugin, hookimpl


    class Comm:
        def capabilities(self, ctx):
            return Capabilities()

        def open_consumer(self, ctx, run_id, producers):
            return None

        def open_producer(self, ctx, handle, index):
            return None


    class Plug:
        @hookimpl
        def mrl_comm_register_stages(self):
            return [StagePlugin("cliplug", Comm)]


    plugin = Plug()
"""


def test_entry_point_plugin_listed_and_selectable(capsys, install_dist):
    install_dist("cliplug", {"cliplug": "cliplug_mod:plugin"}, {"cliplug_mod": COMM_PLUG})
    code, out, _ = _in_process(capsys, "--plugins", "comm=cliplug")
    assert code == 0
    rows = _rows(out)
    assert rows["cliplug"] == {"source": "entrypoint", "stages": "comm", "active": "comm"}
    assert rows["mrl.comm"]["active"] == "-"
    code, out, _ = _in_process(capsys, "--no-autoload")
    assert code == 0 and "cliplug" not in _rows(out)


def test_disable_broken_entry_point(capsys, install_dist):
    install_dist("boomdist", {"boom": "boom_mod:plugin"}, {"boom_mod": "raise RuntimeError('boom at import')\n"})
    code, out, err = _in_process(capsys)
    assert code == 2 and "entry point 'boom'" in err and "boom at import" in err
    code, out, _ = _in_process(capsys, "--disable", "boom")
    assert code == 0 and _rows(out)["boom"]["active"] == "blocked"
    assert "boom_mod" not in sys.modules


def test_mrl_plugins_env_selects(capsys, monkeypatch):
    monkeypatch.setenv("MRL_PLUGINS", "comm=upstream")
    code, out, _ = _in_process(capsys)
    assert code == 0 and _rows(out)["upstream"]["active"] == "comm"
    monkeypatch.setenv("MRL_PLUGINS", "upstream")  # a bundled config name
    code, out, _ = _in_process(capsys)
    assert code == 0 and _rows(out)["upstream"]["active"] == "rollout, weight_sync, comm"
    code, out, _ = _in_process(capsys, "--config", "colocate")  # --config wins over the variable
    assert code == 0 and _rows(out)["upstream"]["active"] == "-"


def test_console_script_disable_unknown_name_exit_2():
    proc = _run_mrl("plugins", "--disable", "mrl.bogus")
    assert proc.returncode == 2 and proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "--disable: unknown plugin 'mrl.bogus'" in lines[0]
    for valid in ("'mrl'", "'mrl.comm'", "'mrl.rollout'", "'mrl.weight_sync'", "'upstream'"):
        assert valid in lines[0]


def test_config_disable_unknown_name(capsys, tmp_path):
    (tmp_path / "c.yaml").write_text("disable: [mrl.comms]\nplugins: {comm: upstream}\n")
    code, out, err = _in_process(capsys, "--config", str(tmp_path / "c.yaml"))
    assert code == 2 and out == "" and "disable: unknown plugin 'mrl.comms'" in err and "'mrl.comm'" in err


def test_disable_prefix_and_entry_point_names_accepted(capsys, install_dist):
    code, out, _ = _in_process(capsys, "--disable", "mrl", "--config", "upstream")  # a prefix blocks mrl.*
    assert code == 0 and _rows(out)["mrl"]["active"] == "blocked" and "mrl.comm" not in _rows(out)
    install_dist("okdist", {"okplug": "ok_mod:plugin"}, {"ok_mod": "plugin = object()\n"})
    code, out, _ = _in_process(capsys, "--disable", "okplug")  # known from its entry point, never loaded
    assert code == 0 and _rows(out)["okplug"]["active"] == "blocked" and "ok_mod" not in sys.modules
