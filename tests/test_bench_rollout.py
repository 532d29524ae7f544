"""``mrl bench rollout --part b``: every setting trains the same job (nothing here is run or timed; the lead
measures on a quiet host)."""

from __future__ import annotations

from mrl_plugins.bench.rollout import grpo_settings
from mrl_plugins.config import load_yaml
from mrl_plugins.run import preflight


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
