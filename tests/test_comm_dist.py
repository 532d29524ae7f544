"""torch_distributed transport across real gloo processes, and the comm plugin through the real manager."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from mrl_plugins.comm import ChannelClosedError, CommConfig, PeerDeadError
from mrl_plugins.comm.codec import Codec
from mrl_plugins.comm.dist_transport import dist_factory
from mrl_plugins.comm.frame import decode_frame, encode_frame
from mrl_plugins.comm.plugin import CommPlugin
from mrl_plugins.comm.shm_ring import shm_factory
from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs.types import StageContext
from mrl_plugins.shmem import shm_dir

RUN = f"tcommd{os.getpid()}"
CTX = mp.get_context("spawn")


def _cfg(**kw) -> CommConfig:
    base = {"ring_slots": 2, "heartbeat_interval_s": 0.1, "heartbeat_timeout_s": 1.5, "receive_timeout_s": 60.0}
    base.update(kw)
    return CommConfig.from_dict(base)


@pytest.fixture(scope="module", autouse=True)
def no_segments_left():
    yield
    assert sorted(n for n in os.listdir(shm_dir()) if n.startswith(f"mrl-comm-{RUN}-")) == []


def _batch(seq: int) -> dict[str, torch.Tensor]:
    return {
        "completion_ids": torch.arange(32 * 256).reshape(32, 256) * 1000 + seq,
        "mask": torch.ones(32, 256, dtype=torch.bool),
        "logps": -torch.linspace(0, 8, 32 * 256).reshape(32, 256) - seq,
        "big": torch.tensor([1e6, -2.0]),
    }


def _dist_child(handle, n: int, hang: bool) -> None:
    torch.set_num_threads(1)
    prod = handle.attach(timeout=60)
    for seq in range(n):
        prod.send(_batch(seq), {"model_id": "policy", "version": 4, "seq": seq}, timeout=30)
    if hang:
        prod.flush(timeout=30)
        time.sleep(120)
    prod.close()


def _consumer_child(q) -> None:
    torch.set_num_threads(1)
    cons = dist_factory(_cfg(), n_producers=1, run_id=RUN)
    q.put(cons.producer_handle(0))
    time.sleep(120)  # until killed


def _join(p, timeout: float = 30.0) -> None:
    p.join(timeout=timeout)
    if p.is_alive():
        p.kill()
        p.join(timeout=5)


@pytest.mark.slow
def test_torch_distributed_round_trip_order_codec_and_close():
    cons = dist_factory(_cfg(codec="fp16"), n_producers=1, run_id=RUN)
    p = CTX.Process(target=_dist_child, args=(cons.producer_handle(0), 6, False))
    try:
        p.start()
        for seq in range(6):
            r = cons.receive(timeout=60)
            assert r.producer == 0 and r.meta["seq"] == seq and r.meta["version"] == 4
            want = _batch(seq)
            assert torch.equal(r.batch["completion_ids"], want["completion_ids"])
            assert r.batch["completion_ids"].dtype == torch.int64 and r.batch["mask"].dtype == torch.bool
            assert (r.batch["logps"] - want["logps"]).abs().max() <= 2**-7
            assert torch.equal(r.batch["big"], want["big"])  # 1e6 does not fit fp16: sent as fp32
            time.sleep(0.02)
        _join(p)
        assert p.exitcode == 0
        with pytest.raises(ChannelClosedError):
            cons.receive(timeout=10)
        st = cons.stats()
        assert st["frames"] == 6 and st["bytes"] < st["raw_bytes"] and st["link_errors"] == 0  # closed, not broken
        assert st["fallbacks"] == 6  # 'big' of every frame, counted by the consumer from the frames
    finally:
        _join(p, timeout=5)
        cons.close()


@pytest.mark.slow
def test_torch_distributed_dead_producer_detected():
    cfg = _cfg()
    cons = dist_factory(cfg, n_producers=1, run_id=RUN)
    p = CTX.Process(target=_dist_child, args=(cons.producer_handle(0), 1, True))
    try:
        p.start()
        cons.receive(timeout=60)
        with pytest.raises(StageTimeoutError, match="no frame within 0.3 s"):
            cons.receive(timeout=0.3)
        os.kill(p.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(PeerDeadError) as err:
            cons.receive(timeout=30)
        assert time.monotonic() - t0 < cfg.heartbeat_timeout_s + 1.0
        # the receiver's broken link is counted and named, not swallowed
        assert cons.stats()["link_errors"] == 1 and "its link failed" in str(err.value)
    finally:
        _join(p, timeout=5)
        cons.close()


def test_plugin_hooks_through_the_manager(fresh_pm):
    """The comm stage opens both ends through its stage methods from the registrations: a shm consumer and producer
    carrying the transport's capabilities and the configured codec (fp16: the overflow fallback is counted)."""
    from mrl_plugins.hookspecs import ExperienceConsumer, ExperienceProducer

    mgr = fresh_pm({"comm": {"transport": "shm", "codec": "fp16", "slot_bytes": 1 << 20}})
    assert {"shm", "queue", "torch_distributed"} <= set(mgr.registry("mrl_comm_register_transports"))
    assert {"raw", "fp16", "bf16"} <= set(mgr.registry("mrl_comm_register_codecs"))
    ctx = StageContext(config=mgr.config)
    cons = mgr.comm_open_consumer(ctx=ctx, run_id=RUN, producers=1)
    prod = mgr.comm_open_producer(ctx=ctx, handle=cons.producer_handle(0), index=0)
    path = cons.path
    try:
        assert isinstance(cons, ExperienceConsumer) and isinstance(prod, ExperienceProducer)
        assert cons.capabilities.zero_copy and cons.capabilities.rejoinable and not cons.capabilities.cross_host
        assert mgr.capabilities("comm") == cons.capabilities == prod.capabilities
        assert prod.codec.name == "fp16"
        assert prod.send(_batch(2), {"seq": 2}, timeout=5) > 0
        got = cons.receive(5)
        assert got.meta["seq"] == 2 and torch.equal(got.batch["mask"], _batch(2)["mask"])
        got.release()
        assert cons.stats()["frames"] == 1  # 'big' does not fit fp16: seen by the consumer in the frame it received
        assert cons.stats()["fallbacks"] == 1
    finally:
        prod.close()
        cons.close()
    assert not os.path.exists(path)


