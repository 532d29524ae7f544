"""The ``broadcast`` weight transport across real processes (gloo): checksums, layouts, several receivers.

The sender runs in the test process, receivers in spawned children; every transfer is a real gloo
transfer between processes.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from mrl_plugins.weight_sync import BroadcastSender, DoubleBufferedReceiver, WeightSyncConfig, WeightSyncError
from mrl_plugins.weight_sync.shards import CHECKSUM_ALGOS, as_bytes, checksum, chunk_checksums

pytestmark = pytest.mark.slow
CTX = mp.get_context("spawn")


def model_for_test() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(3000, 64), torch.nn.Linear(64, 300), torch.nn.LayerNorm(300))
    return m.to(torch.bfloat16)


def filled(model: torch.nn.Module, v: float) -> list[tuple[str, torch.Tensor]]:
    return [(n, torch.full_like(p, v)) for n, p in model.named_parameters()]


def mixed_tensors(v: int) -> list[tuple[str, torch.Tensor]]:
    """Every layout case: row-split big tensors, packed small ones, 0-d, empty, bool, int8, 1-d."""
    g = torch.Generator().manual_seed(v)
    return [
        ("big.f32", torch.randn(97, 33, generator=g)),  # 12.8 kB: split by rows
        ("big.bf16", torch.randn(300, 7, generator=g).to(torch.bfloat16)),
        ("vec.f16", torch.randn(2001, generator=g).to(torch.float16)),  # 1-d: split by elements
        ("small.i8", torch.randint(-100, 100, (5, 3), generator=g, dtype=torch.int8)),
        ("small.bool", torch.rand(17, generator=g) > 0.5),
        ("scalar", torch.tensor(float(v))),
        ("empty", torch.empty(0, 4)),
        ("small.i64", torch.arange(9, dtype=torch.int64) * v),
        ("big.u8", torch.randint(0, 255, (400, 512), generator=g, dtype=torch.uint8)),  # 205 kB
    ]


def _wait_staged(recv: DoubleBufferedReceiver, timeout: float = 30) -> int:
    deadline = time.monotonic() + timeout
    while True:
        v = recv.poll(timeout)
        if v is not None:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError("no version announced")
        time.sleep(0.005)


def _corrupting_receiver(handle, q) -> None:
    """Receive v1, then v2 with one byte flipped on arrival (as a bad link would), then v3."""
    torch.set_num_threads(1)
    import mrl_plugins.weight_sync.broadcast_rx as bc  # the receiving side's checksums

    try:
        model = model_for_test()
        recv = DoubleBufferedReceiver(model, handle.attach())
        assert _wait_staged(recv) == 1 and recv.switch(10).to_version == 1
        good = {n: p.detach().clone() for n, p in model.named_parameters()}
        real, calls = bc.chunk_checksums, []

        def flip_third_message(buf, chunk, algo):
            calls.append(1)
            if len(calls) == 3:
                buf[buf.numel() // 2] ^= 0x20  # the received bytes differ from what the sender checksummed
            return real(buf, chunk, algo)

        bc.chunk_checksums = flip_third_message
        try:
            _wait_staged(recv)
            q.put(("error", "version 2 was staged despite a corrupted message"))
            return
        except WeightSyncError as exc:
            err = str(exc)
        finally:
            bc.chunk_checksums = real
        unchanged = all(torch.equal(p, good[n]) for n, p in model.named_parameters())
        no_switch = recv.switch(1) is None and recv.version == 1  # nothing staged
        # a poll right now could retry version 2 while the sender has not announced 3 yet: wait for 3
        deadline = time.monotonic() + 30
        while recv.tr.latest_version() != 3:
            assert time.monotonic() < deadline, "version 3 never announced"
            time.sleep(0.005)
        assert recv.stage(3, 30) == 3 and recv.switch(10).to_version == 3  # the stream stayed in step
        v3 = {n: float(p.detach().float().unique().item()) for n, p in model.named_parameters()}
        q.put(("done", err, unchanged, no_switch, v3))
        recv.close()
    except BaseException as exc:  # report instead of hanging the parent
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def test_corrupted_message_means_no_switch_and_a_clear_error():
    cfg = WeightSyncConfig(transport="broadcast", timeout_s=30, bucket_bytes=20_000, chunk_bytes=4096).validate()
    sender = BroadcastSender(cfg, model_id="policy", group_bytes=60_000)
    model = model_for_test()
    q = CTX.Queue()
    child = CTX.Process(target=_corrupting_receiver, args=(sender.receiver_handle(), q), daemon=True)
    child.start()
    try:
        for v in (1, 2, 3):
            rep = sender.publish(v, filled(model, float(v)))
            assert rep.shards > 3  # several messages, several groups
        msg = q.get(timeout=60)
        assert msg[0] == "done", msg
        _, err, unchanged, no_switch, v3 = msg
        assert "checksum mismatch in message 2" in err and "version 2" in err and "model_id=policy" in err
        assert unchanged and no_switch  # the active copy still holds version 1
        assert set(v3.values()) == {3.0}
    finally:
        _stop([child], sender, q)


def _layout_receiver(handle, rank, versions, q) -> None:
    """Fetch each version into contiguous and non-contiguous destinations; report what arrived."""
    torch.set_num_threads(1)
    try:
        rx = handle.attach(rank)
        for v in versions:
            ref = mixed_tensors(v)
            dest = {n: torch.zeros_like(t) for n, t in ref}
            if v % 2:  # non-contiguous destinations for two tensors (received through a buffer)
                dest["big.f32"] = torch.zeros(33, 97).t()
                dest["small.i8"] = torch.zeros(3, 5, dtype=torch.int8).t()
            else:  # every destination a strided view: every message through a buffer, copied in row pieces
                dest = {n: torch.zeros(2 * len(t), *t.shape[1:], dtype=t.dtype)[::2] if t.dim() else d
                        for (n, t), d in zip(ref, dest.values())}  # fmt: skip
            rx.fetch_into(v, dest, 30)
            got = {n: t.contiguous() for n, t in dest.items()}
            q.put((rank, v, {n: bool(torch.equal(got[n], t)) and got[n].dtype == t.dtype for n, t in ref}))
        rx.close()
    except BaseException as exc:  # report instead of hanging the parent
        q.put((rank, "error", f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_layout_bit_exact_to_every_receiver(world_size, monkeypatch):
    # tiny buckets and chunks: big tensors split by rows, small ones packed, and the end control's
    # checksum list (one per 64 bytes of ~227 kB) overflows the fixed 64 KiB control head
    import mrl_plugins.weight_sync.broadcast as bc

    overflowed = []
    real_pack = bc._ctrl_pack

    def pack(msg, base=0):
        head, rest = real_pack(msg, base)
        overflowed.append(rest is not None)
        return head, rest

    monkeypatch.setattr(bc, "_ctrl_pack", pack)
    cfg = WeightSyncConfig(transport="broadcast", timeout_s=30, bucket_bytes=1000, chunk_bytes=64).validate()
    sender = BroadcastSender(cfg, model_id="m", group_bytes=1 << 30, world_size=world_size)
    versions = [1, 2]
    q = CTX.Queue()
    kids = [
        CTX.Process(target=_layout_receiver, args=(sender.receiver_handle(), r, versions, q), daemon=True)
        for r in range(1, world_size)
    ]
    for k in kids:
        k.start()
    try:
        for v in versions:
            rep = sender.publish(v, mixed_tensors(v))
            assert rep.nbytes == sum(t.nbytes for _, t in mixed_tensors(v)) and rep.shards > 20  # messages
        assert any(overflowed)
        seen = {}
        for _ in range(len(kids) * len(versions)):
            rank, v, ok = q.get(timeout=60)
            assert v != "error", ok
            seen[(rank, v)] = ok
        assert len(seen) == len(kids) * len(versions)
        for ok in seen.values():
            assert all(ok.values()), ok
    finally:
        _stop(kids, sender, q)


def _plain_receiver(handle, q) -> None:
    torch.set_num_threads(1)
    try:
        rx = handle.attach()
        dest = {n: torch.zeros_like(t) for n, t in mixed_tensors(1)}
        try:
            rx.fetch_into(5, dest, 30)  # the sender publishes 4
            q.put("no error")
        except WeightSyncError as exc:
            q.put(str(exc))
        rx.close()
    except BaseException as exc:  # report instead of hanging the parent
        q.put(f"{type(exc).__name__}: {exc}")


def test_version_mismatch_is_reported_after_the_stream():
    sender = BroadcastSender(WeightSyncConfig(transport="broadcast", timeout_s=30), model_id="m")
    q = CTX.Queue()
    child = CTX.Process(target=_plain_receiver, args=(sender.receiver_handle(), q), daemon=True)
    child.start()
    try:
        sender.publish(4, mixed_tensors(1))  # completes: the receiver consumed the whole stream
        assert "asked for version 5, the sender is publishing 4" in q.get(timeout=60)
    finally:
        _stop([child], sender, q)


def test_checksum_algorithms():
    buf = as_bytes(torch.arange(1000, dtype=torch.int32))
    assert set(CHECKSUM_ALGOS) == {"crc32c", "xxh3"}
    a, b = checksum(buf, "xxh3"), checksum(buf, "crc32c")
    assert a != b and b < 1 << 32 and checksum(buf) == b  # crc32c stays the default (shard format)
    flipped = buf.clone()
    flipped[123] ^= 1
    assert checksum(flipped, "xxh3") != a and checksum(flipped, "crc32c") != b
    sums = chunk_checksums(buf, 1000, "xxh3")
    assert len(sums) == 4 and sums[0] == checksum(buf[:1000], "xxh3") and sums[3] == checksum(buf[3000:], "xxh3")
    with pytest.raises(WeightSyncError, match="unknown checksum algorithm 'md5'.*'crc32c' or 'xxh3'"):
        checksum(buf, "md5")


def _group_member(rank, port, q, hq) -> None:
    """Rank 0 publishes, rank 1 receives, both over a default gloo group handed in (as hccl/nccl would be)."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        cfg = WeightSyncConfig(transport="broadcast", timeout_s=30, bucket_bytes=1000, chunk_bytes=64).validate()
        if rank == 0:
            s = BroadcastSender(cfg, model_id="m", group=dist.group.WORLD, group_bytes=5000)
            assert s.receiver_handle().connections == 1
            hq.put(s.receiver_handle())
            q.put(("sent", [s.publish(v, mixed_tensors(v)).shards for v in (1, 2)]))
            s.close()
        else:
            rx = hq.get(timeout=30).attach(1, group=dist.group.WORLD)
            exact = []
            for v in (1, 2):
                ref = mixed_tensors(v)
                dest = {n: torch.zeros_like(t) for n, t in ref}
                rx.fetch_into(v, dest, 30)
                exact.append(all(torch.equal(dest[n], t) for n, t in ref))
            q.put(("received", exact))
        dist.destroy_process_group()
    except BaseException as exc:  # report instead of hanging the parent
        q.put(("error", f"rank {rank}: {type(exc).__name__}: {exc}"))


