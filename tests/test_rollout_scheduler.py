"""Multi-model scheduler: priorities, round-robin, FIFO, aging, switch throttling, thread safety (real threads)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import pytest

from mrl_plugins.errors import ConfigError, StageTimeoutError
from mrl_plugins.rollout.scheduler import BackpressureError, ModelScheduler, SchedulerClosedError


def drain(s: ModelScheduler) -> list[tuple[str, object]]:
    order = []
    while (t := s.next_request(timeout=0)) is not None:
        order.append((t.model_id, t.request))
        t.set_result(None)
    return order


def test_priority_then_fifo_within_model():
    s = ModelScheduler({"ref": 1, "policy": 0}, aging_s=None)
    for i in range(3):
        s.submit("ref", f"r{i}")
    for i in range(3):
        s.submit("policy", f"p{i}")
    assert drain(s) == [
        ("policy", "p0"),
        ("policy", "p1"),
        ("policy", "p2"),
        ("ref", "r0"),
        ("ref", "r1"),
        ("ref", "r2"),
    ]


def test_big_backlog_does_not_hold_up_small_model_of_same_priority():
    """100 queued 'big' requests, then 3 'small' ones: small ones are served within the next 6 picks."""
    s = ModelScheduler({"big": 0, "small": 0})
    for i in range(100):
        s.submit("big", i)
    for i in range(3):
        s.submit("small", i)
    order = drain(s)
    small_pos = [k for k, (m, _) in enumerate(order) if m == "small"]
    assert small_pos[-1] <= 6
    assert [r for m, r in order if m == "small"] == [0, 1, 2]
    assert [r for m, r in order if m == "big"] == list(range(100))


def test_aging_lifts_low_priority_into_round_robin_but_not_above():
    s = ModelScheduler({"hi": 0, "lo": 5}, aging_s=0.05)
    s.submit("lo", "old")
    time.sleep(0.3)  # 6 aging steps: 'lo' reaches the top level (never better than 0)
    for i in range(4):
        s.submit("hi", i)
    order = drain(s)
    assert order.index(("lo", "old")) <= 1  # joins the round-robin at the top level...
    s2 = ModelScheduler({"hi": 0, "lo": 5}, aging_s=None)
    s2.submit("lo", "old")
    time.sleep(0.05)
    for i in range(4):
        s2.submit("hi", i)
    assert drain(s2)[-1] == ("lo", "old")  # ...while strict priorities starve it behind 'hi'


def test_unknown_model_and_bad_config():
    with pytest.raises(ConfigError, match="'nope' is not served; valid: 'a' or 'b'"):
        ModelScheduler({"a": 0, "b": 1}).submit("nope", 1)
    with pytest.raises(ConfigError, match="non-empty mapping"):
        ModelScheduler({})
    with pytest.raises(ConfigError, match="priority must be an int"):
        ModelScheduler({"a": 1.5})
    with pytest.raises(ConfigError, match="switch_throttle"):
        ModelScheduler({"a": 0}, switch_throttle=-1)
    with pytest.raises(ConfigError, match="aging_s"):
        ModelScheduler({"a": 0}, aging_s=0)


def test_throttle_rejects_beyond_limit_only_for_switching_model():
    s = ModelScheduler({"policy": 0, "ref": 0}, switch_throttle=3)
    s.begin_switch("policy")
    for i in range(3):
        s.submit("policy", i, timeout=0)
    with pytest.raises(BackpressureError, match=r"'policy' throttled.*3 requests queued \(switch_throttle=3\)"):
        s.submit("policy", 99, timeout=0)
    for i in range(10):  # other models are not throttled
        s.submit("ref", i, timeout=0)
    st = s.stats()["policy"]
    assert (st["throttled"], st["rejected"], st["queue_depth"]) == (1, 1, 3)
    s.end_switch("policy")
    s.submit("policy", 100, timeout=0)  # full intake again
    assert s.depth("policy") == 4


def test_throttled_submit_blocks_until_room_then_proceeds():
    s = ModelScheduler({"policy": 0}, switch_throttle=2)
    s.begin_switch("policy")
    s.submit("policy", 0)
    s.submit("policy", 1)
    result = {}

    def blocked():
        start = time.monotonic()
        result["fut"] = s.submit("policy", 2, timeout=5)
        result["waited"] = time.monotonic() - start

    th = threading.Thread(target=blocked)
    th.start()
    time.sleep(0.2)
    assert th.is_alive() and s.depth("policy") == 2  # still blocked, nothing admitted
    ticket = s.next_request(timeout=1)  # a worker takes one: room for the blocked submitter
    th.join(timeout=5)
    assert not th.is_alive()
    assert 0.15 < result["waited"] < 3
    assert ticket.request == 0 and s.depth("policy") == 2
    s.end_switch("policy")


def test_end_switch_releases_blocked_submitters():
    s = ModelScheduler({"policy": 0}, switch_throttle=0)
    s.begin_switch("policy")
    errors, done = [], []

    def submitter(i):
        try:
            done.append(s.submit("policy", i, timeout=5))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=submitter, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert s.depth("policy") == 0 and not done
    s.end_switch("policy")
    for t in threads:
        t.join(timeout=5)
    assert not errors and len(done) == 4 and s.depth("policy") == 4
    assert s.stats()["policy"]["throttled"] == 4


def test_pause_switch_drains_in_flight_then_resumes():
    """The full switch sequence: throttle + pause, wait for in-flight to finish, swap, end_switch."""
    s = ModelScheduler({"policy": 0, "ref": 1}, switch_throttle=8)
    f_running = s.submit("policy", "running")
    ticket = s.next_request(timeout=1)
    f_queued = s.submit("policy", "queued")
    s.submit("ref", "r")
    s.begin_switch("policy", pause=True)
    t2 = s.next_request(timeout=0.1)
    assert t2.model_id == "ref"  # paused model is skipped, others keep flowing
    t2.set_result("ok")
    assert s.next_request(timeout=0.1) is None
    with pytest.raises(StageTimeoutError, match="1 request\\(s\\) in flight"):
        s.wait_idle("policy", timeout=0.1)
    threading.Timer(0.1, ticket.set_result, args=("v1",)).start()
    s.wait_idle("policy", timeout=5)
    assert f_running.result(timeout=1) == "v1"
    s.end_switch("policy")
    t3 = s.next_request(timeout=1)
    assert t3.request == "queued"
    t3.set_result("v2")
    assert f_queued.result(timeout=1) == "v2"
    with pytest.raises(ConfigError, match="no switch pending"):
        s.end_switch("policy")


def test_concurrent_producers_and_workers_fifo_per_model_and_stats():
    models = {"a": 0, "b": 0, "c": 1}
    s = ModelScheduler(models, switch_throttle=4)
    n_per = 200
    served: dict[str, list[int]] = {m: [] for m in models}
    lock = threading.Lock()
    stop = threading.Event()

    def producer(m):
        for i in range(n_per):
            s.submit(m, i, timeout=10)

    def worker():
        while not stop.is_set():
            t = s.next_request(timeout=0.05)
            if t is None:
                continue
            with lock:
                served[t.model_id].append(t.request)
            t.set_result(t.request * 2)

    producers = [threading.Thread(target=producer, args=(m,)) for m in models]
    workers = [threading.Thread(target=worker) for _ in range(3)]
    for t in workers + producers:
        t.start()
    for t in producers:
        t.join(timeout=20)
    deadline = time.monotonic() + 20
    while sum(len(v) for v in served.values()) < 3 * n_per and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    for t in workers:
        t.join(timeout=5)
    for m in models:
        # three workers may interleave hand-outs, but every request is served exactly once
        assert sorted(served[m]) == list(range(n_per))
    st = s.stats()
    assert all(st[m]["completed"] == n_per and st[m]["queue_depth"] == 0 for m in models)
    metrics = s.metrics()
    assert metrics["mrl/rollout/sched/a/completed"] == n_per
    assert "mrl/rollout/sched/c/wait_p99_ms" in metrics


def test_single_worker_fifo_under_concurrent_producer():
    s = ModelScheduler({"a": 0})
    got = []

    def worker():
        while len(got) < 300:
            t = s.next_request(timeout=2)
            if t is None:
                return
            got.append(t.request)
            t.set_result(None)

    th = threading.Thread(target=worker)
    th.start()
    for i in range(300):
        s.submit("a", i)
    th.join(timeout=10)
    assert got == list(range(300))


def test_failures_cancellation_and_close():
    s = ModelScheduler({"a": 0})
    f1 = s.submit("a", 1)
    f2 = s.submit("a", 2)
    f3 = s.submit("a", 3)
    assert f2.cancel()  # cancelled while queued: skipped by workers
    t = s.next_request(timeout=1)
    t.set_exception(RuntimeError("engine failed"))
    with pytest.raises(RuntimeError, match="engine failed"):
        f1.result(timeout=1)
    t3 = s.next_request(timeout=1)
    assert t3.request == 3  # request 2 was skipped
    st = s.stats()["a"]
    assert st["failed"] == 1 and st["cancelled"] == 1
    f4 = s.submit("a", 4)
    assert s.close() == 1
    with pytest.raises(CancelledError):
        f4.result(timeout=1)
    assert s.next_request(timeout=0.5) is None
    with pytest.raises(SchedulerClosedError):
        s.submit("a", 5)
    assert not f3.done()  # handed out before close: its worker still owns it
    t3.set_result("late")
    assert f3.result(timeout=1) == "late"


def test_close_wakes_blocked_worker_and_submitter():
    s = ModelScheduler({"a": 0}, switch_throttle=0)
    s.begin_switch("a")
    out = {}

    def worker():
        out["ticket"] = s.next_request(timeout=None)

    def submitter():
        try:
            s.submit("a", 1, timeout=10)
        except SchedulerClosedError as exc:
            out["err"] = exc

    ths = [threading.Thread(target=worker), threading.Thread(target=submitter)]
    for t in ths:
        t.start()
    time.sleep(0.1)
    s.close()
    for t in ths:
        t.join(timeout=3)
    assert not any(t.is_alive() for t in ths)
    assert out["ticket"] is None and isinstance(out["err"], SchedulerClosedError)


def test_wait_hook_serves_the_queue_while_throttled_without_counting_rejections():
    """A single-threaded caller (the worker pool) dispatches from the hook; the lock is free while it runs."""
    s = ModelScheduler({"m": 0}, switch_throttle=1)
    s.submit("m", "queued")
    s.begin_switch("m")
    calls = []

    def hook():
        calls.append(1)
        if len(calls) == 3:
            ticket = s.next_request(timeout=0)  # would deadlock if the hook ran with the lock held
            assert ticket.request == "queued"
            s.end_switch("m")

    fut = s.submit("m", "next", timeout=5, wait_hook=hook)
    assert len(calls) == 3 and not fut.done()
    st = s.stats()["m"]
    assert (st["throttled"], st["rejected"], st["queue_depth"]) == (1, 0, 1)
    s.begin_switch("m")
    with pytest.raises(BackpressureError, match="switch_throttle=1"):
        s.submit("m", "late", timeout=0.05, wait_hook=lambda: time.sleep(0.01))
    assert s.stats()["m"]["rejected"] == 1
    s.close()