def test_codec_registration_builds_field_codecs():
    regs = {r.name: r for r in CommPlugin().mrl_comm_register_codecs()}
    codec = regs["bf16"].factory(_cfg(lossless_fields=["logps"]))
    assert isinstance(codec, Codec) and codec.name == "bf16"
    _, out = decode_frame(bytes(encode_frame(_batch(0), {}, codec)))
    assert torch.equal(out["logps"], _batch(0)["logps"])  # kept lossless by name
    shm = shm_factory(_cfg(), n_producers=1, run_id=RUN)
    shm.close()


def _dist_rejoin_child(handle, first: int, n: int, hang: bool) -> None:
    torch.set_num_threads(1)
    prod = handle.attach(timeout=60)
    for seq in range(first, first + n):
        prod.send(_batch(seq), {"model_id": "policy", "version": prod.incarnation, "seq": seq}, timeout=30)
    prod.flush(timeout=30)
    if hang:
        time.sleep(120)
    prod.close()


@pytest.mark.slow
def test_torch_distributed_restarted_producer_rejoins_under_its_index():
    """A producer process SIGKILLed mid-stream is reported dead once; a new process attaching with the same handle
    (a restarted worker, as Ray restarts an actor) forms a group of its own and its frames arrive, in order."""
    cfg = _cfg()
    cons = dist_factory(cfg, n_producers=1, run_id=RUN)
    handle = cons.producer_handle(0)
    first = CTX.Process(target=_dist_rejoin_child, args=(handle, 0, 2, True))
    second = CTX.Process(target=_dist_rejoin_child, args=(handle, 10, 3, False))
    try:
        first.start()
        got = [cons.receive(timeout=60) for _ in range(2)]
        assert [(r.meta["seq"], r.meta["version"]) for r in got] == [(0, 1), (1, 1)]  # incarnation 1
        os.kill(first.pid, signal.SIGKILL)
        with pytest.raises(PeerDeadError, match="producer 0 is dead"):
            cons.receive(timeout=30)
        with pytest.raises(ChannelClosedError):  # its only producer is dead: closed, until a new one joins
            cons.receive(timeout=1)
        second.start()
        deadline = time.monotonic() + 60
        while True:  # the new process attaches after its imports
            try:
                got = [cons.receive(timeout=60)]
                break
            except ChannelClosedError:
                assert time.monotonic() < deadline, "the restarted producer never joined"
                time.sleep(0.05)
        got += [cons.receive(timeout=60) for _ in range(2)]
        assert [(r.producer, r.meta["seq"], r.meta["version"]) for r in got] == [(0, 10, 2), (0, 11, 2), (0, 12, 2)]
        assert torch.equal(got[-1].batch["completion_ids"], _batch(12)["completion_ids"])
        _join(second)
        assert second.exitcode == 0
        with pytest.raises(ChannelClosedError):  # the latest incarnation closed after its 3 frames arrived
            cons.receive(timeout=10)
        st = cons.stats()
        assert st["frames"] == 5 and st["dead_peers"] == 1 and st["rejoins"] == 1
    finally:
        _join(first, timeout=5)
        _join(second, timeout=5)
        cons.close()