def test_handed_in_group_carries_the_stream_as_ordered_broadcasts():
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    q, hq = CTX.Queue(), CTX.Queue()
    kids = [CTX.Process(target=_group_member, args=(r, port, q, hq), daemon=True) for r in (0, 1)]
    for k in kids:
        k.start()
    try:
        got = {}
        while len(got) < 2:
            kind, val = q.get(timeout=60)
            assert kind != "error", val
            got[kind] = val
        assert got["received"] == [True, True] and min(got["sent"]) > 20
    finally:
        _stop(kids, None, q, hq)


def _as_on_a_device_host() -> None:
    """Make the device layer name nccl, as it does on a CUDA host (the transport then still builds its gloo group)."""
    import mrl_plugins.device as device

    device.collective_backend = lambda device_type=None: "nccl"


def _receiver_on_a_device_host(handle, q) -> None:
    torch.set_num_threads(1)
    try:
        _as_on_a_device_host()
        rx = handle.attach()
        ref = mixed_tensors(1)
        dest = {n: torch.zeros_like(t) for n, t in ref}
        rx.fetch_into(1, dest, 30)
        q.put(all(torch.equal(dest[n], t) for n, t in ref))
        rx.close()
    except BaseException as exc:  # report instead of hanging the parent
        q.put(f"{type(exc).__name__}: {exc}")


