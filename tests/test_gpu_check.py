"""The GPU check's script (benchmarks/gpu/run.sh) in its --cpu mode: the same parts as on a GPU, with qwen2-tiny.

What CI can run of it, so that the script a lent GPU runs never rots: the CUDA tests are collected and skipped,
the compare runs vanilla TRL and the plugin for real, and summarize.py reads what they left.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.marks import require_trl


def test_gpu_summary_reads_nvidia_smi_samples(tmp_path):
    """The CSV lines nvidia-smi wrote on the H200 (2026-12-04): GPU index, utilization %, memory MiB; pid, MiB."""
    from mrl_plugins.cli.hostload import gpu_summary

    (tmp_path / "gpu.csv").write_text("0, 0, 4\n0, 12, 1502\n0, 30, 15444\n0, 0, 15444\n", encoding="ascii")
    (tmp_path / "apps.csv").write_text("765, 14\n765, 1250\n943, 2874\n765, 15444\n", encoding="ascii")
    got = gpu_summary(tmp_path, root_pid=765)
    assert got["samples"] == 4 and got["util_mean"] == pytest.approx(10.5) and got["util_max"] == 30
    assert got["busy_share"] == 0.5 and got["memory_used_max_mb"] == 15444
    assert got["process_max_mb"] == {"765": 15444.0, "943": 2874.0} and got["root_max_mb"] == 15444.0
    assert gpu_summary(tmp_path / "absent")["samples"] == 0


@require_trl
@pytest.mark.slow
def test_run_sh_cpu_mode_runs_every_part_and_summarizes(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, MRL_GPU_STEPS="4", MRL_GPU_BUDGET_S="400")
    proc = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "gpu" / "run.sh"), "--cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert {p.name for p in out.iterdir()} == {
        "run.log", "summary.json", "summary.md", "cuda_tests.log", "report.md", "results.tar.gz",
    }  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mode"] == "cpu" and summary["problems"] == []
    assert set(summary["parts"]) == {"env", "tests", "compare"}  # no install on a CPU
    assert all(p["rc"] == 0 for p in summary["parts"].values())
    tests = summary["tests"]
    assert tests["counts"]["skipped"] == len(tests["cases"]) >= 7  # collected, skipped without CUDA
    assert summary["compare_finished"] and summary["env"]["cuda_available"] is False
    kinds = summary["kinds"]
    assert set(kinds) == {"upstream", "all"}
    for kind in kinds.values():
        assert kind["repeats"] == 2 and kind["steps"] == [4, 4]
        assert kind["steps_per_s"]["median"] > 0 and len(kind["rewards"][0]) == 4
    assert kinds["upstream"]["x_upstream"] == 1.0 and kinds["all"]["x_upstream"] > 0
    assert kinds["all"]["weight_publish_ms_per_version"]["median"] > 0  # the plugin published weights
    assert "| upstream | 2 |" in (out / "summary.md").read_text()
    with tarfile.open(out / "results.tar.gz") as tar:
        names = tar.getnames()
    assert "work/compare/report.json" in names and "work/cuda_tests.xml" in names
    assert any(Path(n).name == "all-2.log" for n in names)
