"""``python -m benchmarks ray --quick``: one invocation runs the same job with ``launcher: local`` and ``ray_apart``
(Ray's own processes started on the first core, the rollout actor bound to the second: ``rollout.ray_worker_cores``)
on a Ray cluster it starts for the purpose, measures Ray's idle and running cost, and leaves no process of that cluster
behind. Figures are not asserted (a quiet host is needed for them); their presence and sanity are, and that no
thread of Ray's own processes was ever runnable on the actor's core."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import benchmarks_command, benchmarks_env
from tests.marks import require_ray, require_trl

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@require_ray
@require_trl
def test_bench_ray_quick_compares_launchers_and_measures_rays_cost(tmp_path):
    out = tmp_path / "bench.json"
    before = {p.name for p in Path("/tmp").glob("mrlbench-ray-*")}
    got = subprocess.run(
        benchmarks_command("ray", "--quick", "--launchers", "local,ray_apart", "--json", str(out)),
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=benchmarks_env(),
    )  # fmt: skip
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    res = json.loads(out.read_text())
    for name in ("local", "ray_apart"):
        entry = res["launchers"][name]
        assert entry["steps_per_s"]["n"] == 1 and entry["steps_per_s"]["median"] > 0
        assert entry["runs"][0]["restarts"] == 0 and entry["runs"][0]["host_load"]["wall_s"] > 0
    assert res["ratios"]["ray_apart_vs_local_steps_per_s"] > 0
    idle = res["ray_idle"]
    assert {"gcs_server", "raylet"} <= set(idle["processes"]) and idle["rss_mb"] > 50  # Ray's daemons, resident
    assert 0 <= idle["cpu_share_of_one_core"] < 1.5
    during = res["launchers"]["ray_apart"]["runs"][0]["ray_during_run"]
    assert during["samples"] > 10 and 0 <= during["contended_share"] <= 1
    assert "raylet" in during["cpu_s_by_process"]  # measured, with its cores: the first only (`taskset -c`)
    first, second = sorted(os.sched_getaffinity(0))[:2]
    assert {name: cores for name, cores in during["allowed_cores"].items() if cores != [first]} == {}, during
    assert during["trainer_cores_allowed"] == [first] and during["actor_cores_allowed"] == [second], during
    assert during["contended_share_actor_on_its_cores"] == 0, during  # Ray's processes never ran where it did
    assert res["ray_processes_left"] == []  # the benchmark's cluster is gone
    assert {p.name for p in Path("/tmp").glob("mrlbench-ray-*")} == before  # and its session folder
