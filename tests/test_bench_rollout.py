"""``python -m benchmarks rollout --part b``: every setting trains the same job, and the real command's keys with
--quick (nothing here is timed or compared; the lead measures on a quiet host)."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.rollout import grpo_settings
from mrl_plugins.config import load_yaml
from mrl_plugins.run import preflight
from tests.conftest import benchmarks_command, benchmarks_env
from tests.marks import require_trl


def test_part_b_settings_differ_only_in_stages_placement_and_threads():
    settings = grpo_settings(steps=12, model="tiny")
    assert set(settings) >= {"upstream_1_thread", "disaggregated_async", "auto"}
    job = load_yaml("compare_small")["train"]
    trains = {name: dict(data["train"]) for name, (_kind, data) in settings.items()}
    assert trains["upstream_1_thread"].pop("threads") == 1
    for name, train in trains.items():
        assert train == {**job, "steps": 12, "model": "tiny"}, name  # same learning rate, seed, TRL arguments
    assert settings["disaggregated_async"][1]["rollout"]["old_logps"] == "engine"
    assert settings["auto"][1]["rollout"]["placement"] == "auto"
    assert {data["plugins"]["rollout"] for _kind, data in settings.values()} == {"upstream", "mrl"}
    for _name, (kind, data) in settings.items():  # each is a config its run accepts
        preflight(data, enable_plugins=not kind.vanilla)


def test_part_b_frozen_trains_every_setting_with_learning_rate_zero():
    frozen = grpo_settings(steps=12, model="tiny", frozen=True)
    learning = grpo_settings(steps=12, model="tiny")
    assert {cfg["train"]["learning_rate"] for _, cfg in frozen.values()} == {0.0}
    assert all(cfg["train"].get("learning_rate", 1) != 0 for _, cfg in learning.values())
    for name, (_, cfg) in frozen.items():  # nothing else differs
        other = dict(learning[name][1]["train"])
        assert {**other, "learning_rate": 0.0} == cfg["train"]


def test_part_b_on_a_kl_job_lets_the_worker_score_the_reference():
    settings = grpo_settings(steps=12, model="tiny", job="compare_kl")
    job = load_yaml("compare_kl")["train"]
    assert job["trl_args"]["beta"] > 0
    for name, (_kind, data) in settings.items():
        train = {k: v for k, v in data["train"].items() if k != "threads"}
        assert train == {**job, "steps": 12, "model": "tiny"}, name
    assert settings["disaggregated_async"][1]["rollout"]["ref_logps"] == "engine"
    assert settings["auto"][1]["rollout"]["placement"] == "auto"
    assert "ref_logps" not in grpo_settings(steps=12, model="tiny")["disaggregated_async"][1]["rollout"]
    for _name, (kind, data) in settings.items():
        preflight(data, enable_plugins=not kind.vanilla)


def test_part_b_refuses_an_unknown_job_before_running_anything():
    proc = subprocess.run(
        benchmarks_command("rollout", "--job", "nope"),
        capture_output=True, text=True, timeout=120, env=benchmarks_env(),
    )  # fmt: skip
    assert proc.returncode == 2 and "'nope' not found" in proc.stderr and "compare_kl" in proc.stderr, proc.stderr
    assert "(a)" not in proc.stdout  # part (a) did not start


@pytest.mark.slow
@require_trl
def test_bench_rollout_part_b_reports_bounds_and_work_per_step(tmp_path):
    """The real command with --quick on the KL job (four short GRPO runs of the tiny model; nothing is timed)."""
    out = tmp_path / "b.json"
    cmd = benchmarks_command("rollout", "--quick", "--part", "b", "--job", "compare_kl", "--json", str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=benchmarks_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    grpo, ratios = data["grpo"], data["ratios"]
    assert grpo["job"] == "compare_kl"
    one, best = grpo["settings"]["upstream_1_thread"], grpo["settings"][grpo["upstream_best"]]
    balance = 2 * one["steps_per_s"]["median"] / best["steps_per_s"]["median"]
    assert ratios["balance_bound_vs_upstream"] == pytest.approx(balance)
    assert ratios["overlap_bound_vs_upstream"] == ratios["balance_bound_vs_upstream"]  # KL term: the even split
    assert ratios["share_of_overlap_bound"] == pytest.approx(
        ratios["steps_per_s_vs_upstream"] / ratios["overlap_bound_vs_upstream"]
    )
    assert ratios["async_tokens_per_step_vs_upstream"] > 0 and ratios["auto_tokens_per_step_vs_upstream"] > 0
