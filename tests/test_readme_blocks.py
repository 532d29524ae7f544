"""Every code block the README (and docs/) shows still runs or parses, and every link between them resolves.

Python blocks compile, and the README's quick start runs exactly as pasted (its own 60 steps); YAML blocks load, and
the config-shaped ones load through ``load_config``; every ``mrl ...`` command of a bash block (and of the "When it
pays" table) is a subcommand whose ``--help`` exits 0 and lists each option the command uses; ``pip``/``tox`` lines
name extras and environments that exist; TOML blocks parse. A relative link points at a file that exists and, with
``#anchor``, at one of its headings; each file under docs/ and benchmarks/README.md is one link from the README."""

from __future__ import annotations

import configparser
import functools
import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests import doc_blocks
from tests.doc_blocks import REPO_ROOT
from tests.marks import require_trl

LANGS = {"python", "yaml", "bash", "toml", "text"}


def _all_blocks(lang: str) -> list[tuple[str, doc_blocks.Block]]:
    return [(rel, b) for rel in doc_blocks.markdown_files() for b in doc_blocks.blocks(rel) if b.lang == lang]


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return env


def test_every_block_names_a_language_the_tests_check():
    """An unlabelled fence, or a language without a check below, would slip past these tests."""
    seen = {}
    for rel in doc_blocks.markdown_files():
        for b in doc_blocks.blocks(rel):
            assert b.lang in LANGS, f"{rel}:{b.line}: ```{b.lang} (expected one of {sorted(LANGS)})"
            seen.setdefault(rel, set()).add(b.lang)
    assert {"python", "yaml", "bash"} <= seen["README.md"], seen["README.md"]


# --------------------------------------------------------------------------- python


def test_python_blocks_compile():
    found = _all_blocks("python")
    assert any(rel == "README.md" for rel, _ in found) and any(rel == "docs/plugins.md" for rel, _ in found)
    for rel, b in found:
        compile(b.code, f"{rel}:{b.line}", "exec")  # a SyntaxError names the file and line


def test_readme_has_one_python_block_the_quick_start():
    """The one script a user pastes is the one the next test runs."""
    readme = [b.code for b in doc_blocks.blocks() if b.lang == "python"]
    assert readme == [doc_blocks.block("Quick start", "python")]


@require_trl
@pytest.mark.slow
def test_readme_quickstart_runs_as_pasted(tmp_path):
    """The quick-start script, unchanged (60 steps), in a fresh interpreter: enable() prints its line, the script
    prints its reward line and the reward rose, every step is taken, and every training log carries the metrics
    docs/metrics.md lists as logged every step."""
    (tmp_path / "quickstart.py").write_text(doc_blocks.block("Quick start", "python"), encoding="utf-8")
    runner = (
        "import json, runpy\n"
        "g = runpy.run_path('quickstart.py', run_name='__main__')\n"
        "json.dump({'history': g['trainer'].state.log_history, 'step': g['trainer'].state.global_step,"
        " 'max_steps': g['args'].max_steps}, open('history.json', 'w'))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", runner], cwd=tmp_path, capture_output=True, text=True, env=_clean_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(r"^mrl-plugins: rollout=mrl \(", proc.stderr, re.M), proc.stderr[-2000:]
    line = re.search(r"^reward (\d\.\d{3}) -> (\d\.\d{3})$", proc.stdout, re.M)
    assert line, proc.stdout[-1000:]
    assert float(line.group(2)) > float(line.group(1)), line.group(0)  # the count-the-token reward is learned
    result = json.loads((tmp_path / "history.json").read_text())
    assert result["step"] == result["max_steps"] == 60
    every_step = doc_blocks.text("docs/metrics.md")
    every_step = every_step[every_step.index("Logged every step") : every_step.index("When they happen")]
    promised = set(re.findall(r"`(mrl/[a-z_]+/[a-z_0-9]+)`", every_step))
    assert len(promised) >= 10, promised
    train_logs = [log for log in result["history"] if "reward" in log]
    assert len(train_logs) == 6, len(train_logs)  # logging_steps=10 over 60 steps
    for log in train_logs:
        assert promised <= set(log), sorted(promised - set(log))


# --------------------------------------------------------------------------- yaml


