"""Rollout worker processes: version tags, binding, dead workers, restarts, shutdown (real processes and shm)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.marks import require_trl
from tests.pool_helpers import make_pool

pytestmark = [require_trl, pytest.mark.slow]

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def _fill(model, value_seed: int):
    import torch

    gen = torch.Generator().manual_seed(value_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


def _local_logprobs(model, tok, sampling, prompts, seed=0):
    from mrl_plugins.rollout.engine import TransformersEngine

    out = TransformersEngine(model, tok, params=sampling, seed=seed).generate(prompts, 2)
    return out.completion_ids, out.logprobs


@pytest.mark.parametrize(("codec", "tol"), [("raw", {"abs": 1e-5}), ("fp16", {"rel": 1e-3})])
def test_version_tags_match_the_weights_that_produced_them(codec, tol):
    pool, model, tok, sampling, _pm, _ctx = make_pool({"comm": {"codec": codec}})
    try:
        _fill(model, 5)
        pool.publish(5, list(model.named_parameters()))
        res5 = pool.collect(pool.submit(PROMPTS, 2, min_version=5))
        assert res5.weight_version == 5
        ids5, lps5 = _local_logprobs(model, tok, sampling, PROMPTS)
        assert res5.completion_ids == ids5  # same seed, same weights -> the same samples
        for a, b in zip(res5.logprobs, lps5):
            assert a == pytest.approx(b, **tol)  # fp16 logprobs: relative error <= 2**-11
        _fill(model, 6)
        pool.publish(6, list(model.named_parameters()))
        res6 = pool.collect(pool.submit(PROMPTS, 2, min_version=6))
        assert res6.weight_version == 6
        assert res6.prompt_ids == [p for p in PROMPTS for _ in range(2)]
        assert res6.logprobs != res5.logprobs
    finally:
        pool.close()


def test_worker_is_bound_to_its_cores_and_threads():
    import psutil

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    pool, model, *_ = make_pool()
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS[:1], 1))
        proc = psutil.Process(pool.pids[0])
        assert proc.cpu_affinity() == [1]
    finally:
        pool.close()


def test_killed_worker_is_a_clear_error_within_the_timeout():
    from mrl_plugins.rollout.pool import WorkerDiedError

    pool, model, *_ = make_pool({"rollout": {"timeout_s": 20}})
    try:
        pool.publish(0, list(model.named_parameters()))
        # the worker's start (spawn, imports, first weights) may take longer than 20 s on a loaded host:
        # the first answer gets its own deadline; the death below is seen at once (the process is gone)
        pool.collect(pool.submit(PROMPTS, 1), timeout=120)
        os.kill(pool.pids[0], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker 0 .*died.*restart_workers"):
            pool.collect(pool.submit(PROMPTS, 1))
        assert time.monotonic() - start < 5
    finally:
        pool.close()


def test_dead_worker_is_restarted_when_configured_until_the_budget_is_spent():
    from mrl_plugins.rollout.pool import WorkerDiedError

    pool, model, *_ = make_pool({"rollout": {"restart_workers": 1, "timeout_s": 60}})
    try:
        pool.publish(0, list(model.named_parameters()))
        first = pool.pids[0]
        pool.collect(pool.submit(PROMPTS, 1))
        os.kill(first, signal.SIGKILL)
        res = pool.collect(pool.submit(PROMPTS, 1))  # resubmitted to the restarted worker
        assert len(res.completion_ids) == len(PROMPTS)
        assert pool.pids[0] != first
        os.kill(pool.pids[0], signal.SIGKILL)  # the budget's one restart is used
        with pytest.raises(WorkerDiedError, match=r"restart budget is spent \(1 of rollout.restart_workers 1 used\)"):
            pool.collect(pool.submit(PROMPTS, 1))
    finally:
        pool.close()


def test_stuck_worker_times_out_instead_of_hanging(monkeypatch):
    from mrl_plugins.errors import StageTimeoutError
    from tests.pool_helpers import SlowEngine

    monkeypatch.setenv("MRL_TEST_ENGINE_DELAY_S", "30")
    pool, model, *_ = make_pool({"rollout": {"timeout_s": 2}}, factory=SlowEngine)
    try:
        pool.publish(0, list(model.named_parameters()))
        start = time.monotonic()
        with pytest.raises(StageTimeoutError, match=r"within 2 s \(timeout_s\)"):
            pool.collect(pool.submit(PROMPTS, 1))
        assert time.monotonic() - start < 6
    finally:
        pool.close(timeout=2)


def test_close_leaves_no_process_and_no_shared_memory():
    import psutil

    pool, model, *_ = make_pool()
    pool.publish(0, list(model.named_parameters()))
    pool.collect(pool.submit(PROMPTS, 1))
    pids, run_id = list(pool.pids), pool.run_id
    pool.close()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert not [f for f in os.listdir("/dev/shm") if run_id in f]


def test_moving_a_worker_drains_its_queue_to_the_others_and_keeps_serving():
    """Hybrid mode's capacity shift: a request in flight on the moving worker is still answered in full."""
    import psutil

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    pool, model, *_ = make_pool(placements=[{"cores": [1], "threads": 1}, {"cores": [1], "threads": 1}])
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS, 2))
        old_pid = pool.pids[0]
        ticket = pool.submit(PROMPTS * 2, 2)  # half of it queued on worker 0
        pool.move_worker(0, {"cores": [0], "threads": 1})  # returns after the restart, without waiting for it
        res = pool.collect(ticket)
        assert len(res.completion_ids) == len(PROMPTS) * 2 * 2
        assert res.prompt_ids == [p for p in PROMPTS * 2 for _ in range(2)]
        assert pool.pids[0] != old_pid
        pool.wait_ready()  # the moved worker reports ready (at most rollout.start_timeout_s)
        assert psutil.Process(pool.pids[0]).cpu_affinity() == [0]
        res = pool.collect(pool.submit(PROMPTS, 1))  # both workers serve again
        assert len(res.completion_ids) == len(PROMPTS) and not pool.workers.draining
    finally:
        pool.close()


