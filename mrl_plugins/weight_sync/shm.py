"""Shared-memory weight transport: written once by the trainer, mapped by N readers on one host.

Segments (files under ``/dev/shm``, named ``mrlws-<pid>-<run_id>-<model_id>-<kind>``):

* ``ctl`` (4 KiB): magic, a seqlock counter, ``latest version + 1`` (0 = none), the slot holding it
  and the writer's pid;
* ``s0`` / ``s1``: two slots (double buffering), each a 4 KiB slot header (magic, seqlock counter,
  ``version + 1``, bytes used, shard count, index offset/length, uuid) followed by the version's
  shards (valid safetensors blobs, 64-byte aligned, see :mod:`.shards`) and a JSON index of
  ``[offset, length]`` per shard.

A publish writes into the slot that does *not* hold the latest version, so readers of the latest
version are never overwritten; a reader holds a shared ``flock`` on the slot while copying and the
writer takes the exclusive lock before writing (with the configured timeout), so even a reader that
is two versions behind is never torn. Slots are reused across versions (grown, never re-allocated,
when the model gets bigger): fresh pages cost a page fault each (1.2-2 GB/s), reused pages run at
memcpy speed.

No ``multiprocessing.shared_memory`` (its resource tracker warns and unlinks in readers). The sender
unlinks its segments on ``close()``, at exit and on SIGTERM/SIGINT; segments left by dead pids are
removed when a sender starts.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import mmap
import os
import re
import signal
import struct
import tempfile
import threading
import time
import uuid as uuidlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs import PublishReport

from .config import WeightSyncConfig
from .shards import Dest, ShardWriter, WeightSyncError, align, read_shards

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "mrlws"
CTL_MAGIC = b"MRLWCTL1"
SLOT_MAGIC = b"MRLWSLT1"
SLOT_HDR = 4096
_SLOT_FMT = "<8sQQQQQQ32s"  # magic, seq, version+1, used, shard_count, index_off, index_len, uuid
_MIN_SLOT = 1 << 20


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.]", "_", str(s))[:48]


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists and is not a zombie."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def remove_stale_segments(directory: str = SHM_DIR) -> list[str]:
    """Unlink ``mrlws-<pid>-...`` segments whose creating pid is dead; return the removed paths."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for n in names:
        m = re.match(rf"{PREFIX}-(\d+)-", n)
        if m and not pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(directory, n))
                removed.append(os.path.join(directory, n))
            except OSError:
                pass
    return removed


def _flock(fd: int, exclusive: bool, deadline: float, what: str) -> None:
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
    delay = 0.0002
    while True:
        try:
            fcntl.flock(fd, op)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise StageTimeoutError(f"timed out waiting for the lock on {what}") from None
            time.sleep(delay)
            delay = min(delay * 2, 0.005)