def test_yaml_blocks_load_and_configs_validate(monkeypatch, user_config):
    """Every YAML block loads; a config-shaped one (top-level keys of ``MrlConfig``) loads through ``load_config``;
    the TRL CLI's ``env:`` block names an ``MRL_PLUGINS`` value that loads the same way. A Ray config
    (``rollout.ray_address``) is checked as on a machine with Ray (here Ray need not be installed). Blocks load as a
    user's config: no internal values."""
    import dataclasses

    from mrl_plugins.rollout import config as rollout_config

    monkeypatch.setattr(rollout_config, "is_ray_available", lambda: True)

    from mrl_plugins.adapters.trl import config_from_env
    from mrl_plugins.config import MrlConfig, load_config

    keys = {f.name for f in dataclasses.fields(MrlConfig)}
    found = _all_blocks("yaml")
    assert {"README.md", "docs/multi-host.md"} <= {rel for rel, _ in found}
    env_blocks = 0
    for rel, b in found:
        data = yaml.safe_load(b.code)
        where = f"{rel}:{b.line}"
        assert isinstance(data, dict) and data, where
        if set(data) == {"env"}:
            value = data["env"]["MRL_PLUGINS"]
            load_config(config_from_env(value))
            env_blocks += 1
        else:
            assert set(data) <= keys, (where, sorted(set(data) - keys))
            load_config(data)
    assert env_blocks >= 1


# --------------------------------------------------------------------------- toml


def _toml_loads(src: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(src)


def test_toml_blocks_parse_and_use_the_entry_point_group():
    from mrl_plugins.manager import ENTRY_POINT_GROUP

    found = _all_blocks("toml")
    assert found
    for rel, b in found:
        data = _toml_loads(b.code)
        assert ENTRY_POINT_GROUP in data["project"]["entry-points"], f"{rel}:{b.line}"


# --------------------------------------------------------------------------- bash and `mrl ...` commands


def _command_lines(code: str) -> list[list[str]]:
    """The commands of a bash block, each split like the shell does (a line ending in ``\\`` continues on the
    next), comments dropped."""
    joined = re.sub(r"\\\n", " ", code)
    return [words for ln in joined.splitlines() if (words := shlex.split(ln, comments=True))]


def _check_ray(words: list[str], where: str) -> None:
    """``ray start ...``: a subcommand of Ray's CLI, and, where Ray is installed, each option one it has."""
    import shutil

    assert words[1] in ("start", "stop", "status"), f"{where}: `ray {words[1]}`"
    if shutil.which("ray") is None:
        return
    shown = subprocess.run(["ray", words[1], "--help"], capture_output=True, text=True, timeout=120).stdout
    for w in words[2:]:
        if w.startswith("--"):
            assert w.split("=")[0] in shown, f"{where}: `ray {words[1]}` has no option {w}"


@functools.cache
def _help(subcommand: tuple[str, ...]) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", *subcommand, "--help"],
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=300,
    )
    assert proc.returncode == 0, (subcommand, proc.stderr[-2000:])
    return proc.stdout


def _check_mrl(words: list[str], where: str) -> None:
    from mrl_plugins.config import load_config

    sub = []
    for w in words[1:]:
        if w.startswith("-"):
            break
        sub.append(w)
    assert sub, f"{where}: `{shlex.join(words)}` names no subcommand"
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", _help(tuple(sub))))
    for i, w in enumerate(words):
        if w.startswith("--"):
            assert w.split("=")[0] in shown, f"{where}: `mrl {' '.join(sub)}` has no option {w}"
        if w in ("--config", "--lend-config"):
            value = words[i + 1]
            path = REPO_ROOT / value
            load_config(str(path) if path.exists() else value)  # a checkout path or a bundled name


