"""``mrl bench ray --quick``: one invocation runs the same job with ``launcher: local`` and ``ray`` on a Ray cluster
it starts for the purpose, measures Ray's idle and running cost, and leaves no process of that cluster behind.
Figures are not asserted (a quiet host is needed for them); their presence and sanity are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.marks import require_ray, require_trl

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@require_ray
@require_trl
def test_bench_ray_quick_compares_launchers_and_measures_rays_cost(tmp_path):
    out = tmp_path / "bench.json"
    before = {p.name for p in Path("/tmp").glob("mrlbench-ray-*")}
    got = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", "bench", "ray", "--quick", "--launchers", "local,ray",
         "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=tmp_path,
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("local", "ray"):
        entry = res["launchers"][name]
        assert entry["steps_per_s"]["n"] == 1 and entry["steps_per_s"]["median"] > 0
        assert entry["runs"][0]["restarts"] == 0 and entry["runs"][0]["host_load"]["wall_s"] > 0
    assert res["ratios"]["ray_vs_local_steps_per_s"] > 0
    idle = res["ray_idle"]
    assert {"gcs_server", "raylet"} <= set(idle["processes"]) and idle["rss_mb"] > 50  # Ray's daemons, resident
    assert 0 <= idle["cpu_share_of_one_core"] < 1.5
    during = res["launchers"]["ray"]["runs"][0]["ray_during_run"]
    assert during["samples"] > 10 and 0 <= during["contended_share"] <= 1
    assert "raylet" in during["cpu_s_by_process"] and during["allowed_cores"]["raylet"]  # measured, with its cores
    assert res["ray_processes_left"] == []  # the benchmark's cluster is gone
    assert {p.name for p in Path("/tmp").glob("mrlbench-ray-*")} == before  # and its session folder