def test_torch_distributed_close_is_bounded_when_the_consumer_stopped_receiving():
    """A consumer that never receives: the producer's sender thread blocks in gloo and its outbox fills; close()
    still returns (its flush times out) and marks the producer closed."""
    import threading

    cons = dist_factory(_cfg(ring_slots=1), n_producers=1, run_id=RUN)
    try:
        prod = cons.producer_handle(0).attach(timeout=30)
        big = {"x": torch.zeros(4 << 20, dtype=torch.uint8)}
        for seq in range(64):  # until the inbox, the socket buffers and the outbox are full
            try:
                prod.send(big, {"seq": seq}, timeout=0.5)
            except StageTimeoutError:
                break
        else:
            pytest.fail("the producer's outbox never filled")
        errors: list = []
        th = threading.Thread(target=lambda: errors.append(pytest.raises(StageTimeoutError, prod.close, 0.5)))
        th.daemon = True
        th.start()
        th.join(15)
        assert not th.is_alive(), "close() blocked on the full outbox"
        assert errors and "flush timed out" in str(errors[0].value)
        assert cons._master.check(["closed/0/1"])  # marked closed for the consumer
    finally:
        cons.close()


@pytest.mark.slow
def test_torch_distributed_producer_outlives_its_consumer_quietly(monkeypatch):
    """The consumer's process dies, and its store with it: the producer's heartbeat (a store write) stops without
    an unhandled exception in its thread, the sends report the dead peer (PeerDeadError) and close() returns."""
    import threading

    errors: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    q = CTX.Queue()
    child = CTX.Process(target=_consumer_child, args=(q,), daemon=True)
    child.start()
    try:
        prod = q.get(timeout=60).attach(timeout=30)
        os.kill(child.pid, signal.SIGKILL)
        child.join(10)
        deadline = time.monotonic() + 10
        while prod._hb._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not prod._hb._thread.is_alive() and errors == []  # stopped, quietly
        with pytest.raises(PeerDeadError, match="sending failed"):
            for seq in range(200):
                prod.send(_batch(seq), {"seq": seq}, timeout=5)
                time.sleep(0.05)
        prod.close()
        assert errors == []
    finally:
        _join(child, timeout=5)
        q.close()
