"""Shared-memory ring liveness: a consumer that has not beaten yet is starting, not dead; a dead one is still
found; a handle never attaches to a ring other than its own. Real processes, real /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import struct
import time

import pytest
import torch

from mrl_plugins.comm import CommConfig, PeerDeadError
from mrl_plugins.comm.base import Heartbeat
from mrl_plugins.comm.shm_ring import shm_factory
from mrl_plugins.shmem import remove_stale, shm_dir, unlink

RUN = f"tlive{os.getpid()}"
CTX = mp.get_context("spawn")
HB_OFF = 32  # consumer heartbeat in the ring header (see mrl_plugins.comm.shm_ring)


def _cfg(**kw) -> CommConfig:
    base = {"ring_slots": 2, "slot_bytes": 64 << 10, "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.0}
    return CommConfig.from_dict(base | kw)


def _mine() -> list[str]:
    return sorted(n for n in os.listdir(shm_dir()) if n.startswith(f"mrl-comm-{RUN}-"))


@pytest.fixture(autouse=True)
def no_segments_left():
    yield
    remove_stale()  # segments of the consumer killed on purpose
    assert _mine() == []


def _batch(seq: int) -> dict[str, torch.Tensor]:
    return {"ids": torch.arange(64) + seq}


def _send_child(handle, n: int, results) -> None:
    """Attach and send ``n`` frames (the ring holds fewer: sends wait for space); report how it ended."""
    torch.set_num_threads(1)
    try:
        prod = handle.attach()
        try:
            for seq in range(n):
                prod.send(_batch(seq), {"model_id": "policy", "version": 1, "seq": seq}, timeout=60)
                results.put(("sent", seq))
        finally:
            prod.close()
        results.put(("ok", ""))
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        results.put((type(exc).__name__, str(exc)))


def _consumer_child(cfg: dict, out) -> None:
    """A consumer in its own process: hands its producer handle out, then waits to be killed."""
    cons = shm_factory(CommConfig.from_dict(cfg), n_producers=1, run_id=RUN)
    out.put(cons.producer_handle(0))
    time.sleep(120)


def _unbeaten(cons) -> None:
    """The consumer as a producer may find it right after creation: alive, no heartbeat stamped yet (0)."""
    cons._hb.stop()
    struct.pack_into("<d", cons.seg.buf, HB_OFF, 0.0)


def _wait_for(results, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            item = results.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"no {what!r} from the producer within {timeout} s") from None
        if item[0] == what or item[0] not in ("sent",):
            return item


def test_producer_attaching_before_the_consumer_beats_waits_instead_of_calling_it_dead():
    cfg = _cfg(start_timeout_s=60.0)
    cons = shm_factory(cfg, n_producers=1, run_id=RUN)
    _unbeaten(cons)
    results = CTX.Queue()
    n = cfg.ring_slots + 2
    p = CTX.Process(target=_send_child, args=(cons.producer_handle(0), n, results))
    p.start()
    try:
        # the ring fills; the producer then checks the consumer while it waits for space, again and again
        for seq in range(cfg.ring_slots):
            assert _wait_for(results, "sent") == ("sent", seq)
        # longer than a stale heartbeat may be: read as "age = now - 0", the old check failed at once
        time.sleep(3 * cfg.heartbeat_timeout_s)
        assert p.is_alive() and results.empty(), results.get_nowait()
        cons._hb = Heartbeat(cons._beat, cfg.heartbeat_interval_s, "test-consumer-hb")  # the consumer starts
        got = []
        for _ in range(n):
            with cons.receive(timeout=30) as r:
                got.append(r.meta["seq"])
        assert got == list(range(n))
        assert _wait_for(results, "ok") == ("ok", "")
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        cons.close()
    assert p.exitcode == 0


def test_consumer_that_never_beats_is_reported_after_the_start_timeout():
    cfg = _cfg(start_timeout_s=1.5)
    cons = shm_factory(cfg, n_producers=1, run_id=RUN)
    _unbeaten(cons)
    results = CTX.Queue()
    p = CTX.Process(target=_send_child, args=(cons.producer_handle(0), cfg.ring_slots + 1, results))
    p.start()
    try:
        kind, msg = _wait_for(results, "PeerDeadError")
        assert kind == "PeerDeadError", msg
        assert f"consumer pid {os.getpid()} is dead: no heartbeat yet" in msg and "starting for 1.5 s" in msg
    finally:
        p.join(timeout=30)
        cons.close()


def test_consumer_whose_heartbeat_stops_is_still_reported_dead():
    cfg = _cfg()
    cons = shm_factory(cfg, n_producers=1, run_id=RUN)
    prod = cons.producer_handle(0).attach()
    try:
        for seq in range(cfg.ring_slots):
            prod.send(_batch(seq), {"seq": seq}, timeout=5)
        cons._hb.stop()  # hung: the process lives, the heartbeat gets old
        stale = r"consumer pid \d+ is dead: last heartbeat [\d.]+ s ago \(heartbeat timeout 1 s: min\(timeout_s"
        with pytest.raises(PeerDeadError, match=stale):
            prod.send(_batch(9), {"seq": 9}, timeout=30)
    finally:
        prod.close()
        cons.close()


def test_killed_consumer_is_reported_dead():
    cfg = _cfg()
    handles = CTX.Queue()
    c = CTX.Process(target=_consumer_child, args=(cfg.to_dict(), handles))
    c.start()
    prod = None
    try:
        handle = handles.get(timeout=60)
        prod = handle.attach()
        for seq in range(cfg.ring_slots):
            prod.send(_batch(seq), {"seq": seq}, timeout=5)
        os.kill(c.pid, signal.SIGKILL)
        c.join(timeout=10)
        with pytest.raises(PeerDeadError, match=rf"consumer pid {c.pid} is dead: last heartbeat .* process is gone"):
            prod.send(_batch(9), {"seq": 9}, timeout=30)
    finally:
        if prod is not None:
            prod.close()
        if c.is_alive():
            c.kill()
            c.join(timeout=5)


def test_handle_refuses_a_ring_that_replaced_its_own():
    cfg = _cfg()
    first = shm_factory(cfg, n_producers=1, run_id=RUN)
    handle = first.producer_handle(0)
    first.close()
    second = shm_factory(cfg, n_producers=1, run_id=RUN)
    paths = [(second.path, handle.path)] + [
        (f"{second.path}{suffix}", f"{handle.path}{suffix}") for suffix in (".d", ".s0")
    ]
    try:
        for src, dst in paths:  # another live ring now sits at the old ring's path (FIFOs included)
            os.rename(src, dst)
        with pytest.raises(PeerDeadError, match="not the ring this handle was made for"):
            handle.attach()
        fresh = second.producer_handle(0)
        fresh.path = handle.path
        fresh.attach().close()  # the right token at that path attaches
    finally:
        for _, dst in paths:
            unlink(dst)
        second.close()
