"""Double-buffered receiver, poller, sources and plugin hooks, on real shm/directory transports."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs import StageContext, hookimpl
from mrl_plugins.metrics import StageMetrics
from mrl_plugins.weight_sync import (
    DirectorySender,
    DoubleBufferedReceiver,
    PollInterval,
    ShmSender,
    WeightSyncConfig,
    WeightSyncError,
    iter_trainer_weights,
)
from mrl_plugins.weight_sync.plugin import WeightSyncPlugin
from mrl_plugins.weight_sync.shm import TABLE_OFF
from mrl_plugins.weight_sync.sources import peft_base_name


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))


def filled(model: torch.nn.Module, v: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.full_like(p, v)) for n, p in model.named_parameters()]


def param_bytes(model: torch.nn.Module) -> int:
    return sum(p.nbytes for p in model.parameters())


@pytest.fixture
def shm():
    made = []

    def make(model_id="policy", **kw):
        s = ShmSender(WeightSyncConfig(**{"timeout_s": 5, "chunk_bytes": 512, **kw}), model_id=model_id, run_id="rx")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def values(model: torch.nn.Module) -> set[float]:
    out = set()
    for p in model.parameters():
        out.update(p.detach().unique().tolist())
    return out


@pytest.mark.parametrize("staging", ["device", "host"])
def test_stage_then_switch_and_version_log(shm, staging, caplog):
    model = make_model()
    s = shm()
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach(), staging=staging)
    assert recv.poll(1) is None and recv.switch() is None and recv.version == -1
    s.publish(1, filled(model, 1.0))
    assert recv.poll(2) == 1
    assert values(model) != {1.0}  # staged only: active untouched
    caplog.set_level(logging.INFO, logger="mrl_plugins.weight_sync")
    rep = recv.switch()
    assert values(model) == {1.0} and recv.version == 1 and rep.from_version == -1 and rep.to_version == 1
    assert rep.nbytes == param_bytes(model)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("switch ")]
    assert len(line) == 1 and line[0].startswith("switch model_id=policy -1 -> 1 bytes=") and "seconds=" in line[0]
    assert recv.poll(1) is None  # unchanged version: nothing fetched
    out = model(torch.ones(2, 16))
    assert out.shape == (2, 8)
    st = recv.stats()  # the gauges of metrics.record_switch (bytes and the switch count: the reports above)
    assert set(st) == {"ignored_versions", "switch_ms", "fetch_gbps"}
    assert st["ignored_versions"] == 0 and st["switch_ms"] >= 0 and st["fetch_gbps"] > 0


@pytest.mark.parametrize("staging", ["device", "host"])
def test_no_forward_pass_sees_two_versions(shm, staging):
    """A reader thread hammers the model inside ``active()`` while versions switch under it."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    s = shm(chunk_bytes=4096)
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach(), staging=staging)
    stop, seen, mixed, reads = threading.Event(), set(), [], [0]

    def hammer() -> None:
        while not stop.is_set():
            with recv.active() as m:
                vals = set()
                for p in m.parameters():  # one parameter at a time, yielding the GIL in between
                    vals.update(p.detach().unique().tolist())
                    time.sleep(0)
                m(torch.ones(1, 64))
            if len(vals) > 1 and reads[0] > 0:
                mixed.append(vals)
            seen.update(vals)
            reads[0] += 1

    s.publish(1, filled(model, 1.0))
    recv.poll(2)
    recv.switch(5)
    t = threading.Thread(target=hammer, daemon=True)
    t.start()
    try:
        for v in range(2, 40):
            s.publish(v, filled(model, float(v)))
            assert recv.poll(5) == v
            assert recv.switch(5).to_version == v
            time.sleep(0.001)
    finally:
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert reads[0] > 20 and not mixed, mixed[:3]
    assert len(seen) > 5  # the reader really ran across many versions


def test_corruption_means_no_switch(shm):
    model = make_model()
    s = shm(max_retries=0)
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach())
    s.publish(1, filled(model, 1.0))
    recv.poll(2)
    recv.switch()
    s.publish(2, filled(model, 2.0))
    seg = recv.tr.slots[s._latest_slot]
    off, _n = seg.read("<QQ", TABLE_OFF)  # first shard
    hlen = int.from_bytes(seg.mm[off : off + 8], "little")
    seg.mm[off + 8 + hlen + 3] ^= 0x10
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        recv.poll(2)
    assert recv.switch() is None  # nothing staged
    assert recv.version == 1 and values(model) == {1.0}
    s.publish(3, filled(model, 3.0))  # the next good version goes through
    assert recv.poll(2) == 3 and recv.switch().to_version == 3 and values(model) == {3.0}


