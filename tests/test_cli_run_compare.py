"""``mrl run`` and a short ``mrl compare`` on the tiny preset (the full small comparison is a benchmark)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.marks import require_trl

pytestmark = [require_trl, pytest.mark.slow]


def _mrl(*args: str, cwd, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    env.pop("MRL_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _no_warmup_config(tmp_path, name: str):
    """A bundled config with rollout.local_warmup off: tiny runs are shorter than a worker's start-up."""
    import yaml

    from mrl_plugins.config import load_yaml

    data = load_yaml(name)
    data.setdefault("rollout", {})["local_warmup"] = False
    path = tmp_path / f"{name}-nowarmup.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_mrl_run_trains_and_writes_json(tmp_path):
    config = _no_warmup_config(tmp_path, "colocate")
    proc = _mrl("run", config, "--model", "tiny", "--steps", "3", "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "switch model_id=policy" in proc.stderr  # version log lines reach the run log
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 3 and len(result["rewards"]) == 3
    assert result["plugins"]["rollout"] == "mrl.rollout"
    assert result["mrl_metrics"]["mrl/weights/bytes"] > 0


def test_mrl_run_bad_config_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: cluster\n")
    proc = _mrl("run", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert "mode" in proc.stderr and "colocate" in proc.stderr and "Traceback" not in proc.stderr


def test_mrl_compare_tiny_writes_report(tmp_path):
    out = tmp_path / "cmp"
    proc = _mrl(
        "compare",
        "--config",
        _no_warmup_config(tmp_path, "compare_small"),
        "--model",
        "tiny",
        "--steps",
        "3",
        "--runs",
        "upstream,all",
        "--out",
        str(out),
        "--json",
        str(tmp_path / "c.json"),
        "--tolerance",
        "0.99",
        cwd=tmp_path,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for name in ("report.md", "report.json", "reward.png", "time_split.png"):
        assert (out / name).stat().st_size > 0, name
    report = json.loads((tmp_path / "c.json").read_text())
    assert set(report["runs"]) == {"upstream", "all"}
    assert math.isfinite(report["speedup"]) and report["speedup"] > 0
    for run in report["runs"].values():
        assert run["steps"] == 3 and run["steps_per_s"] > 0 and run["wall_s"] > 0
        assert run["time_split"]["generate"] > 0 and run["time_split"]["train"] > 0
        assert math.isfinite(run["final_reward"])
    assert report["runs"]["all"]["mrl_metrics"]["mrl/comm/bytes"] > 0
    assert "| upstream |" in (out / "report.md").read_text()


def test_mrl_compare_fails_when_reward_drops(tmp_path):
    """tolerance 0 and a plugin run whose reward differs from upstream's: at least one direction fails."""
    out = tmp_path / "cmp"
    proc = _mrl(
        "compare",
        "--model",
        "tiny",
        "--steps",
        "3",
        "--runs",
        "upstream,all",
        "--out",
        str(out),
        "--tolerance",
        "0",
        cwd=tmp_path,
        timeout=900,
    )
    report = json.loads((out / "report.json").read_text())
    below = report["final_reward"]["all"] < report["final_reward"]["upstream"]
    assert proc.returncode == (1 if below else 0)
    assert report["reward_ok"] is (not below)