def test_a_move_does_not_wait_for_the_chunks_already_handed_to_the_other_workers(monkeypatch):
    """``move_worker`` stops the worker after the chunk it is generating: the chunks still queued to it
    (handed to the other worker) are dropped, not generated again while the trainer waits for it to exit."""
    from tests.pool_helpers import SlowEngine

    delay = 3.0
    monkeypatch.setenv("MRL_TEST_ENGINE_DELAY_S", str(delay))
    place = {"cores": [0], "threads": 1}
    pool, model, *_ = make_pool({"rollout": {"timeout_s": 120}}, factory=SlowEngine, placements=[place, place])
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.wait_ready()
        first, second = pool.submit(PROMPTS, 1), pool.submit(PROMPTS, 1)  # two chunks per worker: one generating
        time.sleep(0.5)
        start = time.monotonic()
        pool.move_worker(0, place)
        took = time.monotonic() - start
        # before: the rest of the chunk it generates plus the queued one (> 2 x delay - 0.5 s); now: that rest only
        assert took < delay + 1.0, took
        for ticket in (first, second):
            assert pool.collect(ticket).prompt_ids == PROMPTS
    finally:
        pool.close()


def test_wait_ready_when_the_last_worker_gets_ready_during_its_checks(monkeypatch):
    """``wait_ready`` saw a worker not ready, and the last one became ready while it drained the workers' events."""
    pool, *_ = make_pool({"rollout": {"start_method": "spawn"}})
    try:
        drain = pool._drain_events

        def drain_until_ready() -> None:  # the race, made certain: the worker gets ready inside the drain
            drain()
            deadline = time.monotonic() + 120
            while not pool.workers.ready and time.monotonic() < deadline:
                time.sleep(0.05)

        assert not pool.ready  # spawned: still importing
        monkeypatch.setattr(pool, "_drain_events", drain_until_ready)
        assert pool.wait_ready() > 0 and pool.ready
    finally:
        pool.close()


def test_a_pool_that_fails_to_build_its_worker_specs_releases_its_ends(monkeypatch):
    """An error after the ends opened and before the workers start: the shared memory they made is unlinked."""
    from mrl_plugins.comm.shm_ring import ShmConsumer
    from mrl_plugins.weight_sync.shm import ShmSender

    paths: list[str] = []
    handle = ShmSender.receiver_handle

    def record(self):
        paths.append(self.ctl.path)
        return handle(self)

    def refuse(self, i):
        paths.append(self.path)
        raise OSError("injected: no producer handle")

    monkeypatch.setattr(ShmSender, "receiver_handle", record)
    monkeypatch.setattr(ShmConsumer, "producer_handle", refuse)
    with pytest.raises(OSError, match="injected"):
        make_pool()
    assert len(paths) == 2 and not [p for p in paths if os.path.exists(p)]


@pytest.mark.parametrize(
    "cfg",
    [{"weight_sync": {"transport": "broadcast"}}, {"plugins": {"weight_sync": "upstream"}}],
    ids=["broadcast", "upstream-per-param"],
)
def test_collective_weight_transports_reach_every_worker_of_a_pool(cfg):
    """A dedicated group of the trainer and one rank per worker: each version reaches both workers, and the
    answers (split over both) come from the published weights; moving a worker is refused (it cannot rejoin)."""
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.rollout.engine import TransformersEngine

    two = [{"cores": [1], "threads": 1}, {"cores": [1], "threads": 1}]
    pool, model, tok, sampling, *_ = make_pool({**cfg, "weight_sync": {**cfg.get("weight_sync", {}), "timeout_s": 60}},
                                               placements=two)  # fmt: skip
    try:
        for version in (1, 2):
            _fill(model, version)
            pool.publish(version, list(model.named_parameters()))
            res = pool.collect(pool.submit(PROMPTS, 2, min_version=version))
            assert res.weight_version == version and len(res.completion_ids) == 2 * len(PROMPTS)
            expected = TransformersEngine(model, tok, params=sampling).score(res.prompt_ids, res.completion_ids)
            for got, want in zip(res.logprobs, expected):  # the sampled tokens' logprobs under the published weights
                assert got == pytest.approx(want, rel=2e-3, abs=1e-4)  # fp16 frames
            assert pool.worker_versions() == [version, version]
        with pytest.raises(ConfigError, match="move_worker restarts the worker: .* which a new process cannot rejoin"):
            pool.move_worker(1, {"cores": [0], "threads": 1})
    finally:
        pool.close()