class _Segment:
    """One mapped file; ``grow`` extends the file and maps it again (old mappings kept until close)."""

    def __init__(self, path: str, create: bool, size: int = 0) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        self.fd = os.open(path, flags, 0o600)
        if create:
            os.ftruncate(self.fd, size)
        self._old: list[mmap.mmap] = []
        self._map(os.fstat(self.fd).st_size)

    def _map(self, size: int) -> None:
        self.size = size
        self.mm = mmap.mmap(self.fd, size)
        self.buf = torch.frombuffer(self.mm, dtype=torch.uint8)

    def grow(self, size: int) -> None:
        os.ftruncate(self.fd, size)
        self.refresh()

    def refresh(self) -> None:
        """Map again if the file grew (another process extended it)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._old.append(self.mm)
            self.buf = None
            self._map(size)

    def read(self, fmt: str, off: int = 0) -> tuple:
        return struct.unpack_from(fmt, self.mm, off)

    def write(self, fmt: str, off: int, *vals: Any) -> None:
        struct.pack_into(fmt, self.mm, off, *vals)

    def close(self, unlink: bool) -> None:
        self.buf = None
        for mm in [*self._old, self.mm]:
            try:
                mm.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it is freed
                pass
        self._old = []
        try:
            os.close(self.fd)
        except OSError:
            pass
        if unlink:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# ------------------------------------------------------------------ cleanup on exit and signals

_LIVE: weakref.WeakSet = weakref.WeakSet()
_HANDLERS_LOCK = threading.Lock()
_HANDLERS_INSTALLED = False


def _close_all() -> None:
    for s in list(_LIVE):
        try:
            s.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass


def _on_signal(sig: int, frame: Any) -> None:
    _close_all()
    prev = _PREV_HANDLERS.get(sig)
    if callable(prev):
        prev(sig, frame)
    elif prev == signal.SIG_DFL or prev is None:
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)


_PREV_HANDLERS: dict[int, Any] = {}


def _install_cleanup() -> None:
    global _HANDLERS_INSTALLED
    with _HANDLERS_LOCK:
        if _HANDLERS_INSTALLED:
            return
        atexit.register(_close_all)
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                prev = signal.getsignal(sig)
                if prev is signal.SIG_IGN:
                    continue
                _PREV_HANDLERS[sig] = prev
                signal.signal(sig, _on_signal)
        _HANDLERS_INSTALLED = True


# ------------------------------------------------------------------ sender


class _SlotSink:
    """Bump allocator of shard space inside a slot (grows the segment when needed)."""

    def __init__(self, seg: _Segment) -> None:
        self.seg, self.pos, self.blobs = seg, SLOT_HDR, []

    def ensure(self, end: int) -> None:
        if end > self.seg.size:
            self.seg.grow(max(self.seg.size * 2, align(end + _MIN_SLOT, 4096)))

    def reserve(self, n: int) -> tuple[int, torch.Tensor]:
        off = align(self.pos)
        self.ensure(off + n)
        self.pos = off + n
        self.blobs.append((off, n))
        return off, self.seg.buf[off : off + n]

    def write_header(self, off: int, hb: bytes) -> None:
        self.seg.mm[off : off + len(hb)] = hb


class ShmSender:
    """Publish versions of one model into double-buffered shared-memory slots.

    ``factory(config, *, model_id, run_id, size_hint=None)``; ``size_hint`` (bytes) pre-sizes the
    slots so that the first publish does not grow them.
    """

    def __init__(
        self,
        config: WeightSyncConfig,
        *,
        model_id: str = "policy",
        run_id: str = "run",
        size_hint: int | None = None,
        **_: Any,
    ) -> None:
        self.config, self.model_id, self.run_id = config, model_id, run_id
        self.chunk_bytes = config.chunk_for("shm")
        remove_stale_segments()
        base = os.path.join(SHM_DIR, f"{PREFIX}-{os.getpid()}-{_safe(run_id)}-{_safe(model_id)}")
        self._closed = False
        self._segs: list[_Segment] = []
        try:
            self.ctl = _Segment(base + "-ctl", create=True, size=4096)
            self._segs.append(self.ctl)
            size = align(SLOT_HDR + max(int(size_hint or 0) * 9 // 8, _MIN_SLOT), 4096)
            self.slots = []
            for i in range(2):
                seg = _Segment(f"{base}-s{i}", create=True, size=size)
                self._segs.append(seg)
                seg.write(_SLOT_FMT, 0, SLOT_MAGIC, 0, 0, 0, 0, 0, 0, b"0" * 32)
                self.slots.append(seg)
        except FileExistsError:
            self.close()
            raise WeightSyncError(
                f"a shm sender for run_id={run_id!r} model_id={model_id!r} already exists in this process"
            ) from None
        except BaseException:
            self.close()
            raise
        self.ctl.write("<8sQQQQ", 0, CTL_MAGIC, 0, 0, 0, os.getpid())
        self._latest: int | None = None
        self._latest_slot = 1
        _LIVE.add(self)
        _install_cleanup()

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Write ``version`` into the free slot, then make it the latest. Streams: one chunk held at most."""
        if self._closed:
            raise WeightSyncError("shm sender is closed")
        if self._latest is not None and version <= self._latest:
            raise WeightSyncError(
                f"model_id={self.model_id}: version {version} is not newer than the published {self._latest}"
            )
        t0 = time.perf_counter()
        si = 1 - self._latest_slot
        seg = self.slots[si]
        _flock(seg.fd, True, time.monotonic() + self.config.timeout_s, f"shm slot {seg.path} (a reader holds it)")
        try:
            (seq,) = seg.read("<Q", 8)
            seg.write("<QQ", 8, seq + 1, 0)  # odd: being written; version 0: invalid
            sink = _SlotSink(seg)
            uid = uuidlib.uuid4().hex
            writer = ShardWriter(
                sink,
                model_id=self.model_id,
                version=version,
                uuid=uid,
                chunk_bytes=self.chunk_bytes,
                checksums=self.config.verify_checksum,
            )
            for name, t in named_tensors:
                writer.add(name, t)
            count = writer.finish()
            index = json.dumps(sink.blobs).encode()
            ioff = align(sink.pos)
            sink.ensure(ioff + len(index))
            seg.mm[ioff : ioff + len(index)] = index
            seg.write(
                _SLOT_FMT,
                0,
                SLOT_MAGIC,
                seq + 2,
                version + 1,
                ioff + len(index),
                count,
                ioff,
                len(index),
                uid.encode(),
            )
        except BaseException:
            seg.write("<QQ", 8, seq + 2, 0)
            raise
        finally:
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
        (cseq,) = self.ctl.read("<Q", 8)
        self.ctl.write("<Q", 8, cseq + 1)
        self.ctl.write("<QQ", 16, version + 1, si)
        self.ctl.write("<Q", 8, cseq + 2)
        self._latest, self._latest_slot = version, si
        return PublishReport(self.model_id, version, writer.nbytes, time.perf_counter() - t0, count)

    def receiver_handle(self) -> ShmHandle:
        return ShmHandle(
            ctl_path=self.ctl.path,
            slot_paths=tuple(s.path for s in self.slots),
            model_id=self.model_id,
            writer_pid=os.getpid(),
            timeout_s=float(self.config.timeout_s),
            verify=self.config.verify_checksum,
            max_retries=self.config.max_retries,
        )

    def close(self) -> None:
        """Unmap and unlink every segment (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for s in self._segs:
            s.close(unlink=True)
        self._segs = []
        _LIVE.discard(self)


@dataclass(frozen=True)
class ShmHandle:
    """Picklable address of a shm sender's segments."""

    ctl_path: str
    slot_paths: tuple[str, ...]
    model_id: str
    writer_pid: int
    timeout_s: float
    verify: bool = True
    max_retries: int = 2

    def attach(self) -> ShmReceiver:
        return ShmReceiver(self)