def test_missing_parameter_means_no_switch(shm):
    model = make_model()
    s = shm()
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach())
    s.publish(1, filled(model, 1.0)[:-1])
    with pytest.raises(WeightSyncError, match="not received"):
        recv.poll(2)
    assert recv.switch() is None and recv.version == -1


def test_older_and_repeated_versions_are_ignored(tmp_path, caplog):
    """A stale trainer (second sender) announces an older version: ignored and logged."""
    model = make_model()
    cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), timeout_s=5)
    new, stale = DirectorySender(cfg, model_id="policy"), DirectorySender(cfg, model_id="policy")
    recv = DoubleBufferedReceiver(model, new.receiver_handle().attach())
    new.publish(5, filled(model, 5.0))
    assert recv.poll(2) == 5 and recv.switch().to_version == 5
    caplog.set_level(logging.INFO, logger="mrl_plugins.weight_sync")
    stale.publish(3, filled(model, 3.0))
    assert recv.poll(2) is None and recv.stage(4) is None and recv.stage(5) is None
    assert recv.poll(2) is None and recv.stage(5) is None  # each ignored version is logged once
    assert recv.version == 5 and values(model) == {5.0}
    assert recv.stats()["ignored_versions"] == 3
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("ignored")]
    assert lines == [
        "ignored model_id=policy version 3 (older than active 5)",
        "ignored model_id=policy version 4 (older than active 5)",
        "ignored model_id=policy version 5 (repeats active 5)",
    ]


def test_name_map_and_tied_weights(shm):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)
            self.head = torch.nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    model = Tied()
    s = shm()
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach(), name_map=lambda n: n.removeprefix("trainer."))
    s.publish(1, [("trainer.emb.weight", torch.full((10, 4), 7.0))])
    assert recv.poll(2) == 1 and recv.switch()
    assert torch.all(model.head.weight == 7) and model.head.weight is model.emb.weight


def test_switch_waits_for_in_flight_requests(shm):
    model = make_model()
    s = shm()
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach())
    s.publish(1, filled(model, 1.0))
    recv.poll(2)
    with recv.active():
        with pytest.raises(StageTimeoutError, match="still in flight"):
            recv.switch(timeout=0.2)
        assert recv.version == -1
    assert recv.switch(1).to_version == 1  # still staged


def test_several_models_coexist(shm):
    pol, ref = make_model(), make_model()
    sp, sr = shm("policy"), shm("reference")
    rp = DoubleBufferedReceiver(pol, sp.receiver_handle().attach(), model_id="policy")
    rr = DoubleBufferedReceiver(ref, sr.receiver_handle().attach(), model_id="reference")
    sp.publish(4, filled(pol, 4.0))
    sr.publish(1, filled(ref, -1.0))
    for r in (rp, rr):
        r.poll(2)
        r.switch()
    assert (rp.version, rr.version) == (4, 1) and values(pol) == {4.0} and values(ref) == {-1.0}


def test_sources_plain_ddp_like_and_peft_names():
    model = make_model()
    names = [n for n, _ in iter_trainer_weights(model)]
    assert names == [n for n, _ in model.named_parameters()]

    class Wrapper(torch.nn.Module):  # DDP-like wrapper
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.module = m

    got = dict(iter_trainer_weights(Wrapper(model)))
    assert set(got) == set(names)
    assert torch.equal(got["0.weight"], model[0].weight)
    assert peft_base_name("base_model.model.layers.0.q_proj.base_layer.weight") == "layers.0.q_proj.weight"
    assert peft_base_name("base_model.model.layers.0.q_proj.lora_A.default.weight") is None
    assert peft_base_name("base_model.model.score.original_module.weight") is None
    assert peft_base_name("base_model.model.score.modules_to_save.default.weight") == "score.weight"


