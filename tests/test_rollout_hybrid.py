"""Hybrid mode's first rebalancing policy: the decision rule, a real pool moving a worker while it serves,
and a real TRL GRPO run that moves a worker between the pools."""

from __future__ import annotations

import os
import time

import pytest

from mrl_plugins.rollout.hybrid import COLOCATED, DEDICATED, Move, decide
from tests.marks import require_trl
from tests.pool_helpers import make_pool

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]
KW = {"window": 3, "high": 0.25, "low": 0.05}


def test_policy_waits_for_a_full_window():
    assert decide([0.9, 0.9], [DEDICATED, DEDICATED], **KW) is None


def test_generation_bound_trainer_borrows_its_device_for_inference():
    move = decide([0.1, 0.5, 0.6, 0.7], [DEDICATED, DEDICATED, DEDICATED], **KW)
    assert move == Move(2, COLOCATED, pytest.approx(0.6))


def test_the_last_dedicated_worker_never_moves():
    assert decide([0.9] * 3, [COLOCATED, DEDICATED], **KW) is None


def test_trainer_bound_run_gives_the_device_back_to_training():
    assert decide([0.0, 0.01, 0.02], [COLOCATED, COLOCATED, DEDICATED], **KW) == Move(1, DEDICATED, 0.01)
    assert decide([0.0] * 3, [DEDICATED, DEDICATED], **KW) is None  # nothing colocated to give back


def test_between_the_thresholds_nothing_moves():
    assert decide([0.1, 0.2, 0.1], [COLOCATED, DEDICATED, DEDICATED], **KW) is None


def _driven(balancer, monkeypatch):
    """``observe(wait_s, now)``: one generation of ``balancer`` at ``now`` on its clock; returns whether it moved a
    worker (``rollout/hybrid/moves``; where to: ``balancer.pools``)."""
    import types

    from mrl_plugins.rollout import hybrid

    clock = [0.0]
    monkeypatch.setattr(hybrid, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))

    def observe(wait_s: float, now: float) -> bool:
        clock[0] = now
        moves = balancer.metrics.totals.get("rollout/hybrid/moves", 0)
        balancer.observe(wait_s)
        return balancer.metrics.totals.get("rollout/hybrid/moves", 0) > moves

    return observe


def test_bad_settings_are_refused():
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.rebalance_low/rebalance_high: need low < high, got 0.5 and 0.4"):
        load_config({"rollout": {"rebalance_low": 0.5, "rebalance_high": 0.4}})
    with pytest.raises(ConfigError, match=r"rollout\.rebalance_high: must be <= 1, got 1.5"):
        load_config({"rollout": {"rebalance_high": 1.5}})


