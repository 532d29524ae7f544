"""The documentation a TRL user reads first: ``docs/config.md`` is what the config dataclasses say, and what the
README promises about links, the test command, the bundled configs and the TRL CLI line holds (its code blocks,
the quick start run as pasted included: tests/test_readme_blocks.py)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

from tests import doc_blocks
from tests.doc_blocks import REPO_ROOT


def _readme() -> str:
    return doc_blocks.text("README.md")


def _block(heading: str, lang: str) -> str:
    """The first fenced ``lang`` block after the README heading ``heading``."""
    return doc_blocks.block(heading, lang)


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return env


# --------------------------------------------------------------------------- docs/config.md


def test_config_reference_is_current():
    """docs/config.md is exactly what the generator writes from the dataclasses today."""
    from benchmarks import config_docs as docs

    committed = (REPO_ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert committed == docs.render(), "docs/config.md is out of date: run `python -m benchmarks.config_docs`"


def test_config_reference_names_every_key_with_its_help():
    """Every setting of every section is a row carrying its default and its help text (a new field shows up); an
    internal field (no setting: mrl_plugins.config_fields) has no row."""
    import typing

    from benchmarks import config_docs as docs
    from mrl_plugins.config_fields import is_internal

    text = docs.render()
    for key, cls, _ in docs._sections():
        for f in dataclasses.fields(cls):
            if is_internal(f):
                name = f"{key}.{f.name}" if key else f.name
                assert not any(ln.startswith(f"| `{name}` |") for ln in text.splitlines()), name
                continue
            nested = not key and dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])
            name = f"{key}.{f.name}" if key else f.name
            row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |")), None)
            assert row is not None, f"no row for {name}"
            assert f.metadata.get("help"), f"{name} has no help text"
            assert docs._md(f.metadata["help"]) in row, name
            if not nested and f.name not in ("rollout", "weight_sync", "comm"):
                assert f"`{docs._value(docs._default(f))}`" in row, name


def test_generator_cli_writes_and_checks(tmp_path):
    """``python -m benchmarks.config_docs`` writes the file; ``--check`` passes on it and fails on a stale one."""
    out = tmp_path / "docs" / "config.md"
    cmd = [sys.executable, "-m", "benchmarks.config_docs", "--out", str(out)]
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
    the README's table names are the shipped ones, and the TRL CLI's ``MRL_PLUGINS`` line names one of them."""
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
    named = re.findall(r"^\s*MRL_PLUGINS: (\S+)", _block("With the TRL CLI", "yaml"), re.M)
    assert named, "the TRL CLI block sets no MRL_PLUGINS"
    for name in named:
        assert name in bundled_configs()
