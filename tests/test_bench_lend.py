"""``python -m benchmarks rollout --part c`` (lending on vs off): the pure helpers, and the real command's keys with
--quick (two short real GRPO runs of the tiny model; nothing here is timed or compared, the lead measures on a quiet
host)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from benchmarks.lend import percentile, request_seconds
from tests.conftest import benchmarks_command, benchmarks_env
from tests.marks import require_trl


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 99) == 99.0 and percentile(values, 100) == 100.0
    assert percentile([3.0, 1.0, 2.0], 99) == 3.0
    assert math.isnan(percentile([], 99))


def test_request_seconds_skips_each_workers_first_generation():
    result = {"timeline": {"worker": [[0, "generate", 1.0, 3.0], [1, "generate", 1.5, 2.0], [0, "apply", 3.0, 3.1],
                                      [0, "generate", 4.0, 4.25], [1, "generate", 5.0, 5.5]]}}  # fmt: skip
    assert request_seconds(result) == [0.25, 0.5]
    assert request_seconds({}) == []


@pytest.mark.slow
@require_trl
def test_bench_rollout_part_c_reports_lend_on_and_off(tmp_path):
    out = tmp_path / "lend.json"
    cmd = benchmarks_command("rollout", "--quick", "--part", "c", "--json", str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=benchmarks_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(data["ratios"]) == {"lend_p99_generate_on_vs_off", "lend_steps_per_s_on_vs_off"}
    assert data["ratios"]["lend_steps_per_s_on_vs_off"] > 0
    settings = data["lend"]["settings"]
    assert set(settings) == {"lend_on", "lend_off"}
    for s in settings.values():
        assert s["steps_per_s"]["median"] > 0 and s["steps_per_s"]["n"] == 1
        assert set(s["generate_s"]) == {"p50", "p99", "max", "n"}
        run = s["runs"][0]
        assert run["cores"]["samples"] > 0 and 0.0 <= run["cores"]["oversubscribed_share"] <= 1.0
        assert run["cores"]["core_busy_share"] and run["cores"]["trainer_cores_allowed"]
        assert "before" in run["host_load"] and "during" in run["host_load"]
    assert settings["lend_off"]["lends"]["median"] == 0  # lend_cores: false reached the run
