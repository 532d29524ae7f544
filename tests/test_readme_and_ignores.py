"""What a new user pastes or produces: the README's selective-activation YAML loads, and the folders the CLI
writes by default are ignored by git."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import doc_blocks
from tests.marks import require_trl

REPO_ROOT = Path(__file__).resolve().parents[1]


def _readme_yaml(heading: str) -> str:
    """The first ```yaml block after the README heading ``heading``."""
    return doc_blocks.block(heading, "yaml")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    return env


def test_readme_selective_activation_yaml_loads_as_pasted(tmp_path):
    from mrl_plugins.config import load_config
    from mrl_plugins.manager import get_plugin_manager

    data = yaml.safe_load(_readme_yaml("Selective activation"))
    cfg = load_config(data)
    mgr = get_plugin_manager(data)  # plugin selection and backend names: where the pasted snippet used to fail
    for stage, name in cfg.plugins.as_dict().items():
        assert mgr.selected[stage] == name, (stage, mgr.selected)
    assert {r.name for r in mgr.plugin_infos() if r.blocked} == set(cfg.disable)


@require_trl
@pytest.mark.slow
def test_readme_selective_activation_yaml_trains_as_pasted(tmp_path):
    """The snippet, pasted into a file, is a config ``mrl run`` trains with (tiny preset, 2 steps)."""
    path = tmp_path / "selective.yaml"
    path.write_text(_readme_yaml("Selective activation"), encoding="utf-8")
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mrl_plugins.cli.main", "run", str(path), "--model", "tiny", "--steps", "2"]
    proc = subprocess.run(
        [*cmd, "--json", str(out), "--quiet"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=_clean_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    wanted = yaml.safe_load(path.read_text())["plugins"]
    assert result["steps"] == 2
    assert result["plugins"] == wanted


def _compare_defaults(monkeypatch) -> dict[str, object]:
    """``mrl compare``'s argument defaults, read from its own parser (nothing is run)."""
    from mrl_plugins.cli import compare

    seen: dict[str, object] = {}

    def capture(self, args=None, namespace=None):
        seen.update({a.dest: a.default for a in self._actions})
        raise SystemExit(0)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(SystemExit):
        compare.cli([])
    return seen


def test_default_output_folders_are_ignored_by_git(monkeypatch):
    git = shutil.which("git")
    if git is None or not (REPO_ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    from mrl_plugins.config import TrainConfig

    folders = {
        "mrl compare --out": str(_compare_defaults(monkeypatch)["out"]),
        "train.output_dir (mrl run, mrl compare's runs)": TrainConfig().output_dir,
        "TRL's own default output_dir (mrl trl grpo without one)": "trainer_output",
    }
    for what, folder in folders.items():
        probe = f"{folder.rstrip('/')}/report.json"
        proc = subprocess.run(
            [git, "check-ignore", "-q", "--no-index", probe], cwd=REPO_ROOT, capture_output=True, timeout=60
        )
        assert proc.returncode == 0, f"{what}: {folder}/ is not in .gitignore"