def test_broadcast_weights_reach_a_single_worker():
    pool, model, *_ = make_pool({"weight_sync": {"transport": "broadcast", "timeout_s": 60}})
    try:
        for version in (1, 2):  # the worker joins the dedicated group at its first fetch, then takes each version
            pool.publish(version, list(model.named_parameters()))
            res = pool.collect(pool.submit(PROMPTS, 1, min_version=version))
            assert res.weight_version == version and len(res.completion_ids) == len(PROMPTS)
    finally:
        pool.close()


def test_a_dead_worker_of_a_broadcast_pool_is_a_clear_error_not_a_restart():
    from mrl_plugins.rollout.pool import WorkerDiedError

    pool, model, *_ = make_pool({"rollout": {"restart_workers": 1}, "weight_sync": {"transport": "broadcast"}})
    try:
        pool.publish(1, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS, 1, min_version=1))
        os.kill(pool.pids[0], signal.SIGKILL)
        died = "not restarted: weight_sync.transport 'broadcast' .*keeps the group"
        with pytest.raises(WorkerDiedError, match=died):
            pool.collect(pool.submit(PROMPTS, 1), timeout=30)
    finally:
        pool.close(timeout=2)


@pytest.mark.parametrize("interval", [0.05, 30.0])
def test_idle_workers_poll_for_new_versions_every_poll_interval(interval):
    """weight_sync.poll_interval_s paces an idle worker's polls (a version published past the pool, so that no
    notice reaches the worker); a request naming a version is served with it."""
    pool, model, _tok, _sampling, pm, ctx = make_pool({"weight_sync": {"poll_interval_s": interval}})
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS, 1, min_version=0))  # the worker is up and serves version 0
        _fill(model, 3)
        pool.sender.publish(1, list(model.named_parameters()))  # past the pool: no notice to the worker
        deadline = time.monotonic() + 3.0
        while pool.worker_versions() != [1] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.worker_versions() == ([1] if interval < 1 else [0])
        res = pool.collect(pool.submit(PROMPTS, 1, min_version=1))
        assert res.weight_version == 1 and pool.worker_versions() == [1]
    finally:
        pool.close()


def test_a_publish_notifies_idle_workers():
    """pool.publish sends every worker a notice: an idle worker takes the version without waiting for its next
    poll (here 30 s) or for a request."""
    pool, model, *_ = make_pool({"weight_sync": {"poll_interval_s": 30.0}})
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit(PROMPTS, 1, min_version=0))
        for version in (1, 2):
            _fill(model, version)
            pool.publish(version, list(model.named_parameters()))
            deadline = time.monotonic() + 10.0
            while pool.worker_versions() != [version] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert pool.worker_versions() == [version]
    finally:
        pool.close()


RENAMER = """
from mrl_plugins.hookspecs import hookimpl


class Renamer:
    @hookimpl
    def mrl_weight_sync_map_name(self, model_id, name):
        return name.removeprefix("trainer.") if model_id == "policy" else None


plugin = Renamer()
"""


@pytest.mark.parametrize("installed", [True, False])
def test_workers_map_published_names_through_the_name_map_hook(install_dist, installed):
    """The trainer publishes names its workers' models do not have; an installed plugin's
    mrl_weight_sync_map_name maps them in the worker processes, without one it is a clear error."""
    from mrl_plugins.errors import MrlError

    if installed:
        install_dist("renamer", {"renamer": "renamer_plug:plugin"}, {"renamer_plug": RENAMER})
    pool, model, tok, sampling, *_ = make_pool({"rollout": {"timeout_s": 30}})
    try:
        _fill(model, 7)
        published = [(f"trainer.{n}", p) for n, p in model.named_parameters()]
        pool.publish(1, published)
        if installed:
            res = pool.collect(pool.submit(PROMPTS, 2, min_version=1))
            assert res.weight_version == 1
            assert res.completion_ids == _local_logprobs(model, tok, sampling, PROMPTS)[0]  # the published weights
        else:
            with pytest.raises(MrlError, match=r"received tensor 'trainer\.model\.embed_tokens\.weight' has no dest"):
                pool.collect(pool.submit(PROMPTS, 2, min_version=1))
    finally:
        pool.close()
