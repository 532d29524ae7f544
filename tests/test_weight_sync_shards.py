"""Shards, config and the single-process side of the shm and directory transports (real shm, real files)."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load as st_load

from mrl_plugins.errors import ConfigError, MrlError, StageTimeoutError
from mrl_plugins.shmem import remove_stale, shm_dir
from mrl_plugins.weight_sync import DirectorySender, ShmSender, WeightSyncConfig, WeightSyncError
from mrl_plugins.weight_sync.shards import ALIGN, parse_shard
from mrl_plugins.weight_sync.shm import TABLE_OFF


def all_dtypes() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    big = torch.randn(257, 33, generator=g)
    return {
        "fp32": torch.randn(64, 17, generator=g),
        "fp32.big": big,  # split by rows with small chunks
        "bf16": torch.randn(40, 9, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, 3, 5, generator=g).half(),
        "int8": torch.randint(-128, 127, (333,), generator=g, dtype=torch.int8),
        "bool": torch.rand(19, 3, generator=g) > 0.5,
        "noncontig": torch.randn(30, 40, generator=g).t(),
        "noncontig.slice": torch.randn(50, 8, generator=g)[::3],
        "scalar": torch.tensor(3.25),
        "scalar.bf16": torch.tensor(-1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "nan": torch.tensor([float("nan"), float("inf"), -0.0]),
    }


def fresh_dest(ts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.full_like(v.contiguous(), 0) if v.dtype != torch.bool else torch.zeros_like(v) for k, v in ts.items()
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.contiguous(), b.contiguous()
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.view(-1).view(torch.uint8).numpy()) == bytes(b.view(-1).view(torch.uint8).numpy())
    )


@pytest.fixture
def shm_sender():
    made = []

    def make(**kw):
        cfg = WeightSyncConfig(**{"chunk_bytes": 1024, "timeout_s": 5, **kw})
        s = ShmSender(cfg, model_id=kw.pop("model_id", "policy") if "model_id" in kw else "policy", run_id="t")
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.parametrize("transport", ["shm", "directory"])
def test_round_trip_bit_exact(transport, tmp_path, shm_sender):
    ts = all_dtypes()
    if transport == "shm":
        s = shm_sender()
    else:
        s = DirectorySender(WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=1024),
                            model_id="policy", run_id="t")  # fmt: skip
    rx = s.receiver_handle().attach()
    assert rx.latest_version() is None
    rep = s.publish(7, ts.items())
    assert rep.shards > 5 and rep.nbytes == sum(t.nbytes for t in ts.values())
    assert rx.latest_version() == 7
    dest = fresh_dest(ts)
    assert rx.fetch_into(7, dest, 5) == rep.nbytes
    for k, v in ts.items():
        assert bit_equal(dest[k], v), k
    rx.close()


def test_shards_are_valid_aligned_safetensors(tmp_path):
    ts = all_dtypes()
    s = DirectorySender(WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=2048),
                        model_id="policy", run_id="t")  # fmt: skip
    s.publish(3, ts.items())
    folder = tmp_path / "t" / "policy" / "weight_v3"
    files = sorted(folder.iterdir())
    manifest = json.loads((tmp_path / "t" / "policy" / "manifest.json").read_text())
    assert manifest["shard_count"] == len(files) and manifest["version"] == 3
    seen = {}
    for i, f in enumerate(files):
        raw = f.read_bytes()
        loaded = st_load(raw)  # the reference implementation accepts every shard
        hlen = int.from_bytes(raw[:8], "little")
        assert (8 + hlen) % ALIGN == 0
        parsed = parse_shard(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        assert parsed.meta.version == 3 and parsed.meta.shard_index == i and parsed.meta.shard_count == len(files)
        assert parsed.meta.model_id == "policy" and len(parsed.meta.uuid) == 32
        for e, view in parsed.entries:
            assert e.offset % ALIGN == 0
            key = e.key
            assert bit_equal(loaded[key], view)
            seen.setdefault(e.name, []).append(e)
    assert set(seen) == set(ts)
    assert len(seen["fp32.big"]) > 1  # split by rows
    rows = sorted((e.row0, e.row0 + e.shape[0]) for e in seen["fp32.big"])
    assert rows[0][0] == 0 and rows[-1][1] == 257 and all(a[1] == b[0] for a, b in zip(rows, rows[1:]))


def test_corrupted_shm_shard_is_rejected(shm_sender):
    ts = all_dtypes()
    s = shm_sender(max_retries=1)
    rx = s.receiver_handle().attach()
    s.publish(1, ts.items())
    seg = rx.slots[0]
    off, n = seg.read("<QQ", TABLE_OFF + 16 * 2)  # third shard
    hlen = int.from_bytes(seg.mm[off : off + 8], "little")
    seg.mm[off + 8 + hlen] ^= 0xFF
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        rx.fetch_into(1, fresh_dest(ts), 2)
    rx.close()


def test_missing_and_corrupted_directory_shard(tmp_path):
    ts = all_dtypes()
    s = DirectorySender(WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=1024,
                                         max_retries=0), model_id="policy", run_id="t")  # fmt: skip
    s.publish(1, ts.items())
    rx = s.receiver_handle().attach()
    folder = tmp_path / "t" / "policy" / "weight_v1"
    f = sorted(folder.iterdir())[1]
    raw = bytearray(f.read_bytes())
    raw[-1] ^= 1
    f.write_bytes(bytes(raw))
    with pytest.raises(WeightSyncError, match="checksum"):
        rx.fetch_into(1, fresh_dest(ts), 2)
    f.unlink()
    with pytest.raises(WeightSyncError, match="missing shard"):
        rx.fetch_into(1, fresh_dest(ts), 2)
    assert issubclass(WeightSyncError, MrlError)


def test_directory_read_is_retried_and_a_transient_corruption_recovers(tmp_path, caplog):
    """A shared filesystem may show a shard before all of its bytes arrived: the first read fails its checksum,
    the file is whole by the retry, and the version arrives intact; without retries the same is a clear error."""
    ts = all_dtypes()
    for retries in (1, 0):
        root = tmp_path / f"r{retries}"
        cfg = WeightSyncConfig(transport="directory", directory=str(root), chunk_bytes=1024, max_retries=retries)
        s = DirectorySender(cfg, model_id="policy", run_id="t")
        s.publish(1, ts.items())
        rx = s.receiver_handle().attach()
        f = sorted((root / "t" / "policy" / "weight_v1").iterdir())[1]
        whole = f.read_bytes()
        f.write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))  # not yet fully arrived
        passes = []
        real = rx._blobs

        def blobs(m, real=real, f=f, whole=whole, passes=passes):
            passes.append(1)
            if len(passes) > 1:
                f.write_bytes(whole)  # by the retry the filesystem caught up
            yield from real(m)

        rx._blobs = blobs
        dest = fresh_dest(ts)
        if retries:
            with caplog.at_level("WARNING", logger="mrl_plugins.weight_sync"):
                assert rx.fetch_into(1, dest, 5) == sum(t.nbytes for t in ts.values())
            assert len(passes) == 2 and all(bit_equal(dest[n], t) for n, t in ts.items())
            assert "read 1 of 2 failed" in caplog.text and "checksum" in caplog.text
        else:
            with pytest.raises(WeightSyncError, match="checksum"):
                rx.fetch_into(1, dest, 5)
            assert len(passes) == 1


def test_wrong_destination_is_a_clear_error(shm_sender):
    s = shm_sender()
    rx = s.receiver_handle().attach()
    s.publish(1, [("a", torch.ones(3)), ("b", torch.ones(2))])
    with pytest.raises(WeightSyncError, match="'b' has no destination"):
        rx.fetch_into(1, {"a": torch.zeros(3)}, 2)
    with pytest.raises(WeightSyncError, match="destination is torch.float16"):
        rx.fetch_into(1, {"a": torch.zeros(3, dtype=torch.float16), "b": torch.zeros(2)}, 2)
    s.publish(2, [("big", torch.ones(300, 4))])  # 4800 bytes: row chunks of at most 1024
    for wrong in ((299, 4), (300, 5), (1200,)):  # every chunk checks the whole tensor's shape
        msg = f"big: received torch.float32(300, 4), destination is torch.float32{wrong}"
        with pytest.raises(WeightSyncError, match=re.escape(msg)):
            rx.fetch_into(2, {"big": torch.zeros(wrong)}, 2)
    rx.close()


def test_versions_must_increase_and_unsupported_dtype(shm_sender, tmp_path):
    s = shm_sender()
    s.publish(5, [("a", torch.ones(3))])
    with pytest.raises(WeightSyncError, match="not newer"):
        s.publish(5, [("a", torch.ones(3))])
    with pytest.raises(WeightSyncError, match="cannot be published"):
        s.publish(6, [("c", torch.ones(2, dtype=torch.complex64))])
    with pytest.raises(WeightSyncError, match="published twice"):
        s.publish(7, [("a", torch.ones(3)), ("a", torch.ones(3))])


def test_shm_slots_alternate_and_are_reused(shm_sender):
    s = shm_sender()
    rx = s.receiver_handle().attach()
    sizes = []
    for v in range(1, 6):
        s.publish(v, [("w", torch.full((1000,), float(v)))])
        sizes.append(tuple(os.path.getsize(p) for p in rx.h.slot_paths))
        versions = sorted(seg.read("<Q", 16)[0] - 1 for seg in rx.slots)
        assert versions == ([v] if v == 1 else [v - 1, v]) or (v == 1 and versions == [-1, 1])
        dest = {"w": torch.zeros(1000)}
        rx.fetch_into(v, dest, 2)
        assert torch.all(dest["w"] == v)
    assert len(set(sizes)) == 1  # no re-allocation
    # the previous version stays readable while the next one is written into the other slot
    rx.fetch_into(4, {"w": torch.zeros(1000)}, 2)
    with pytest.raises(WeightSyncError, match="no longer"):
        rx.fetch_into(2, {"w": torch.zeros(1000)}, 2)
    rx.close()


def test_shm_close_unlinks_and_stale_segments_are_removed(shm_sender):
    s = shm_sender()
    paths = [s.ctl.path, *(x.path for x in s.slots)]
    assert all(os.path.exists(p) for p in paths)
    s.close()
    assert not any(os.path.exists(p) for p in paths)
    ns = os.stat("/proc/self/ns/pid").st_ino
    owner = f"p{os.getpid()}n{ns}-"
    assert all(os.path.basename(p).startswith(f"mrl-weights-t-{owner}") for p in paths)  # the one naming scheme
    # segments left behind by a dead pid of this pid namespace (pid 2**22+1 does not exist on Linux defaults), of
    # either stage, go in one sweep; a live pid's stay, and so do another namespace's and a name without one (a
    # container sharing /dev/shm: its pids mean nothing here)
    stale = [
        os.path.join(shm_dir(), f"mrl-{stage}-old-p4194305n{ns}-0badf00d.policy.ctl") for stage in ("weights", "comm")
    ]
    kept = [
        os.path.join(shm_dir(), name)
        for name in (
            f"mrl-weights-old-p{os.getpid()}n{ns}-0000beef.policy.ctl",
            f"mrl-weights-old-p4194305n{ns + 1}-0000beef.policy.ctl",
            "mrl-weights-old-p4194305-0000beef.policy.ctl",
        )
    ]
    for path in [*stale, *kept]:
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = remove_stale()
        assert set(stale) <= set(removed) and not set(kept) & set(removed)
        assert not any(os.path.exists(p) for p in stale) and all(os.path.exists(p) for p in kept)
    finally:
        for path in kept:
            os.unlink(path)


def test_several_model_ids_do_not_mix():
    cfg = WeightSyncConfig(timeout_s=5)
    a = ShmSender(cfg, model_id="policy", run_id="multi")
    b = ShmSender(cfg, model_id="reference", run_id="multi")
    try:
        a.publish(3, [("w", torch.full((10,), 3.0))])
        b.publish(1, [("w", torch.full((10,), -1.0))])
        ra, rb = a.receiver_handle().attach(), b.receiver_handle().attach()
        assert (ra.latest_version(), rb.latest_version()) == (3, 1)
        da, db = {"w": torch.zeros(10)}, {"w": torch.zeros(10)}
        ra.fetch_into(3, da, 2)
        rb.fetch_into(1, db, 2)
        assert torch.all(da["w"] == 3) and torch.all(db["w"] == -1)
        ra.close()
        rb.close()
        with pytest.raises(WeightSyncError, match="already exists"):
            ShmSender(cfg, model_id="policy", run_id="multi")
    finally:
        a.close()
        b.close()


def test_config_validation():
    cfg = WeightSyncConfig()
    assert cfg.validate() is cfg and cfg.transport == "auto" and cfg.verify_checksum  # auto: derived when loaded
    assert cfg.chunk_for("shm") > 0 and cfg.bucket_for("broadcast") >= cfg.chunk_for("broadcast")
    with pytest.raises(ConfigError, match="unknown weight_sync key 'chunk'.*valid keys: .*chunk_bytes"):
        WeightSyncConfig.from_dict({"chunk": 5})
    with pytest.raises(ConfigError, match="weight_sync.staging: 'disk' invalid; valid: 'device' or 'host'"):
        WeightSyncConfig.from_dict({"staging": "disk"})
    with pytest.raises(ConfigError, match="directory must be set"):
        WeightSyncConfig.from_dict({"transport": "directory"})
    with pytest.raises(ConfigError, match="chunk_bytes"):
        WeightSyncConfig.from_dict({"chunk_bytes": 10})
    with pytest.raises(ConfigError, match="poll_interval_s"):
        WeightSyncConfig.from_dict({"poll_interval_s": 0})
    with pytest.raises(ConfigError, match="timeout_s"):
        WeightSyncConfig.from_dict({"timeout_s": -1})
    assert WeightSyncConfig.from_dict({"transport": "directory", "directory": "/tmp/x"}).directory == "/tmp/x"
    for f in WeightSyncConfig.__dataclass_fields__.values():  # a setting says what it does, an internal field why
        assert f.metadata.get("help") or f.metadata.get("internal"), f.name


def test_directory_manifest_is_atomic_and_old_versions_collected(tmp_path):
    cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=4096, keep_versions=2)
    s = DirectorySender(cfg, model_id="policy", run_id="t")
    rx = s.receiver_handle().attach()
    root = tmp_path / "t" / "policy"
    for v in range(1, 6):
        s.publish(v, [("w", torch.full((3000,), float(v)))])
    assert sorted(p.name for p in root.iterdir()) == ["manifest.json", "weight_v4", "weight_v5"]
    # a writer that crashed mid-version leaves only a hidden temp folder and temp manifest: not visible
    (root / ".weight_v9.tmp-1").mkdir()
    (root / "manifest.json.tmp-1").write_text('{"version": 9, "trunc')
    assert rx.latest_version() == 5
    dest = {"w": torch.zeros(3000)}
    rx.fetch_into(5, dest, 2)
    assert torch.all(dest["w"] == 5)


def test_shm_aborted_publish_leaves_the_latest_version_and_the_next_goes_through(shm_sender):
    """A publish that fails midway publishes nothing: the previous version stays readable, a reader waiting for
    the aborted one times out, and the next version is written into the same free slot."""
    s = shm_sender(chunk_bytes=4096, max_retries=0)
    rx = s.receiver_handle().attach()
    s.publish(1, [("a", torch.ones(4096))])

    def broken():
        yield "a", torch.full((4096,), 9.0)
        raise RuntimeError("gather failed")

    with pytest.raises(RuntimeError, match="gather failed"):
        s.publish(2, broken())
    assert rx.latest_version() == 1
    d = {"a": torch.zeros(4096)}
    assert rx.fetch_into(1, d, 5) == 4096 * 4 and torch.all(d["a"] == 1)
    with pytest.raises(StageTimeoutError, match="version 2 not published"):
        rx.fetch_into(2, d, 0.2)
    s.publish(3, [("a", torch.full((4096,), 3.0))])
    rx.fetch_into(3, d, 5)
    assert torch.all(d["a"] == 3) and rx.latest_version() == 3
    rx.close()


@pytest.mark.parametrize("transport", ["shm", "directory"])
def test_a_reader_waits_for_a_version_until_its_timeout_then_names_the_latest(transport, tmp_path, shm_sender):
    """fetch_into of a version not published yet: it arrives while the reader waits, or the wait ends at the
    timeout with the transport's message naming the version and the latest one."""
    import fcntl
    import threading
    import time

    if transport == "shm":
        s = shm_sender(chunk_bytes=4096)
    else:
        cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=4096)
        s = DirectorySender(cfg, model_id="policy", run_id="t")
    rx = s.receiver_handle().attach()
    s.publish(1, [("a", torch.ones(16))])
    d = {"a": torch.zeros(16)}
    t0 = time.monotonic()
    with pytest.raises(StageTimeoutError, match=r"version 2 not published .*within 0\.3s \(latest 1\)"):
        rx.fetch_into(2, d, 0.3)
    assert 0.3 <= time.monotonic() - t0 < 2
    later = threading.Timer(0.2, s.publish, args=(2, [("a", torch.full((16,), 2.0))]))
    later.start()
    assert rx.fetch_into(2, d, 5) == 64 and torch.all(d["a"] == 2)
    later.join(5)
    if transport == "shm":  # a slot locked by its writer: the reader's wait for the lock is bounded too
        seg = next(x for x in s.slots if x.read("<Q", 16)[0] == 3)
        fd = os.open(seg.path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            with pytest.raises(StageTimeoutError, match="timed out waiting for the lock on shm slot"):
                rx.fetch_into(2, d, 0.3)
        finally:
            os.close(fd)
        assert rx.fetch_into(2, d, 5) == 64
    rx.close()
    if transport == "directory":
        s.close()


def _bounded(fn, limit: float):
    """Run ``fn`` in a daemon thread; its exception (or None), and whether it finished within ``limit`` s."""
    import threading

    out: list = []

    def run():
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(limit)
    return (out[0] if out else None), not th.is_alive()


def _odd_ctl_child(q, attached) -> None:
    s = ShmSender(WeightSyncConfig(chunk_bytes=1024, timeout_s=30), model_id="policy", run_id="todd")
    s.publish(1, [("a", torch.ones(8))])
    (cseq,) = s.ctl.read("<Q", 8)
    s.ctl.write("<Q", 8, cseq + 1)  # dies between the two counter writes of a publish
    q.put(s.receiver_handle())
    attached.wait(60)
    os._exit(0)  # no cleanup: the segments stay, the counter stays odd


def test_shm_reader_does_not_spin_on_an_odd_control_counter(shm_sender):
    """A sender that dies (or stalls) between the control counter's two writes: the reader's latest_version and
    fetch_into raise StageTimeoutError (at once for a dead sender pid, at their timeout for a live one)."""
    import multiprocessing as mp
    import time

    from mrl_plugins.errors import StageTimeoutError

    ctx = mp.get_context("spawn")
    q, attached = ctx.Queue(), ctx.Event()
    p = ctx.Process(target=_odd_ctl_child, args=(q, attached))
    p.start()
    h = q.get(timeout=60)
    rx = h.attach()
    try:
        attached.set()
        p.join(30)
        assert p.exitcode == 0
        t0 = time.monotonic()
        err, done = _bounded(rx.latest_version, 5)
        assert done and isinstance(err, StageTimeoutError) and f"pid {h.writer_pid} died" in str(err)
        err, done = _bounded(lambda: rx.fetch_into(1, {"a": torch.zeros(8)}, 1.0), 5)
        assert done and isinstance(err, StageTimeoutError) and f"pid {h.writer_pid} died" in str(err)
        assert time.monotonic() - t0 < 2  # the dead pid is seen at once, not at the 30 s timeout
    finally:
        rx.close()
        for path in (h.ctl_path, *h.slot_paths):
            if os.path.exists(path):  # another run's stale sweep may have taken them (dead owner pid)
                os.unlink(path)

    s = shm_sender(timeout_s=1)  # alive but stuck mid-update: the timeouts bound the wait
    s.publish(1, [("a", torch.ones(8))])
    rx = s.receiver_handle().attach()
    (cseq,) = s.ctl.read("<Q", 8)
    s.ctl.write("<Q", 8, cseq + 1)
    t0 = time.monotonic()
    err, done = _bounded(lambda: rx.fetch_into(1, {"a": torch.zeros(8)}, 0.5), 5)
    assert done and isinstance(err, StageTimeoutError) and "not announced within 0.5s" in str(err)
    err, done = _bounded(rx.latest_version, 5)
    assert done and isinstance(err, StageTimeoutError) and "within 1.0s" in str(err)
    assert time.monotonic() - t0 < 4
    s.ctl.write("<Q", 8, cseq + 2)
    assert rx.latest_version() == 1
    rx.close()


def test_directory_sender_removes_its_run_at_close_and_sweeps_dead_writers(tmp_path):
    """run_id is new on every pool start: a closed sender leaves no versions behind; a starting one removes what
    writers of this host that died left (temp entries, their runs), never a live writer's or another host's."""
    from mrl_plugins.weight_sync.directory import _host

    cfg = WeightSyncConfig(transport="directory", directory=str(tmp_path), chunk_bytes=4096)
    dead = 4194305  # above the default pid_max: no such process
    host = _host()
    old = tmp_path / "old" / "policy"  # a killed writer's run: a complete version and one cut short
    (old / "weight_v1").mkdir(parents=True)
    (old / "manifest.json").write_text(json.dumps({"version": 1, "writer_pid": dead, "writer_host": host}))
    live = tmp_path / "live" / "policy"  # a live writer's run with a version in progress
    (live / f".weight_v2.tmp-{host}-{os.getpid()}").mkdir(parents=True)
    (live / "manifest.json").write_text(json.dumps({"version": 1, "writer_pid": os.getpid(), "writer_host": host}))
    (live / f".weight_v3.tmp-{host}-{dead}").mkdir()  # a dead writer's temp folder and manifest in it
    (live / f"manifest.json.tmp-{host}-{dead}").write_text("{")
    (live / f".weight_v4.tmp-otherhost-{dead}").mkdir()  # pids of other hosts cannot be judged here
    other = tmp_path / "other" / "policy"  # a dead pid of another machine or container: not judged here
    other.mkdir(parents=True)
    (other / "manifest.json").write_text(json.dumps({"version": 1, "writer_pid": dead, "writer_host": "b00t.1"}))
    (tmp_path / "an_empty_cache").mkdir()  # not a run: left alone
    (tmp_path / "notes.txt").write_text("not a run")

    pol = DirectorySender(cfg, model_id="policy", run_id="r2")
    ref = DirectorySender(cfg, model_id="ref", run_id="r2")
    assert not (tmp_path / "old").exists()
    assert (other / "manifest.json").exists() and (tmp_path / "an_empty_cache").is_dir()
    assert (tmp_path / "notes.txt").read_text() == "not a run"
    assert sorted(p.name for p in live.iterdir()) == sorted(
        [f".weight_v2.tmp-{host}-{os.getpid()}", "manifest.json", f".weight_v4.tmp-otherhost-{dead}"]
    )
    for v in (1, 2, 3):
        pol.publish(v, [("w", torch.full((3000,), float(v)))])
        ref.publish(v, [("w", torch.full((3000,), float(v)))])
    rx = pol.receiver_handle().attach()
    dest = {"w": torch.zeros(3000)}
    rx.fetch_into(3, dest, 2)
    assert torch.all(dest["w"] == 3)
    pol.close()
    assert not (tmp_path / "r2" / "policy").exists() and (tmp_path / "r2" / "ref" / "weight_v3").exists()
    ref.close()
    ref.close()  # idempotent
    assert not (tmp_path / "r2").exists()
    with pytest.raises(WeightSyncError, match="closed"):
        pol.publish(4, [("w", torch.zeros(3000))])