def test_sources_peft_merge_and_unmerge():
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    pm = peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["0", "2"], init_lora_weights=False))
    before = {n: p.detach().clone() for n, p in pm.named_parameters()}
    got = {n: t.clone() for n, t in iter_trainer_weights(pm)}
    assert set(got) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    pm.merge_adapter()
    merged = pm.base_model.model[0].base_layer.weight.detach().clone()
    pm.unmerge_adapter()
    assert torch.allclose(got["0.weight"], merged) and not torch.allclose(got["0.weight"], before[
        "base_model.model.0.base_layer.weight"])  # fmt: skip
    after = {n: p.detach() for n, p in pm.named_parameters()}
    assert all(torch.allclose(after[n], before[n], atol=1e-6) for n in before)  # unmerged again


def test_plugin_opens_both_ends_and_the_caller_counts_their_reports(fresh_pm):
    """``open_sender``/``open_receiver`` of the built-in stage build a shm sender and a
    double-buffered receiver carrying the transport's capabilities; the weight metrics come from the reports."""
    from mrl_plugins.hookspecs import WeightReceiver, WeightSender
    from mrl_plugins.metrics import record_publish, record_switch

    mgr = fresh_pm({"weight_sync": {"transport": "shm", "timeout_s": 5, "chunk_bytes": 512}})
    regs = mgr.registry("mrl_weight_sync_register_transports")
    assert {"shm", "directory", "broadcast", "per_param"} <= set(regs)
    assert regs["broadcast"].capabilities.collective and not regs["broadcast"].capabilities.rejoinable
    assert regs["directory"].capabilities.cross_host and regs["directory"].capabilities.rejoinable
    model = make_model()
    ctx = StageContext(config=mgr.config)
    s = mgr.weight_sync_open_sender(ctx=ctx, model_id="policy", run_id="rx", receivers=1, same_process=True)
    recv = mgr.weight_sync_open_receiver(ctx=ctx, model=model, handle=s.receiver_handle(), model_id="policy")
    assert isinstance(s, WeightSender) and isinstance(recv, WeightReceiver) and isinstance(s, ShmSender)
    assert s.capabilities == recv.capabilities == mgr.capabilities("weight_sync") == regs["shm"].capabilities
    metrics = StageMetrics()
    try:
        for v in (2, 3, 4):  # three switches inside one log window
            rep = s.publish(v, filled(model, v))
            record_publish(metrics, rep)
            assert rep.version == v and rep.nbytes == param_bytes(model)
            assert recv.poll(2.0) == v
            sw = recv.switch(5)
            record_switch(metrics, sw, recv.stats())
            assert sw.to_version == v and values(model) == {float(v)}
        logged = metrics.flush()
        # counters: what happened in the window (not running totals added up again); gauges: the last value
        assert logged["mrl/weights/switches"] == 3 and logged["mrl/weights/received_bytes"] == 3 * param_bytes(model)
        assert logged["mrl/weights/active_version"] == 4 and logged["mrl/weights/ignored_versions"] == 0
        assert 0 < logged["mrl/weights/receive_seconds"] < 30 and logged["mrl/weights/publish_seconds"] > 0
        s.publish(5, filled(model, 5.0))
        recv.poll(2.0)
        record_switch(metrics, recv.switch(5), recv.stats())
        assert metrics.flush()["mrl/weights/switches"] == 1  # the next window starts from zero
    finally:
        recv.close()
        s.close()
    assert s._closed


def test_hookimpl_marker_is_the_projects():
    assert getattr(WeightSyncPlugin.mrl_weight_sync_register_stages, "mrl_plugins_impl", None) is not None
    assert hookimpl is not None


def test_poll_takes_a_version_only_once_its_publish_completed(shm):
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    s = shm(chunk_bytes=2048)
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach())
    started = threading.Event()

    def slow():
        for item in filled(model, 9.0):
            started.set()
            time.sleep(0.02)
            yield item

    th = threading.Thread(target=s.publish, args=(1, slow()))
    th.start()
    try:
        assert started.wait(5)
        assert recv.poll(5) is None  # being written: not seen yet
    finally:
        th.join(10)
    assert recv.poll(5) == 1
    assert recv.switch().to_version == 1 and values(model) == {9.0}