def test_on_a_cuda_or_npu_host_the_built_in_group_carries_the_stream_over_gloo(monkeypatch):
    """A config's ``transport: broadcast`` hands in no group: where the device layer names nccl / hccl the
    dedicated group is still gloo (device tensors through host memory), not a refusal at the first publish."""
    import mrl_plugins.device as device
    from mrl_plugins.weight_sync import broadcast_group

    monkeypatch.setattr(device, "collective_backend", lambda device_type=None: "nccl")
    monkeypatch.setattr(broadcast_group, "_said_host_path", [])
    sender = BroadcastSender(WeightSyncConfig(transport="broadcast", timeout_s=30), model_id="m")
    q = CTX.Queue()
    child = CTX.Process(target=_receiver_on_a_device_host, args=(sender.receiver_handle(), q), daemon=True)
    child.start()
    try:
        assert sender.publish(1, mixed_tensors(1)).nbytes == sum(t.nbytes for _, t in mixed_tensors(1))
        assert q.get(timeout=60) is True
        assert broadcast_group._said_host_path == ["nccl"]  # the group asked the device layer, and kept gloo
    finally:
        _stop([child], sender, q)


def _stop(children, sender, *queues) -> None:
    """Join the child processes (kill any that hangs), close the sender (if any) and the queues."""
    for child in children:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)
    if sender is not None:
        sender.close()
    for q in queues:
        q.close()
        q.join_thread()


def test_vllm_store_wait_returns_when_every_receiver_acknowledged_and_times_out_otherwise():
    """The vllm transport's phase wait on its real TCPStore: a key, then a counter reaching the receivers."""
    import threading

    import torch.distributed as dist

    from mrl_plugins.errors import StageTimeoutError
    from mrl_plugins.weight_sync.vllm_transfer import _free_port, _wait

    store = dist.TCPStore("127.0.0.1", _free_port("127.0.0.1"), world_size=1, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(StageTimeoutError, match=r"weight_sync 'vllm': round 3 not done within 0 s"):
        _wait(store, "round_done/3", 2, 0.3, "round 3")
    assert 0.3 <= time.monotonic() - t0 < 2
    store.add("round_done/3", 1)
    with pytest.raises(StageTimeoutError):  # one of two receivers is not enough
        _wait(store, "round_done/3", 2, 0.2, "round 3")
    later = threading.Timer(0.2, store.add, args=("round_done/3", 1))
    later.start()
    _wait(store, "round_done/3", 2, 5, "round 3")
    later.join(5)
    store.set("init", "{}")
    _wait(store, "init", None, 0.2, "joining")  # a key that exists: at once
