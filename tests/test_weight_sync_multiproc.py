"""Weight sync across real processes: gloo broadcast, ZeRO-3 under accelerate, dead senders, SIGTERM cleanup."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.weight_sync import (
    BroadcastSender,
    DoubleBufferedReceiver,
    PerParamSender,
    ShmSender,
    WeightSyncConfig,
    WeightSyncError,
)
from mrl_plugins.weight_sync.shards import as_bytes, checksum

pytestmark = pytest.mark.slow
CTX = mp.get_context("spawn")
SCRIPTS = os.path.join(os.path.dirname(__file__), "scripts")


def model_for_test() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(2000, 64), torch.nn.Linear(64, 600), torch.nn.LayerNorm(600))
    return m.to(torch.bfloat16)


def crcs(model: torch.nn.Module) -> dict[str, int]:
    return {n: checksum(as_bytes(p.detach().contiguous())) for n, p in model.named_parameters()}


def _receiver_child(handle, versions, q) -> None:
    torch.set_num_threads(1)
    try:
        model = model_for_test()
        for p in model.parameters():
            p.data.zero_()
        recv = DoubleBufferedReceiver(model, handle.attach())
        seen = []
        for v in versions:
            deadline = time.monotonic() + 30
            while recv.poll(30) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"version {v} never announced")
                time.sleep(0.005)
            rep = recv.switch(10)
            seen.append((rep.from_version, rep.to_version))
            q.put(("switched", v, crcs(model)))
        q.put(("done", seen, recv.stats()))
    except BaseException as exc:  # report instead of hanging the parent
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def _stop(procs) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


@pytest.mark.parametrize("cls", [BroadcastSender, PerParamSender])
def test_two_process_gloo_broadcast_bit_exact(cls):
    cfg = WeightSyncConfig(transport="broadcast", timeout_s=30, bucket_bytes=200_000, chunk_bytes=65536)
    sender = cls(cfg, model_id="policy", run_id="mp")
    q = CTX.Queue()
    child = CTX.Process(target=_receiver_child, args=(sender.receiver_handle(), [1, 2], q), daemon=True)
    child.start()
    try:
        model = model_for_test()
        for v in (1, 2):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1)
            rep = sender.publish(v, model.named_parameters())
            assert rep.nbytes == sum(p.nbytes for p in model.parameters())
            msg = q.get(timeout=60)
            assert msg[0] == "switched", msg
            assert msg[1] == v and msg[2] == crcs(model)  # bit-exact, every tensor
        done = q.get(timeout=60)
        assert done[0] == "done" and done[1] == [(-1, 1), (1, 2)]
        if cls is BroadcastSender:
            assert rep.shards > 1  # several buckets
    finally:
        _stop([child])
        sender.close()
        q.close()
        q.join_thread()


def _stalling_sender(kind, q, stall_after) -> None:
    """Publish v1 fully, then stall forever inside the publish of v2 (until killed)."""
    torch.set_num_threads(1)
    cfg = WeightSyncConfig(transport=kind, timeout_s=30, bucket_bytes=100_000, chunk_bytes=4096)
    sender = ShmSender(cfg, model_id="policy", run_id="kill") if kind == "shm" else BroadcastSender(cfg)
    q.put(sender.receiver_handle())
    model = model_for_test()
    sender.publish(1, model.named_parameters())
    q.put("v1")

    def stalled():
        for i, item in enumerate(model.named_parameters()):
            if i == stall_after:
                q.put("stalled")
                time.sleep(600)
            yield item

    sender.publish(2, stalled())


def _reap(child, sender, q) -> None:
    """Kill ``child`` if it still runs, close ``sender`` and the queue."""
    if child.is_alive():
        child.kill()
    child.join(5)
    sender.close()
    q.close()
    q.join_thread()


def _fetch_and_stall(rx, version, q) -> None:
    """``fetch_into(version)`` into a destination that stalls (until killed) at the first tensor it looks up."""

    class Stalling(dict):
        def get(self, name, default=None):
            q.put("stalled")
            time.sleep(600)

    rx.fetch_into(version, Stalling(), 600)


def _stalling_receiver(handle, names, q) -> None:
    """Take version 0, then join the broadcast of version 1 and stall at the first tensor it looks up."""
    torch.set_num_threads(1)
    rx = handle.attach()
    rx.fetch_into(0, {n: torch.empty(1024, 1024) for n in names}, 60)
    q.put("v0")
    _fetch_and_stall(rx, 1, q)


@pytest.mark.parametrize("fate", ["killed", "stuck"])
def test_receiver_gone_mid_transfer_fails_the_sender_within_its_timeout(fate):
    """A receiver that dies (or stops reading) inside a broadcast: publish raises instead of waiting forever."""
    timeout = 4.0
    cfg = WeightSyncConfig(transport="broadcast", timeout_s=60, bucket_bytes=64 << 10, chunk_bytes=16 << 10)
    sender = BroadcastSender(cfg, group_bytes=256 << 10)
    sender.window_bytes = 256 << 10  # a small window: the sender waits on the receiver early
    named = [(f"w{i}", torch.full((1024, 1024), float(i))) for i in range(8)]  # 32 MB, far beyond socket buffers
    q = CTX.Queue()
    child = CTX.Process(target=_stalling_receiver, args=(sender.receiver_handle(), [n for n, _ in named], q))
    child.daemon = True
    child.start()
    try:
        import threading

        sender.publish(0, named)  # the group is formed and the receiver is up
        assert q.get(timeout=60) == "v0"
        sender.timeout = timeout
        killed: list[float] = []

        def kill_when_stalled() -> None:
            if q.get(timeout=60) == "stalled" and fate == "killed":
                os.kill(child.pid, signal.SIGKILL)
                killed.append(time.monotonic())

        watcher = threading.Thread(target=kill_when_stalled, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        with pytest.raises(StageTimeoutError, match=r"weight transfer: peer dead or not answering within 4\.0s"):
            sender.publish(1, named)
        failed = time.monotonic()
        watcher.join(5)
        if fate == "stuck":  # the receiver is alive but reads nothing: the sender gives up after its timeout
            assert timeout - 0.5 < failed - t0 < timeout + 3
        else:  # the closed connection ends the wait well before the timeout
            assert killed and failed - killed[0] < timeout
    finally:
        _reap(child, sender, q)


def _stalling_shm_reader(handle, q) -> None:
    """Read version 1 and stall inside the copy of its first shard (holding the slot's reader lock)."""
    _fetch_and_stall(handle.attach(), 1, q)


@pytest.mark.parametrize("fate", ["killed", "stuck"])
def test_shm_reader_gone_mid_read(fate):
    """The writer reuses a slot only when no reader holds it: a stuck reader makes that publish time out
    (clear error, the other slot's version stays published); a killed reader's lock goes with it."""
    timeout = 3.0
    sender = ShmSender(WeightSyncConfig(timeout_s=timeout, chunk_bytes=4096), model_id="policy", run_id="gone")
    model = model_for_test()
    q = CTX.Queue()
    child = CTX.Process(target=_stalling_shm_reader, args=(sender.receiver_handle(), q), daemon=True)
    try:
        sender.publish(1, model.named_parameters())
        child.start()
        assert q.get(timeout=60) == "stalled"
        sender.publish(2, model.named_parameters())  # the other slot: free
        if fate == "killed":
            os.kill(child.pid, signal.SIGKILL)
            child.join(10)
            assert sender.publish(3, model.named_parameters()).version == 3  # version 1's slot is free again
        else:
            t0 = time.monotonic()
            with pytest.raises(StageTimeoutError, match=r"lock on shm slot .* \(a reader holds it\)"):
                sender.publish(3, model.named_parameters())
            assert timeout - 0.5 < time.monotonic() - t0 < timeout + 3
            rx = sender.receiver_handle().attach()
            assert rx.latest_version() == 2  # nothing half-published
            rx.close()
    finally:
        _reap(child, sender, q)


@pytest.mark.parametrize("kind", ["shm", "broadcast"])
def test_sender_killed_mid_transfer_gives_timeout(kind):
    q = CTX.Queue()
    child = CTX.Process(target=_stalling_sender, args=(kind, q, 2), daemon=True)
    child.start()
    try:
        handle = q.get(timeout=60)
        model = model_for_test()
        recv = DoubleBufferedReceiver(model, handle.attach())
        deadline = time.monotonic() + 30
        while recv.poll(20) is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert recv.switch(5).to_version == 1 and q.get(timeout=30) == "v1"
        before = crcs(model)
        timeout = 4.0
        if kind == "broadcast":  # the receiver is inside the collective when the sender dies
            import threading

            # the sender blocks in its first bucket until we join, then stalls; kill it while we wait in the stream
            threading.Timer(1.5, lambda: os.kill(child.pid, signal.SIGKILL)).start()
            t0 = time.monotonic()
            with pytest.raises(StageTimeoutError, match="peer dead or not answering"):
                assert recv.poll(timeout) == 2 or recv.stage(2, timeout)
        else:  # the shm writer dies while writing version 2 (the reader streams its first shards)
            assert q.get(timeout=30) == "stalled"
            os.kill(child.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(StageTimeoutError, match="died (before publishing|while writing) version 2"):
                recv.stage(2, timeout)
        assert time.monotonic() - t0 < timeout + 2
        assert recv.switch(1) is None and recv.version == 1 and crcs(model) == before
        recv.close()
    finally:
        if child.is_alive():
            child.kill()
        child.join(5)
        q.close()
        q.join_thread()
    if kind == "shm":  # the killed writer could not unlink; the next sender removes its segments
        mine = f"-p{child.pid}n{os.stat('/proc/self/ns/pid').st_ino}-"
        left = [n for n in os.listdir("/dev/shm") if n.startswith("mrl-weights-") and mine in n]
        assert left
        s = ShmSender(WeightSyncConfig(), model_id="policy", run_id="after")
        s.close()
        assert not [n for n in os.listdir("/dev/shm") if n.startswith("mrl-weights-") and mine in n]


def test_sigterm_unlinks_shm_segments():
    code = (
        "import sys, time, torch\n"
        "from mrl_plugins.weight_sync import ShmSender, WeightSyncConfig\n"
        "s = ShmSender(WeightSyncConfig(), model_id='policy', run_id='sigterm')\n"
        "s.publish(1, [('w', torch.ones(10))])\n"
        "print(s.ctl.path, *[x.path for x in s.slots], flush=True)\n"
        "time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        paths = p.stdout.readline().split()
        assert len(paths) == 3 and all(os.path.exists(x) for x in paths)
        p.send_signal(signal.SIGTERM)
        assert p.wait(20) == -signal.SIGTERM  # default disposition kept after cleanup
        assert not any(os.path.exists(x) for x in paths)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(5)
        p.stdout.close()


def test_sigterm_mid_publish_exits_with_the_handlers_code():
    """SIGTERM while a version is being written, with a handler of the trainer's that raises SystemExit (the TRL
    adapter's): the shm cleanup closes the sender first, then the handler's exit must come through (it once
    became a TypeError from the abort path writing into the closed segment)."""
    code = (
        "import os, signal, sys, torch\n"
        "def on_term(signum, frame):\n"
        "    raise SystemExit(128 + signum)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "from mrl_plugins.weight_sync import ShmSender, WeightSyncConfig\n"
        "s = ShmSender(WeightSyncConfig(), model_id='policy', run_id='sigterm-mid')\n"
        "print(s.ctl.path, *[x.path for x in s.slots], flush=True)\n"
        "def tensors():\n"
        "    yield 'a', torch.ones(1000)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    yield 'b', torch.ones(1000)\n"
        "s.publish(1, tensors())\n"
        "print('PUBLISHED', flush=True)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    paths = p.stdout.split("\n")[0].split()
    assert p.returncode == 128 + signal.SIGTERM, p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "PUBLISHED" not in p.stdout, p.stderr[-3000:]
    assert len(paths) == 3 and not any(os.path.exists(x) for x in paths)


def test_broadcast_receiver_sees_abort_when_source_fails():
    cfg = WeightSyncConfig(transport="broadcast", timeout_s=20, bucket_bytes=100_000)
    sender = BroadcastSender(cfg)
    q = CTX.Queue()
    child = CTX.Process(target=_receiver_child, args=(sender.receiver_handle(), [1], q), daemon=True)
    child.start()
    try:
        model = model_for_test()

        def broken():
            yield from list(model.named_parameters())[:2]
            raise RuntimeError("gather failed")

        with pytest.raises(RuntimeError, match="gather failed"):
            sender.publish(1, broken())
        msg = q.get(timeout=60)
        assert msg[0] == "error" and "aborted version 1" in msg[1]
    finally:
        _stop([child])
        sender.close()
        q.close()
        q.join_thread()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_zero3_two_processes_gather_bucketwise_and_publish(tmp_path):
    """DeepSpeed ZeRO-3 on CPU (gloo) across 2 processes launched by accelerate."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 2,
        "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
    }))  # fmt: skip
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    env = {**os.environ, "WS_OUT": str(tmp_path / "out"), "WS_DIR": str(tmp_path / "dir"), "OMP_NUM_THREADS": "1"}
    cmd = [accelerate, "launch", "--num_processes", "2", "--num_machines", "1", "--use_deepspeed",
           "--deepspeed_config_file", str(ds), "--zero3_init_flag", "false", "--main_process_port",
           str(_free_port()), os.path.join(SCRIPTS, "ws_zero3.py")]  # fmt: skip
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    r0 = json.loads((tmp_path / "out.0").read_text())
    r1 = json.loads((tmp_path / "out.1").read_text())
    assert r0["world"] == 2 and r0["zero3"] and r1["zero3"]
    assert r0["bit_exact"] and r0["names"] == ["0.weight", "1.bias", "1.weight", "3.bias", "3.weight"]
    assert r1["drained"] == 5  # the non-publishing rank took part in every gather
    for r in (r0, r1):  # never the whole model at once: about one bucket (or the largest parameter)
        assert r["peak_gathered_bytes"] <= max(r["bucket_bytes"], r["max_param_bytes"]) < r["total_bytes"]


def test_receiver_handle_pickles_for_spawn():
    import pickle

    s = ShmSender(WeightSyncConfig(), model_id="policy", run_id="pickle")
    try:
        h = pickle.loads(pickle.dumps(s.receiver_handle()))
        rx = h.attach()
        assert rx.latest_version() is None
        rx.close()
    finally:
        s.close()
    with pytest.raises(WeightSyncError, match="gone"):
        h.attach()