def test_a_version_staged_by_another_thread_meanwhile_is_not_fetched_twice(shm):
    """A poller thread and the serving thread both see version 1: the one that waited for the fetch lock must
    not fetch it again (with a collective transport the second fetch would wait for a publish that never comes)."""
    model = make_model()
    s = shm()
    rx = s.receiver_handle().attach()
    fetches: list[int] = []
    real = rx.fetch_into

    def slow_fetch(version, dest, timeout=None):
        fetches.append(version)
        time.sleep(0.3)
        return real(version, dest, timeout)

    rx.fetch_into = slow_fetch
    recv = DoubleBufferedReceiver(model, rx)
    s.publish(1, filled(model, 1.0))
    got: list = []
    threads = [threading.Thread(target=lambda: got.append(recv.poll(5))) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the second poll starts while the first one fetches
    for t in threads:
        t.join(10)
    assert fetches == [1] and sorted(got, key=str) == [1, None]
    assert recv.switch(5).to_version == 1 and values(model) == {1.0}


def test_poll_interval_follows_the_measured_update_interval():
    assert PollInterval(2.0).seconds == 2.0  # fixed
    clock = PollInterval()
    assert clock.seconds == 0.5  # until two versions were seen
    now = time.monotonic()
    for i in range(20):  # the last one now
        clock.arrived(now - 0.019 + i * 0.001)
    assert clock.seconds == 0.01  # 3/8 of 1 ms, clamped
    for i in range(9):  # only the last 8 gaps count
        clock.arrived(now - 64.0 + i * 8.0)
    assert clock.seconds == pytest.approx(3.0, abs=0.01)
    for i in range(9):  # no version for 20 s since gaps of 8 s (the run takes turns): 3/8 of the open gap
        clock.arrived(now - 84.0 + i * 8.0)
    assert clock.seconds == pytest.approx(7.5, abs=0.01)
    for i in range(9):
        clock.arrived(now - 8000.0 + i * 1000.0)
    assert clock.seconds == 60.0


def test_slow_directory_reader_never_mixes_versions_and_skips_removed_ones(tmp_path, caplog):
    """A writer publishing as fast as it can (keeping only the newest version on disk) against a reader
    polling: every staged version is whole and uniform; a version removed while it was read is given up
    for the newer one (never an error, never a switch to a mix)."""
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)])
    cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), timeout_s=10, chunk_bytes=4096,
                           keep_versions=1, max_retries=0)  # fmt: skip
    sender = DirectorySender(cfg, model_id="policy", run_id="race")
    sender.publish(0, filled(model, 0.0))
    rx = sender.receiver_handle().attach()
    real = rx.fetch_into

    def slow_fetch(version, dest, timeout=None):  # a slow shared filesystem: the writer gets ahead
        time.sleep(0.02)
        return real(version, dest, timeout)

    rx.fetch_into = slow_fetch
    recv = DoubleBufferedReceiver(model, rx)
    caplog.set_level(logging.INFO, logger="mrl_plugins.weight_sync")
    stop = threading.Event()

    def write() -> None:
        for v in range(1, 200):
            if stop.is_set():
                return
            sender.publish(v, filled(model, float(v)))
            time.sleep((v % 3) * 0.02)  # uneven pace: some versions are lost to the reader, some are read

    writer = threading.Thread(target=write)
    writer.start()
    seen: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while writer.is_alive() and time.monotonic() < deadline:
            v = recv.poll(10)
            if v is not None:
                recv.switch(5)
                assert values(model) == {float(v)}, f"version {v} mixed"
                seen.append(v)
    finally:
        stop.set()
        writer.join(30)
    assert len(seen) >= 3 and seen == sorted(seen)
    assert "was replaced by" in caplog.text  # the reader did lose versions to the writer and went on
    if recv.poll(10) is not None:
        recv.switch(5)
    assert recv.version == 199 and values(model) == {199.0}


def test_a_reader_that_always_loses_to_the_writer_gives_up_with_a_clear_error(tmp_path):
    """poll() moves on to newer versions at most GONE_RETRIES times in a row, then raises (no livelock)."""
    from mrl_plugins.weight_sync import VersionGoneError
    from mrl_plugins.weight_sync.receiver import GONE_RETRIES

    model = make_model()
    cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), timeout_s=10, keep_versions=1,
                           max_retries=0)  # fmt: skip
    sender = DirectorySender(cfg, model_id="policy", run_id="lose")
    sender.publish(0, filled(model, 0.0))
    rx = sender.receiver_handle().attach()
    real, fetches = rx.fetch_into, []

    def too_slow(version, dest, timeout=None):
        fetches.append(version)
        v = sender._latest + 1  # the writer always gets there first
        sender.publish(v, filled(model, float(v)))
        return real(version, dest, timeout)

    rx.fetch_into = too_slow
    recv = DoubleBufferedReceiver(model, rx)
    with pytest.raises(VersionGoneError, match="manifest is at"):
        recv.poll(None)
    assert len(fetches) == GONE_RETRIES + 1 and recv.version == -1 and recv.switch(1) is None  # nothing staged
    rx.fetch_into = real
    assert recv.poll(5) == sender._latest and recv.switch(5)  # a reader that keeps up takes the newest


