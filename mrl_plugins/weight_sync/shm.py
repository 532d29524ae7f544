"""Shared-memory weight transport: written once by the trainer, mapped by N readers on one host.

Segments (files under ``/dev/shm``, named ``mrl-weights-<run_id>-<owner>-<8 hex>.<model_id>.<kind>``, see
:mod:`mrl_plugins.shmem` for the naming, the stale sweep and the cleanup shared with the comm stage):

* ``ctl`` (4 KiB): magic, a seqlock counter, ``latest version + 1`` (0 = none), the slot holding it
  and the writer's pid;
* ``s0`` / ``s1``: two slots (double buffering), each a 1 MiB slot header (magic, seqlock counter,
  ``version + 1``, bytes used, shard count, uuid, and a table of ``(offset, length)`` per shard; its pages are
  allocated with the slot) followed by the version's shards (valid safetensors blobs, 64-byte aligned, see
  :mod:`.shards`).

A reader reads a version once it is complete (the latest). A publish writes into the slot that does *not* hold
the latest version, so readers of the latest version are never overwritten; a reader holds a shared ``flock`` on
the slot while copying and the writer takes the exclusive lock before writing (with the configured timeout), so
even a reader that is two versions behind is never torn. Slots are reused across versions (grown, never
re-allocated, when the model gets bigger): fresh pages cost a page fault each (1.2-2 GB/s), reused pages run at
memcpy speed.

The sender unlinks its segments on ``close()``, at exit and on SIGTERM/SIGINT (:mod:`mrl_plugins.shmem`'s
cleanup registry); segments left by dead pids (of either stage) are removed when a sender starts.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import time
import uuid as uuidlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mrl_plugins._proc import pid_alive, wait_until
from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs import PublishReport
from mrl_plugins.shmem import Segment, new_path, remove_stale, safe_role

from .config import WeightSyncConfig
from .shards import Dest, ShardWriter, VersionGoneError, WeightSyncError, align, check_newer, read_shards

STAGE = "weights"
CTL_MAGIC = b"MRLWCTL1"
SLOT_MAGIC = b"MRLWSLT1"
SLOT_HDR = 1 << 20  # slot header + shard table
_SLOT_FMT = "<8sQQQQ32s"  # magic, seq, version+1, used, shard_count, uuid
_UUID_OFF = 40
TABLE_OFF = 128  # (offset, length) u64 pairs, one per shard
TABLE_CAP = (SLOT_HDR - TABLE_OFF) // 16
_MIN_SLOT = 1 << 20


def _flock(fd: int, exclusive: bool, deadline: float, what: str) -> None:
    op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB

    def locked() -> bool | None:
        try:
            fcntl.flock(fd, op)
            return True
        except BlockingIOError:
            return None

    wait_until(locked, deadline, f"timed out waiting for the lock on {what}", sleep=0.0002, max_sleep=0.001)


# ------------------------------------------------------------------ sender


class _SlotSink:
    """Bump allocator of shard space inside a slot (grows the segment when needed).

    A shard's first header write (after its data) enters its ``(offset, length)`` in the slot's shard table.
    """

    def __init__(self, seg: Segment) -> None:
        self.seg, self.pos, self.done = seg, SLOT_HDR, 0
        self._announced: set[int] = set()

    def reserve(self, n: int) -> tuple[tuple[int, int], torch.Tensor]:
        if self.done >= TABLE_CAP:
            raise WeightSyncError(f"more than {TABLE_CAP} shards in one version: raise weight_sync.chunk_bytes")
        off = align(self.pos)
        if off + n > self.seg.size:  # capacity doubles; only the bytes written are allocated
            self.seg.grow(max(self.seg.size * 2, align(off + n + _MIN_SLOT, 4096)))
        self.seg.allocate(off + n)
        self.pos = off + n
        return (off, n), self.seg.tensor[off : off + n]

    def write_header(self, handle: tuple[int, int], hb: bytes) -> None:
        off, n = handle
        self.seg.mm[off : off + len(hb)] = hb
        if off not in self._announced:
            self._announced.add(off)
            self.seg.write("<QQ", TABLE_OFF + 16 * self.done, off, n)
            self.done += 1


class ShmSender:
    """Publish versions of one model into double-buffered shared-memory slots (grown by the publish that needs
    more room)."""

    def __init__(
        self,
        config: WeightSyncConfig,
        *,
        model_id: str = "policy",
        run_id: str = "run",
        **_: Any,
    ) -> None:
        self.config, self.model_id, self.run_id = config, model_id, run_id
        self.chunk_bytes = config.chunk_for("shm")
        remove_stale()
        # one sender per (run_id, model_id) in a process: the fixed tag makes a second one collide (O_EXCL)
        tag = hashlib.sha1(f"{run_id}\0{model_id}".encode()).hexdigest()[:8]
        base = new_path(STAGE, run_id, safe_role(model_id), tag=tag)
        self._closed = False
        self._segs: list[Segment] = []
        try:
            self.ctl = Segment.create(base + ".ctl", 4096, prefault=False)
            self._segs.append(self.ctl)
            size = align(SLOT_HDR + _MIN_SLOT, 4096)
            self.slots = []
            for i in range(2):
                seg = Segment.create(f"{base}.s{i}", size, prefault=False)
                self._segs.append(seg)
                seg.write(_SLOT_FMT, 0, SLOT_MAGIC, 0, 0, 0, 0, b"0" * 32)
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

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Write ``version`` into the free slot, then make it the latest. Streams: one chunk held at most."""
        if self._closed:
            raise WeightSyncError("shm sender is closed")
        check_newer(self.model_id, version, self._latest)
        t0 = time.perf_counter()
        si = 1 - self._latest_slot
        seg = self.slots[si]
        uid = uuidlib.uuid4().hex
        # wait until readers of what this slot held are gone, mark it as being written
        _flock(seg.fd, True, time.monotonic() + self.config.timeout_s, f"shm slot {seg.path} (a reader holds it)")
        try:
            (seq,) = seg.read("<Q", 8)
            seg.write("<QQ", 8, seq + 1, 0)  # odd: being written; version 0: no complete version here
            seg.write("<32s", _UUID_OFF, uid.encode())
        finally:
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
        try:
            sink = _SlotSink(seg)
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
            count = writer.finish()  # patches shard counts only; data and checksums stay
            seg.write("<QQQ", 16, version + 1, sink.pos, count)
            seg.write("<Q", 8, seq + 2)  # even: complete
        except BaseException:
            seg.write("<QQ", 8, seq + 2, 0)  # even, no version: the slot holds nothing
            raise
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
            s.close(unlink_file=True)
        self._segs = []


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
            self.ctl = Segment.attach(handle.ctl_path, populate=False)
            self.slots = [Segment.attach(p, populate=False) for p in handle.slot_paths]
        except FileNotFoundError:
            raise WeightSyncError(f"shm segments of model_id={handle.model_id} are gone (sender closed?)") from None
        if self.ctl.read("<8s")[0] != CTL_MAGIC:
            raise WeightSyncError(f"{handle.ctl_path} is not a weight-sync control segment")

    def _ctl(self, deadline: float | None = None, timeout: float | None = None) -> tuple[int | None, int]:
        """``(latest version, its slot)`` from the control seqlock. The sender holds it odd for two struct writes;
        one that stays odd (a sender dead between them) raises StageTimeoutError: at once when the sender's pid
        is gone, at ``deadline`` (default: the handle's timeout) otherwise."""
        spins = 0
        while True:
            s1, v1, slot = self.ctl.read("<QQQ", 8)
            (s2,) = self.ctl.read("<Q", 8)
            if s1 == s2 and s1 % 2 == 0:
                return (v1 - 1 if v1 else None), slot
            spins += 1
            if spins == 1:
                timeout = self.h.timeout_s if timeout is None else timeout
                deadline = time.monotonic() + timeout if deadline is None else deadline
            elif spins % 64 == 0:
                self._sender_alive("while announcing", "the latest version", "(control counter odd)")
                if time.monotonic() > deadline:
                    raise StageTimeoutError(
                        f"model_id={self.h.model_id}: the latest version not announced within {timeout:.1f}s "
                        "(control counter odd)"
                    )
            time.sleep(0 if spins < 64 else 0.001)  # a sender held up between two writes: stop burning a core

    def latest_version(self) -> int | None:
        """Newest complete version (a few struct reads; no lock; StageTimeoutError when its sender died mid-update)."""
        return self._ctl()[0]

    def fetch_into(self, version: int, dest: Dest, timeout: float | None = None) -> int:
        """Copy ``version`` into ``dest``; returns tensor bytes.

        Waits up to ``timeout`` s for the version to be published. A writer that dies gives
        :class:`StageTimeoutError` at once; a checksum error is retried ``max_retries`` times.
        """
        timeout = self.h.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        seen: list[int | None] = [None]

        def published() -> int | None:
            seen[0] = self._ctl(deadline, timeout)[0]
            return seen[0] if seen[0] is not None and seen[0] >= version else None

        attempts = 0
        while True:
            latest = wait_until(
                published,
                deadline,
                lambda: (
                    f"model_id={self.h.model_id}: version {version} not published within {timeout:.1f}s "
                    f"(latest {seen[0]})"
                ),
                check=lambda: self._sender_alive("before publishing", f"version {version}", f"(latest {seen[0]})"),
                sleep=0.0005,
                max_sleep=0.002,
            )
            seg = next((x for x in self.slots if x.read("<Q", 16)[0] == version + 1), None)
            if seg is None:
                raise VersionGoneError(
                    f"model_id={self.h.model_id}: version {version} is no longer in shared memory (latest {latest})"
                )
            _flock(seg.fd, False, deadline, f"shm slot {seg.path}")
            try:
                n = self._read_slot(seg, version, dest)
                if n is not None:
                    return n
            except WeightSyncError:
                attempts += 1
                if attempts > self.h.max_retries:
                    raise
            finally:
                fcntl.flock(seg.fd, fcntl.LOCK_UN)

    def _sender_alive(self, died: str, what: str, detail: str) -> None:
        """Raise StageTimeoutError when the sender's pid is gone (a wait on it would only end at its deadline)."""
        if not pid_alive(self.h.writer_pid):
            raise StageTimeoutError(
                f"model_id={self.h.model_id}: shm sender pid {self.h.writer_pid} died {died} {what} {detail}"
            )

    def _read_slot(self, seg: Segment, version: int, dest: Dest) -> int | None:
        """Verify and copy the shards of the complete ``version`` from ``seg`` (shared lock held); ``None`` if the
        slot moved on."""
        seq, v1, _used, count = seg.read("<QQQQ", 8)
        if not (seq % 2 == 0 and v1 == version + 1):
            return None

        def blobs() -> Iterator[torch.Tensor]:  # the slot's shard table
            for i in range(count):
                off, n = seg.read("<QQ", TABLE_OFF + 16 * i)
                if off + n > seg.size:
                    seg.refresh()
                yield seg.tensor[off : off + n]

        uid = seg.read("<32s", _UUID_OFF)[0].decode()
        return read_shards(blobs(), dest, model_id=self.h.model_id, version=version, count=count, uuid=uid,
                           verify=self.h.verify)  # fmt: skip

    def close(self) -> None:
        for s in [self.ctl, *self.slots]:
            s.close(unlink_file=False)


__all__ = ["ShmHandle", "ShmReceiver", "ShmSender"]