class ShmReceiver:
    """Reader side of :class:`ShmSender`: cheap version poll, verified copy into a destination."""

    def __init__(self, handle: ShmHandle) -> None:
        self.h = handle
        try:
            self.ctl = _Segment(handle.ctl_path, create=False)
            self.slots = [_Segment(p, create=False) for p in handle.slot_paths]
        except FileNotFoundError:
            raise WeightSyncError(f"shm segments of model_id={handle.model_id} are gone (sender closed?)") from None
        if self.ctl.read("<8s")[0] != CTL_MAGIC:
            raise WeightSyncError(f"{handle.ctl_path} is not a weight-sync control segment")

    def _ctl(self) -> tuple[int | None, int]:
        while True:
            s1, v1, slot = self.ctl.read("<QQQ", 8)
            (s2,) = self.ctl.read("<Q", 8)
            if s1 == s2 and s1 % 2 == 0:
                return (v1 - 1 if v1 else None), slot
            time.sleep(0)

    def latest_version(self) -> int | None:
        """Newest complete version (a few struct reads; no lock)."""
        return self._ctl()[0]

    def fetch_into(self, version: int, dest: Dest, timeout: float | None = None) -> int:
        """Copy ``version`` into ``dest``; wait up to ``timeout`` s for it to appear. Returns tensor bytes."""
        timeout = self.h.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        attempts, delay = 0, 0.0005
        while True:
            latest, _ = self._ctl()
            if latest is None or latest < version:
                if not pid_alive(self.h.writer_pid):
                    raise StageTimeoutError(
                        f"model_id={self.h.model_id}: shm sender pid {self.h.writer_pid} died before publishing "
                        f"version {version} (latest {latest})"
                    )
                if time.monotonic() > deadline:
                    raise StageTimeoutError(
                        f"model_id={self.h.model_id}: version {version} not published within {timeout:.1f}s "
                        f"(latest {latest})"
                    )
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
                continue
            seg = next((s for s in self.slots if s.read("<Q", 16)[0] == version + 1), None)
            if seg is None:
                raise WeightSyncError(
                    f"model_id={self.h.model_id}: version {version} is no longer in shared memory (latest {latest})"
                )
            _flock(seg.fd, False, deadline, f"shm slot {seg.path}")
            try:
                magic, seq, v1, used, count, ioff, ilen, uid = seg.read(_SLOT_FMT)
                if magic != SLOT_MAGIC or seq % 2 or v1 != version + 1:
                    continue  # overwritten between the check and the lock: look again
                seg.refresh()
                if used > seg.size:
                    raise WeightSyncError(f"{seg.path}: slot claims {used} bytes, segment has {seg.size}")
                try:
                    blobs = json.loads(bytes(seg.mm[ioff : ioff + ilen]))
                except ValueError as exc:
                    raise WeightSyncError(f"{seg.path}: unreadable shard index ({exc})") from None
                if len(blobs) != count:
                    raise WeightSyncError(f"{seg.path}: index lists {len(blobs)} shards, header says {count}")
                buf = seg.buf
                return read_shards(
                    (buf[o : o + n] for o, n in blobs),
                    dest,
                    model_id=self.h.model_id,
                    version=version,
                    count=count,
                    uuid=uid.decode(),
                    verify=self.h.verify,
                )
            except WeightSyncError:
                attempts += 1
                if attempts > self.h.max_retries:
                    raise
            finally:
                fcntl.flock(seg.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        for s in [self.ctl, *self.slots]:
            s.close(unlink=False)


__all__ = ["ShmHandle", "ShmReceiver", "ShmSender", "pid_alive", "remove_stale_segments"]
