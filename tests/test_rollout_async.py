"""Async pipeline and staleness bound on real TRL GRPO runs (tiny model, one rollout worker process).

Delays are injected through a test plugin's ``slow`` engine (worker side) and a slow reward
function (trainer side).
"""

from __future__ import annotations

import time

import pytest

from tests.marks import require_trl

pytestmark = [require_trl, pytest.mark.slow]


def _slow_reward(completions, **kwargs):
    from mrl_plugins.demo.models import count_reward

    time.sleep(0.2)
    return count_reward(completions)


def _run(
    tmp_path, install_dist, monkeypatch, rollout: dict, *, engine_delay=0.0, slow_trainer=False, steps=5, trl_args=None
):
    import torch

    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    install_dist("slowplug", {"slowplug": "tests.pool_helpers:slow_engine_plugin"}, {})
    monkeypatch.setenv("MRL_TEST_ENGINE_DELAY_S", str(engine_delay))
    torch.set_num_threads(1)
    train = {"model": "tiny", "steps": steps, "output_dir": str(tmp_path), "trl_args": trl_args or {}}
    cfg = load_config({"train": train})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    if slow_trainer:
        trainer.reward_funcs = [_slow_reward]
    mrl_plugins.enable(
        trainer,
        {"mode": "disaggregated", "rollout": {"engine": "slow", "workers": 1, "local_warmup": False, **rollout}},
    )
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hist) == steps
    return hist


def _series(hist, key):
    return [h.get(key, 0.0) for h in hist]


@pytest.mark.parametrize(("engine_delay", "slow_trainer"), [(0.3, False), (0.0, True)])
def test_staleness_never_exceeds_the_bound(tmp_path, install_dist, monkeypatch, engine_delay, slow_trainer):
    hist = _run(
        tmp_path, install_dist, monkeypatch, {"max_staleness": 1}, engine_delay=engine_delay, slow_trainer=slow_trainer
    )
    assert max(_series(hist, "mrl/rollout/staleness")) <= 1
    assert sum(_series(hist, "mrl/rollout/lookahead_hits")) >= 3  # generation ran one batch ahead


#: a bound every lookahead breaks: generating ahead (``pipeline`` and ``stale_policy`` are internal, derived from
#: ``max_staleness``, whose 0 means taking turns) with samples allowed no version of lag -- the safety net of a sample
#: older than the bound, which a one-batch lookahead under max_staleness >= 1 never is, reached on every batch
OVER_THE_BOUND = {"max_staleness": 0, "pipeline": "async"}


def test_samples_over_the_bound_are_dropped_and_regenerated(tmp_path, install_dist, monkeypatch):
    rollout = {**OVER_THE_BOUND, "stale_policy": "drop"}
    hist = _run(tmp_path, install_dist, monkeypatch, rollout, engine_delay=0.1)
    assert max(_series(hist, "mrl/rollout/staleness")) == 0
    assert sum(_series(hist, "mrl/rollout/dropped_samples")) > 0


def test_keep_policy_counts_stale_samples(tmp_path, install_dist, monkeypatch):
    hist = _run(tmp_path, install_dist, monkeypatch, {**OVER_THE_BOUND, "stale_policy": "keep"}, engine_delay=0.1)
    assert max(_series(hist, "mrl/rollout/staleness")) == 1
    assert sum(_series(hist, "mrl/rollout/stale_samples")) > 0
    assert sum(_series(hist, "mrl/rollout/dropped_samples")) == 0


def test_lookahead_stays_one_version_old_with_num_iterations(tmp_path, install_dist, monkeypatch):
    """TRL num_iterations=2 generates every 2 optimizer steps: the lookahead is submitted one step before."""
    hist = _run(
        tmp_path,
        install_dist,
        monkeypatch,
        {"max_staleness": 1},
        engine_delay=0.05,
        steps=6,
        trl_args={"num_iterations": 2},
    )
    assert max(_series(hist, "mrl/rollout/staleness")) <= 1
    assert sum(_series(hist, "mrl/rollout/dropped_samples")) == 0  # nothing regenerated synchronously
    assert sum(_series(hist, "mrl/rollout/deferred_lookaheads")) >= 2
    assert sum(_series(hist, "mrl/rollout/lookahead_hits")) >= 2