def test_poll_with_no_time_left_does_not_misbehave(shm):
    model = make_model()
    s = shm()
    recv = DoubleBufferedReceiver(model, s.receiver_handle().attach())
    s.publish(1, filled(model, 1.0))
    assert recv.poll(0) == 1 and recv.switch(5).to_version == 1


def test_sources_strip_checkpoint_wrappers_on_the_zero3_path_too(monkeypatch):
    """Activation-checkpointing wrappers add ``_checkpoint_wrapped_module.`` to the trainer's names: stripped on the
    plain and the ZeRO-3 path alike (the served model has no such part; unstripped, it is a "no destination" error).
    ZeRO-3 here: parameters carrying ``ds_id`` and a stand-in for ``deepspeed.zero.GatheredParameters``."""
    import contextlib
    import sys
    import types

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    served = make_model()
    want = [n for n, _ in served.named_parameters()]
    torch.manual_seed(0)
    trained = torch.nn.Sequential(
        checkpoint_wrapper(torch.nn.Linear(16, 32)), torch.nn.ReLU(), torch.nn.Linear(32, 8), torch.nn.LayerNorm(8)
    )
    assert "0._checkpoint_wrapped_module.weight" in dict(trained.named_parameters())
    assert [n for n, _ in iter_trainer_weights(trained)] == want
    gathered: list[list[torch.Tensor]] = []
    ds = types.ModuleType("deepspeed")
    ds.zero = types.SimpleNamespace(
        GatheredParameters=lambda ps, modifier_rank: (gathered.append(ps), contextlib.nullcontext())[1]
    )
    monkeypatch.setitem(sys.modules, "deepspeed", ds)
    for i, p in enumerate(trained.parameters()):
        p.ds_id = i
    got = dict(iter_trainer_weights(trained, bucket_bytes=1024))
    assert list(got) == want and len(gathered) > 1  # gathered a bucket at a time
    assert torch.equal(got["0.weight"], trained[0]._checkpoint_wrapped_module.weight)


def test_third_party_collective_transport_gets_its_group_rank(fresh_pm):
    """A registered transport declaring ``collective`` is attached with ``rank=rank + 1`` (as
    WeightTransport promises), whatever its handle's class; its receiver then loads versions."""
    from mrl_plugins.hookspecs import Capabilities, WeightTransport

    attached: list[int] = []

    class RingHandle:
        def __init__(self, inner):
            self.inner = inner

        def attach(self, rank=None):
            if rank is None:
                raise WeightSyncError("a ring receiver needs its group rank")
            attached.append(rank)
            return self.inner.attach()

    class RingSender(ShmSender):
        def receiver_handle(self):
            return RingHandle(super().receiver_handle())

    class Ring:
        @hookimpl
        def mrl_weight_sync_register_transports(self):
            caps = Capabilities(collective=True, cross_host=True)
            return [WeightTransport(name="ring", factory=RingSender, description="test ring", capabilities=caps)]

    mgr = fresh_pm({"weight_sync": {"transport": "ring", "timeout_s": 5}}, plugins=[("ringplug", Ring())])
    ctx = StageContext(config=mgr.config)
    s = mgr.weight_sync_open_sender(ctx=ctx, model_id="policy", run_id="ring", receivers=3, same_process=False)
    model = make_model()
    recvs = []
    try:
        for r in (0, 2):
            h = s.receiver_handle()
            recvs.append(mgr.weight_sync_open_receiver(ctx=ctx, model=model, handle=h, model_id="policy", rank=r))
        assert attached == [1, 3]
        s.publish(1, filled(model, 1.0))
        assert recvs[1].poll(5) == 1 and recvs[1].switch(5).to_version == 1 and values(model) == {1.0}
    finally:
        for r in recvs:
            r.close()
        s.close()
