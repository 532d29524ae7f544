"""The documentation a TRL user reads first: ``docs/config.md`` is what the config dataclasses say, the README's
quick-start script runs as pasted (fewer steps), and what the README promises about commands and metrics holds."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.marks import require_trl

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"


def _readme() -> str:
    return README.read_text(encoding="utf-8")


def _block(heading: str, lang: str) -> str:
    """The first fenced ``lang`` block after the README heading ``heading``."""
    match = re.search(rf"^#+ {re.escape(heading)}\s*$(.*?)^```{lang}\n(.*?)^```", _readme(), re.S | re.M)
    assert match, f"README.md has no ```{lang} block under a heading {heading!r}"
    return match.group(2)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return env


# --------------------------------------------------------------------------- docs/config.md


def test_config_reference_is_current():
    """docs/config.md is exactly what the generator writes from the dataclasses today."""
    from mrl_plugins.cli import docs

    committed = (REPO_ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == docs.render(), "docs/config.md is out of date: run `python -m mrl_plugins.cli.docs`"


def test_config_reference_names_every_key_with_its_help():
    """Every field of every section is a row carrying its default and its help text (a new field shows up)."""
    import typing

    from mrl_plugins.cli import docs

    text = docs.render()
    for key, cls, _ in docs._sections():
        for f in dataclasses.fields(cls):
            nested = not key and dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
            name = f"{key}.{f.name}" if key else f.name
            row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
            assert row is not None, f"no row for {name}"
            assert f.metadata.get("help"), f"{name} has no help text"
            assert docs._md(f.metadata["help"]) in row, name
            if not nested and f.name not in ("rollout", "weight_sync", "comm"):
                assert f"`{docs._value(docs._default(f))}`" in row, name


def test_generator_cli_writes_and_checks(tmp_path):
    """``python -m mrl_plugins.cli.docs`` writes the file; ``--check`` passes on it and fails on a stale one."""
    out = tmp_path / "docs" / "config.md"
    cmd = [sys.executable, "-m", "mrl_plugins.cli.docs", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.read_text(encoding="utf-8").startswith("# Configuration reference")
    check = subprocess.run([*cmd, "--check"], capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert check.returncode == 0, check.stderr
    out.write_text(out.read_text(encoding="utf-8").replace("| `rollout.workers` |", "| `rollout.wrkers` |"))
    stale = subprocess.run([*cmd, "--check"], capture_output=True, text=True, env=_clean_env(), timeout=120)
    assert stale.returncode == 1 and "out of date" in stale.stderr


# --------------------------------------------------------------------------- README


def test_readme_links_and_commands():
    """The files the README links exist; the test command is ``tox`` on a line of its own; the bundled configs
    the README's table names are the shipped ones."""
    from mrl_plugins.config import bundled_configs

    text = _readme()
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (REPO_ROOT / target).exists(), f"README links {target}, which does not exist"
    assert re.search(r"^tox$", text, re.M), "the test command `tox` must stay on a line of its own"
    section = text[text.index("## Bundled configs") :]
    section = section[: section.index("\n## ", 1)]
    named = set(re.findall(r"^\| `(\w+)` \|", section, re.M))
    assert named == set(bundled_configs()), (named, sorted(bundled_configs()))
    for line in re.findall(r"^\s*MRL_PLUGINS: (\S+)", _block("Quick start", "yaml"), re.M):
        assert line in bundled_configs()


@require_trl
@pytest.mark.slow
def test_readme_quickstart_runs_as_pasted(tmp_path):
    """The quick-start script, extracted from the README, trains (4 steps instead of 60) with the plugins on:
    enable() prints its line, every step is taken, and the metrics the README lists as logged every step are
    in TRL's logs."""
    script = _block("Quick start", "python")
    script, n_steps = re.subn(r"max_steps=\d+", "max_steps=4", script)
    script, n_log = re.subn(r"logging_steps=\d+", "logging_steps=1", script)
    assert n_steps == 1 and n_log == 1, "the quick start must set max_steps and logging_steps once"
    (tmp_path / "quickstart.py").write_text(script, encoding="utf-8")
    runner = (
        "import json, runpy\n"
        "g = runpy.run_path('quickstart.py')\n"
        "json.dump({'history': g['trainer'].state.log_history, 'step': g['trainer'].state.global_step},"
        " open('history.json', 'w'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", runner], cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^mrl-plugins: rollout=mrl \(", proc.stderr, re.M), proc.stderr[-2000:]
    assert re.search(r"^reward \d\.\d{3} -> \d\.\d{3}$", proc.stdout, re.M), proc.stdout[-1000:]
    result = json.loads((tmp_path / "history.json").read_text())
    assert result["step"] == 4
    logged = {k for log in result["history"] for k in log}
    text = _readme()
    every_step = text[text.index("Logged every step") : text.index("When they happen")]
    promised = set(re.findall(r"`(mrl/[a-z_]+/[a-z_0-9]+)`", every_step))
    assert len(promised) >= 10, promised
    assert promised <= logged, sorted(promised - logged)