@functools.cache
def _benchmark_help(name: str) -> str:
    from tests.conftest import benchmarks_command, benchmarks_env

    proc = subprocess.run(
        benchmarks_command(name, "--help"), capture_output=True, text=True, env=benchmarks_env(_clean_env()),
        timeout=300, cwd=REPO_ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, (name, proc.stderr[-2000:])
    return proc.stdout


def _check_python(words: list[str], where: str) -> None:
    """``python -m benchmarks NAME [options]`` (the lab, from a checkout): a tool it has, options that tool takes."""
    from benchmarks.__main__ import TOOLS

    assert words[1:3] == ["-m", "benchmarks"], f"{where}: `{shlex.join(words)}`: only `python -m benchmarks` is known"
    assert len(words) > 3 and words[3] in TOOLS, f"{where}: `{shlex.join(words)}`: valid: {', '.join(TOOLS)}"
    shown = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", _benchmark_help(words[3])))
    for i, w in enumerate(words[4:], 4):
        if w.startswith("--"):
            assert w.split("=")[0] in shown, f"{where}: `python -m benchmarks {words[3]}` has no option {w}"
        if w in ("--config", "--lend-config"):
            from mrl_plugins.config import load_config

            path = REPO_ROOT / words[i + 1]
            load_config(str(path) if path.exists() else words[i + 1])


def _check_pip(words: list[str], where: str) -> None:
    project = _toml_loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert words[1] in ("install", "uninstall"), where
    for w in words[2:]:
        m = re.match(r"^([A-Za-z0-9_.-]+)(?:\[([^\]]*)\])?$", w)
        if not m or w.startswith("-") or m.group(1) != project["name"]:
            continue
        extras = {e.strip() for e in (m.group(2) or "").split(",") if e.strip()}
        assert extras <= set(project["optional-dependencies"]), (where, extras)


def _check_tox(words: list[str], where: str) -> None:
    """``tox`` alone runs tox.ini's env_list, and those are the environments .ci/run runs."""
    assert words == ["tox"], where
    ini = configparser.ConfigParser()
    ini.read(REPO_ROOT / "tox.ini", encoding="utf-8")
    envs = [e.strip() for e in ini["tox"]["env_list"].split(",")]
    sections = set()
    for name in ini.sections():  # tox's generative names: testenv:trl{114,115} is testenv:trl114 and testenv:trl115
        m = re.fullmatch(r"(.*)\{([^}]*)\}(.*)", name)
        sections |= {m.group(1) + part.strip() + m.group(3) for part in m.group(2).split(",")} if m else {name}
    for env in envs:
        assert env == "py" or f"testenv:{env}" in sections, (where, env)
    ci = re.search(r"tox -e (\S+)", (REPO_ROOT / ".ci" / "run").read_text(encoding="utf-8"))
    assert ci and ci.group(1).split(",") == envs, (ci and ci.group(1), envs)


def _check_taskset(words: list[str], where: str) -> None:
    """``taskset -c CORES command ...``: a core list, then a command that has a check of its own."""
    assert len(words) > 3 and words[1] == "-c" and re.fullmatch(r"[0-9,-]+", words[2]), f"{where}: {shlex.join(words)}"
    assert words[3] == "ray", f"{where}: `taskset` runs {words[3]!r}, which no check knows"
    _check_ray(words[3:], where)


def test_bash_blocks_run_commands_that_exist():
    checks = {
        "mrl": _check_mrl, "python": _check_python, "pip": _check_pip, "tox": _check_tox, "ray": _check_ray,
        "taskset": _check_taskset,
    }  # fmt: skip
    found = _all_blocks("bash")
    assert {"README.md", "docs/multi-host.md", "docs/vllm.md"} <= {rel for rel, _ in found}
    ran = set()
    for rel, b in found:
        for words in _command_lines(b.code):
            where = f"{rel}:{b.line}"
            assert words[0] in checks, f"{where}: `{shlex.join(words)}`: no check for {words[0]!r}"
            checks[words[0]](words, where)
            ran.add(words[0])
    assert ran == set(checks), ran


def test_when_it_pays_commands_exist():
    """The command column of the README's "When it pays" table: each `mrl ...` is a real subcommand and option, each
    `python -m benchmarks ...` a tool of the lab with its options."""
    rows = [ln for ln in doc_blocks.section("When it pays").splitlines() if ln.startswith("| ")][1:]
    cells = [row.rstrip(" |").rsplit("|", 1)[-1] for row in rows]
    commands = [c for cell in cells for c in re.findall(r"`(mrl [^`]+|python -m benchmarks [^`]+)`", cell)]
    assert len(commands) >= 6, commands
    for c in commands:
        words = shlex.split(c)
        (_check_mrl if words[0] == "mrl" else _check_python)(words, "README.md, When it pays")
    for script in (s for cell in cells for s in re.findall(r"`bash ([^` ]+)`", cell)):  # the benchmarks' scripts
        assert (REPO_ROOT / script).is_file(), f"README.md, When it pays: {script} does not exist"


# --------------------------------------------------------------------------- links


def test_relative_links_resolve():
    for rel in doc_blocks.markdown_files():
        for target, anchor in doc_blocks.links(rel):
            assert (REPO_ROOT / target).exists(), f"{rel} links {target}, which does not exist"
            if anchor:
                assert target.endswith(".md"), f"{rel}: an anchor into {target}"
                assert anchor in doc_blocks.anchors(target), f"{rel} links {target}#{anchor}: no such heading"


def test_every_doc_is_one_link_from_the_readme():
    linked = {target for target, _ in doc_blocks.links("README.md")}
    for rel in doc_blocks.markdown_files()[1:]:
        assert rel in linked, f"README.md does not link {rel}"