@pytest.mark.slow
@require_trl
def test_no_decision_while_a_worker_moves(monkeypatch):
    """Two workers: a move leaves one active worker until the moved one is ready again; a decision meanwhile (which
    would move the other one) waits, and the generations meanwhile are not measured."""
    from mrl_plugins.rollout.hybrid import HybridBalancer

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    shared, own = {"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}
    # spawned: the moved worker takes seconds to be ready again
    pool, model, *_, ctx = make_pool({"rollout": {"start_method": "spawn"}}, placements=[shared, own])
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.wait_ready()
        balancer = HybridBalancer(pool, [shared, own], [COLOCATED, DEDICATED], shared, window=1, high=0.5, low=0.1,
                                  metrics=ctx.metrics)  # fmt: skip
        observe = _driven(balancer, monkeypatch)
        observe(0.0, now=10.0)
        assert observe(0.0, now=11.0) and balancer.pools == [DEDICATED, DEDICATED]  # trainer-bound: worker 0 moves out
        assert pool.workers.draining == {0}
        assert not observe(0.9, now=12.0)  # generation-bound, but worker 0 is still moving
        assert list(balancer.shares) == []
        pool.wait_ready()
        assert len(pool.collect(pool.submit(PROMPTS, 1)).completion_ids) == len(PROMPTS)
        assert not pool.workers.draining
        assert observe(0.9, now=13.0) and balancer.pools == [DEDICATED, COLOCATED]  # decisions again once it is ready
        assert ctx.metrics.totals["rollout/hybrid/wait_share"] == pytest.approx(0.9)
    finally:
        pool.close()


@pytest.mark.slow
@require_trl
def test_balancer_moves_a_worker_of_a_live_pool_without_stopping_the_service(monkeypatch, caplog):
    import logging

    import psutil

    from mrl_plugins.rollout.hybrid import HybridBalancer

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    shared, own = {"cores": [0], "threads": 1}, {"cores": [1], "threads": 1}
    pool, model, *_, ctx = make_pool(placements=[shared, own])
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS, 1))
        balancer = HybridBalancer(pool, [shared, own], [COLOCATED, DEDICATED], shared, window=2, high=0.5, low=0.1,
                                  metrics=ctx.metrics)  # fmt: skip
        observe = _driven(balancer, monkeypatch)
        old_pid = pool.pids[0]
        in_flight = pool.submit(PROMPTS * 2, 2)
        assert not observe(0.0, now=10.0)  # first call only starts the clock
        assert "rollout/hybrid/wait_share" not in ctx.metrics.totals
        assert not observe(0.01, now=11.0)  # window not full yet
        assert ctx.metrics.totals["rollout/hybrid/wait_share"] == pytest.approx(0.01)  # 0.01 s of 1 s
        with caplog.at_level(logging.INFO, logger="mrl_plugins.rollout"):
            assert observe(0.06, now=13.0)  # trainer hardly waits: give the trainer's cores back
        assert "hybrid: worker 0 -> dedicated pool (mean wait share 0.02 over 2 generations)" in caplog.text
        assert balancer.pools == [DEDICATED, DEDICATED] and balancer.placements[0] == own
        res = pool.collect(in_flight)  # answered in full while worker 0 restarts on its new cores
        assert len(res.completion_ids) == len(PROMPTS) * 2 * 2
        assert len(pool.collect(pool.submit(PROMPTS, 1)).completion_ids) == len(PROMPTS)  # keeps serving
        deadline = time.monotonic() + 120
        while not pool.ready and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.ready and pool.pids[0] != old_pid
        assert psutil.Process(pool.pids[0]).cpu_affinity() == [1]
        res = pool.collect(pool.submit(PROMPTS * 2, 1))  # worker 0 takes its share again
        assert len(res.completion_ids) == len(PROMPTS) * 2
        assert not observe(0.0, now=14.0) and list(balancer.shares) == [0.0]  # window restarted after the move
    finally:
        pool.close()


@pytest.mark.slow
@require_trl
def test_hybrid_grpo_run_rebalances_and_trains(tmp_path, monkeypatch):
    """Thresholds set so that any real run counts as trainer-bound: the colocated worker must move out. The run
    trains past the workers' start bound first: a move later than that is no start to wait for (the other worker
    serves while the moved one restarts)."""
    import torch

    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": "tiny", "steps": 10, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    rollout = {"workers": 2, "colocated_workers": 1, "rebalance": True, "rebalance_window": 2}
    rollout |= {"rebalance_low": 0.98, "rebalance_high": 0.99, "start_timeout_s": 30.0}
    monkeypatch.setenv("MRL_ALLOW_INTERNAL_KEYS", "1")  # start_timeout_s: derived from timeout_s otherwise
    mrl_plugins.enable(trainer, {"mode": "hybrid", "rollout": rollout})
    pool = trainer._mrl_state.runtime.pool
    deadline = time.monotonic() + 120
    while not pool.ready and time.monotonic() < deadline:  # tiny steps would all finish during the warm-up
        time.sleep(0.05)
    time.sleep(max(0.0, pool.started_at + 31.0 - time.monotonic()))  # past the start bound
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hist) == 10
    assert sum(h.get("mrl/rollout/hybrid/moves", 0) for h in hist) >= 1
    moved = next(i for i, h in enumerate(hist) if h.get("mrl/rollout/hybrid/moves"))
    assert not any(h.get("mrl/rollout/local_batches") for h in hist[moved + 1 :])  # the other worker served
    assert [h["mrl/rollout/hybrid/colocated_workers"] for h in hist if "mrl/rollout/hybrid/colocated_workers" in h][
        0
    ] == 0
