"""Shared-memory ring transport: N producer processes -> one consumer on the same host.

One segment (``mrl-comm-<run_id>-<owner>-<8 hex>``, see :mod:`mrl_plugins.shmem`), allocated and pre-faulted
once by the consumer, is reused for every frame. Each
producer owns a single-producer/single-consumer ring of ``ring_slots`` slots of ``slot_bytes``
bytes, so producers never contend and a killed producer cannot leave a lock held. Frames are
written straight into the slot (codec casts included) and read back as zero-copy views.

Segment layout::

    0      global block: magic, layout version, n_producers, ring_slots, slot_bytes,
           consumer pid, consumer heartbeat (monotonic s; 0 = not started yet), consumer-closed flag,
           +48 creation token (16 random bytes, also in every producer handle)
    4096   one 256-byte control block per producer:
           +0 head (frames published, producer-written), +8 pid, +16 heartbeat, +24 state
           (0 free, 1 attached, 2 closed), +128 tail (frames released, consumer-written)
    data   producer i, slot j at data + (i * ring_slots + j) * slot_bytes:
           +0 frame length (u64), +64 the frame (see :mod:`mrl_plugins.comm.frame`)

Liveness: both ends stamp a heartbeat every ``heartbeat_interval_s`` from a daemon thread; a
receive that finds a producer's heartbeat older than ``heartbeat_timeout_s`` (or its pid gone)
raises :class:`PeerDeadError` once that producer's published frames are drained; a producer waiting
for space does the same for the consumer. A heartbeat of 0 means "not started yet", not "dead": that
peer is given ``start_timeout_s`` (counted from when it was first seen) while its pid is alive.
Identity: the consumer writes a random creation token into the header and into every handle; a
producer attaching to a file at the handle's path that carries another token (the ring was replaced,
or the path reused) gets a :class:`PeerDeadError` saying so, instead of watching someone else's
heartbeat. A frame that fails its checksum is dropped, counted (``corrupt``) and reported as
:class:`FrameError`; the ring stays usable.

Ordering: a producer writes the frame, then its length, then bumps ``head``; the consumer bumps
``tail`` only after release. x86 keeps these stores in order. A CPU that may reorder them (Arm, e.g. the Kunpeng
hosts of Ascend NPUs; :data:`ORDERED_STORES` False) can show ``head`` before the frame's bytes, and Python has no
memory barrier to prevent it: there every frame carries its payload checksum, even with the top-level
``checksums: false`` (an INFO line at each producer's start says so), so a frame read too early fails it, is re-read
once after 1 ms, and is never returned torn.
"""

from __future__ import annotations

import logging
import os
import platform
import secrets
import select
import struct
import time
from collections.abc import Mapping
from typing import Any

from mrl_plugins.errors import MrlError, StageTimeoutError
from mrl_plugins.shmem import Segment, new_path, register, remove_stale
from mrl_plugins.shmem import unlink as unlink_path

from .base import ChannelClosedError, Heartbeat, PeerDeadError, Received, deadline_of, pid_alive
from .codec import make_codec
from .config import CommConfig
from .frame import FrameError, FramePlan, decode_frame

log = logging.getLogger("mrl_plugins.comm")

#: this CPU keeps a process's stores in program order for other processes (x86's total store order)
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")

_MAGIC = b"MRLR"
_LAYOUT = 2
# magic, layout, n_prod, slots, slot_bytes, cons pid, cons hb, closed, (pad), creation token
_GLOBAL = struct.Struct("<4sIIIQQdI4x16s")
_CB_BASE, _CB_SIZE = 4096, 256
_SLOT_HDR = 64
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
_U32 = struct.Struct("<I")
_FREE, _ATTACHED, _CLOSED = 0, 1, 2
_CONS_HB_OFF = 4 + 4 + 4 + 4 + 8 + 8
_CLOSED_OFF = _CONS_HB_OFF + 8
_NOT_STARTED = 0.0  # heartbeat value before the first beat


def _layout(n_producers: int, slots: int, slot_bytes: int) -> tuple[int, int]:
    data = (_CB_BASE + _CB_SIZE * n_producers + 4095) // 4096 * 4096
    return data, data + n_producers * slots * slot_bytes


def open_fifo(path: str) -> int:
    """Open an existing FIFO read-write and non-blocking (never blocks, never gets EPIPE)."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def kick(fd: int) -> None:
    """Wake whoever waits on the FIFO ``fd`` (a full FIFO is readable already, so EAGAIN is fine)."""
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, OSError):
        pass


def wait_fd(fd: int, timeout: float) -> None:
    """Block until the FIFO ``fd`` has bytes or ``timeout`` s passed, then drain it."""
    if timeout > 0:
        r, _, _ = select.select([fd], [], [], timeout)
        if not r:
            return
    try:
        os.read(fd, 65536)
    except (BlockingIOError, OSError):
        pass


class ShmConsumer:
    """The receiving end (trainer). Build with :func:`shm_factory`; hand :meth:`producer_handle` to workers."""

    def __init__(self, config: CommConfig, *, n_producers: int, run_id: str, codec: Any = None) -> None:
        if n_producers < 1:
            raise MrlError(f"n_producers must be >= 1, got {n_producers}")
        config.validate()
        self.config = config
        self.n = n_producers
        self.slots = config.ring_slots
        self.slot_bytes = config.slot_bytes
        remove_stale()
        self._data, size = _layout(n_producers, self.slots, self.slot_bytes)
        self.seg = Segment.create(new_path("comm", run_id), size)
        self.token = secrets.token_bytes(16)
        # heartbeat 0 ("not started"): the heartbeat thread below stamps the first beat
        _GLOBAL.pack_into(
            self.seg.buf, 0, _MAGIC, _LAYOUT, n_producers, self.slots, self.slot_bytes, os.getpid(),
            _NOT_STARTED, 0, self.token,
        )  # fmt: skip
        # wake-ups: producers write a byte to "<seg>.d" after publishing a frame; the consumer writes one
        # to "<seg>.s<i>" after releasing a slot of producer i. Waiters block in select() on them, so no
        # wake-up is lost and nobody burns a core polling.
        self._fifos = [self.seg.path + ".d"] + [f"{self.seg.path}.s{i}" for i in range(n_producers)]
        for f in self._fifos:  # owned by this process: registered for cleanup
            os.mkfifo(f, 0o600)
            register(f)
        fds = [open_fifo(f) for f in self._fifos]
        self._data_fd, self._space_fds = fds[0], fds[1:]
        self._read = [0] * n_producers  # next frame to read, per producer
        self._tail = [0] * n_producers  # frames released, per producer
        self._done: list[set[int]] = [set() for _ in range(n_producers)]
        self._reported: set[int] = set()
        self._dead_pid: dict[int, int] = {}  # producer slot -> pid reported dead (a new pid may re-attach)
        self._first_seen: dict[int, tuple[int, float]] = {}  # producer slot -> (pid, when seen without a beat)
        self._rr = 0
        self._next_check = 0.0
        self._stats = dict.fromkeys(
            ("frames", "bytes", "raw_bytes", "fallbacks", "corrupt", "wait_s", "dead_peers"), 0
        )
        # the producers' codec: tells their overflow fallbacks from the frames
        self._codec = codec if codec is not None else make_codec(config)
        self._hb = Heartbeat(self._beat, config.heartbeat_interval_s, "mrl-comm-consumer-hb")

    @property
    def path(self) -> str:
        """The segment file."""
        return self.seg.path

    def _beat(self) -> None:
        if self.seg.buf is not None:
            _F64.pack_into(self.seg.buf, _CONS_HB_OFF, time.monotonic())

    def producer_handle(self, i: int) -> ShmProducerHandle:
        """Picklable handle for producer ``i`` (0 <= i < n_producers)."""
        if not 0 <= i < self.n:
            raise MrlError(f"producer index {i} out of range 0..{self.n - 1}")
        return ShmProducerHandle(self.seg.path, i, self.config.to_dict(), self.token)

    def _cb(self, i: int) -> int:
        return _CB_BASE + _CB_SIZE * i

    def receive(self, timeout: float | None = None) -> Received:
        """Next frame from any producer (round robin); raises StageTimeoutError, PeerDeadError, FrameError."""
        if self.seg.buf is None:
            raise MrlError("receive on a closed shm consumer")
        t, deadline = deadline_of(timeout, self.config.receive_timeout_s)
        buf = self.seg.buf
        t0 = time.perf_counter()
        waited = 0
        while True:
            for k in range(self.n):
                i = (self._rr + k) % self.n
                if _U64.unpack_from(buf, self._cb(i))[0] > self._read[i]:
                    self._rr = i + 1
                    if waited:
                        self._stats["wait_s"] += time.perf_counter() - t0
                    return self._take(i)
            now = time.monotonic()
            if now >= self._next_check:
                self._next_check = now + min(0.05, self.config.heartbeat_interval_s)
                self._check_peers(now)
            if now >= deadline:
                self._stats["wait_s"] += time.perf_counter() - t0
                raise StageTimeoutError(
                    f"shm consumer: no frame within {t} s from {self.n} producer(s) (segment {self.seg.path})"
                )
            waited += 1
            if waited <= 2:
                time.sleep(0)
            else:
                wait_fd(self._data_fd, min(deadline - now, self._next_check - now + 1e-3))

    def _check_peers(self, now: float) -> None:
        buf = self.seg.buf
        closed = 0
        for i in range(self.n):
            cb = self._cb(i)
            state = _U32.unpack_from(buf, cb + 24)[0]
            if i in self._reported and state == _ATTACHED and _U64.unpack_from(buf, cb + 8)[0] != self._dead_pid[i]:
                self._reported.discard(i)  # a restarted worker re-attached to this slot
            if state == _CLOSED or i in self._reported:
                closed += 1
                continue
            if state != _ATTACHED:
                continue
            pid = _U64.unpack_from(buf, cb + 8)[0]
            hb = _F64.unpack_from(buf, cb + 16)[0]
            if hb == _NOT_STARTED:
                seen_pid, since = self._first_seen.setdefault(i, (pid, now))
                if seen_pid != pid:
                    self._first_seen[i] = (pid, now)
                    since = now
                why = _not_started(pid, now - since, self.config)
            else:
                self._first_seen.pop(i, None)
                why = _stale(pid, now - hb, self.config)
            if why:
                if _U64.unpack_from(buf, cb)[0] > self._read[i]:
                    continue  # deliver what it published first
                self._reported.add(i)
                self._dead_pid[i] = pid
                self._stats["dead_peers"] += 1
                raise PeerDeadError(f"shm producer {i} (pid {pid}) is dead: {why}")
        if closed == self.n and all(_U64.unpack_from(buf, self._cb(i))[0] <= self._read[i] for i in range(self.n)):
            raise ChannelClosedError(f"all {self.n} shm producers closed (or were reported dead) and were drained")

    def _take(self, i: int) -> Received:
        seq = self._read[i]
        self._read[i] = seq + 1
        base = self._data + (i * self.slots + seq % self.slots) * self.slot_bytes
        buf = self.seg.buf
        try:
            try:
                meta, batch, length = self._decode_slot(buf, base)
            except FrameError:
                # on weakly ordered CPUs the head may become visible before the frame bytes: look once more
                time.sleep(1e-3)
                meta, batch, length = self._decode_slot(buf, base)
        except FrameError as exc:
            self._stats["corrupt"] += 1
            self._release(i, seq)
            raise FrameError(f"shm producer {i}, frame #{seq} dropped: {exc}") from None
        self._stats["frames"] += 1
        self._stats["bytes"] += length
        self._stats["raw_bytes"] += sum(_nbytes(v) for v in batch.values())
        return Received(meta, batch, length, i, lambda: self._release(i, seq))

    def _decode_slot(self, buf: memoryview, base: int) -> tuple[dict, dict, int]:
        length = _U64.unpack_from(buf, base)[0]
        if length > self.slot_bytes - _SLOT_HDR:
            raise FrameError(f"frame length {length} exceeds the slot ({self.slot_bytes - _SLOT_HDR} bytes)")
        raw_floats: list[str] = []
        meta, batch = decode_frame(buf[base + _SLOT_HDR : base + _SLOT_HDR + length], raw_floats=raw_floats)
        self._stats["fallbacks"] += self._codec.fallbacks_among(raw_floats)
        return meta, batch, length

    def _release(self, i: int, seq: int) -> None:
        if self.seg.buf is None:
            return
        done = self._done[i]
        done.add(seq)
        tail = self._tail[i]
        while tail in done:
            done.discard(tail)
            tail += 1
        if tail != self._tail[i]:
            self._tail[i] = tail
            _U64.pack_into(self.seg.buf, self._cb(i) + 128, tail)
            kick(self._space_fds[i])

    def stats(self) -> dict[str, float]:
        """Counters: frames, bytes, raw_bytes, fallbacks (the producers' overflow-guard fallbacks, read from the
        frames), corrupt, wait_s, dead_peers, queue_depth."""
        out = dict(self._stats)
        depth = 0
        if self.seg.buf is not None:
            for i in range(self.n):
                depth += _U64.unpack_from(self.seg.buf, self._cb(i))[0] - self._read[i]
        out["queue_depth"] = depth
        return out

    def close(self, unlink: bool = True) -> None:
        """Stop heartbeating, flag producers, unmap and (by default) remove the segment."""
        if self.seg.buf is not None:
            self._hb.stop()
            _U32.pack_into(self.seg.buf, _CLOSED_OFF, 1)
            for fd in (self._data_fd, *self._space_fds):
                kick(fd)  # blocked producers notice the close now
                os.close(fd)
        if unlink:
            for f in self._fifos:
                unlink_path(f)
        self.seg.close(unlink_file=unlink)


def _nbytes(v: Any) -> int:
    return int(v.nbytes) if hasattr(v, "nbytes") else int(v.numel() * v.element_size())


class ShmProducerHandle:
    """Picklable reference to one producer slot of a consumer's ring (``token``: the ring's creation token)."""

    def __init__(self, path: str, index: int, config: dict[str, Any], token: bytes) -> None:
        self.path = path
        self.index = index
        self.config = config
        self.token = token

    def attach(self, codec: Any = None) -> ShmProducer:
        """Map the ring and claim this producer slot (``codec``: default the config's built-in one)."""
        return ShmProducer(self.path, self.index, CommConfig.from_dict(self.config), self.token, codec)

    def __repr__(self) -> str:
        return f"ShmProducerHandle({self.path!r}, {self.index})"


class ShmProducer:
    """The sending end (rollout worker)."""

    def __init__(self, path: str, index: int, config: CommConfig, token: bytes, codec: Any = None) -> None:
        try:
            self.seg = Segment.attach(path)
        except FileNotFoundError:
            raise PeerDeadError(f"shm ring {path} does not exist (consumer gone or closed)") from None
        if self.seg.size < _GLOBAL.size:
            self.seg.close()
            raise MrlError(f"{path} is not an mrl ring ({self.seg.size} bytes, smaller than its header)")
        magic, layout, n, slots, slot_bytes, cpid, _hb, _closed, found = _GLOBAL.unpack_from(self.seg.buf, 0)
        if magic != _MAGIC or layout != _LAYOUT or not 0 <= index < n:
            self.seg.close()
            raise MrlError(f"{path} is not an mrl ring of layout {_LAYOUT} with producer {index}")
        if found != token:
            self.seg.close()
            raise PeerDeadError(
                f"shm ring {path} is not the ring this handle was made for (creation token differs: the consumer "
                f"that made the handle is gone and pid {cpid} made this one)"
            )
        self.config = config
        self.index = index
        self.slots, self.slot_bytes, self.consumer_pid = slots, slot_bytes, cpid
        self.codec = codec if codec is not None else make_codec(config)
        self._checksum = config.checksum
        if not ORDERED_STORES and config.checksum == "none":  # see the module docstring: "Ordering"
            self._checksum = "xxh3"
            log.info(
                "shm ring producer %d: frames keep their xxh3 checksum on this %s CPU despite checksums: false (it "
                "may reorder stores, and the checksum is how a frame read too early is told from a whole one)",
                index,
                platform.machine(),
            )
        data, _ = _layout(n, slots, slot_bytes)
        self._slot0 = data + index * slots * slot_bytes
        self._cb = _CB_BASE + _CB_SIZE * index
        buf = self.seg.buf
        state = _U32.unpack_from(buf, self._cb + 24)[0]
        old = _U64.unpack_from(buf, self._cb + 8)[0]
        if state == _ATTACHED and old != os.getpid() and pid_alive(old):
            age = time.monotonic() - _F64.unpack_from(buf, self._cb + 16)[0]
            if age < config.heartbeat_timeout_s:
                self.seg.close()
                raise MrlError(f"producer slot {index} of {path} is already attached by live pid {old}")
        try:
            self._data_fd = open_fifo(path + ".d")
            self._space_fd = open_fifo(f"{path}.s{index}")
        except FileNotFoundError:
            self.seg.close()
            raise PeerDeadError(f"shm ring {path}: wake-up FIFOs are gone (consumer closed)") from None
        self._head = _U64.unpack_from(buf, self._cb)[0]
        self._attached_at = time.monotonic()
        _U64.pack_into(buf, self._cb + 8, os.getpid())
        _F64.pack_into(buf, self._cb + 16, time.monotonic())
        _U32.pack_into(buf, self._cb + 24, _ATTACHED)
        self._hb = Heartbeat(self._beat, config.heartbeat_interval_s, f"mrl-comm-producer{index}-hb")

    def _beat(self) -> None:
        if self.seg.buf is not None:
            _F64.pack_into(self.seg.buf, self._cb + 16, time.monotonic())

    def _consumer_gone(self) -> str | None:
        buf = self.seg.buf
        if _U32.unpack_from(buf, _CLOSED_OFF)[0]:
            return "the consumer closed the ring"
        now = time.monotonic()
        hb = _F64.unpack_from(buf, _CONS_HB_OFF)[0]
        if hb == _NOT_STARTED:
            why = _not_started(self.consumer_pid, now - self._attached_at, self.config)
        else:
            why = _stale(self.consumer_pid, now - hb, self.config)
        return f"consumer pid {self.consumer_pid} is dead: {why}" if why else None

    def send(self, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float | None = None) -> int:
        """Encode ``batch`` into the next slot; returns the frame bytes."""
        buf = self.seg.buf
        if buf is None:
            raise MrlError("send on a closed shm producer")
        if _U32.unpack_from(buf, _CLOSED_OFF)[0]:
            raise PeerDeadError(f"shm producer {self.index}: the consumer closed the ring")
        plan = FramePlan(batch, meta, self.codec, self._checksum)
        if plan.nbytes > self.slot_bytes - _SLOT_HDR:
            raise FrameError(
                f"frame of {plan.nbytes} bytes does not fit a ring slot of {self.slot_bytes - _SLOT_HDR} bytes: "
                f"raise comm.slot_bytes to at least {plan.nbytes + _SLOT_HDR}"
            )
        head = self._head
        if head - _U64.unpack_from(buf, self._cb + 128)[0] >= self.slots:
            self._wait_space(head, timeout)
        base = self._slot0 + (head % self.slots) * self.slot_bytes
        n = plan.write_into(buf[base + _SLOT_HDR : base + self.slot_bytes])
        _U64.pack_into(buf, base, n)
        self._head = head + 1
        _U64.pack_into(buf, self._cb, head + 1)
        kick(self._data_fd)
        return n

    def _wait_space(self, head: int, timeout: float | None) -> None:
        buf = self.seg.buf
        t, deadline = deadline_of(timeout, self.config.send_timeout_s)
        next_check = 0.0
        spins = 0
        while head - _U64.unpack_from(buf, self._cb + 128)[0] >= self.slots:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.05
                why = self._consumer_gone()
                if why:
                    raise PeerDeadError(f"shm producer {self.index}: {why}")
            if now >= deadline:
                raise StageTimeoutError(
                    f"shm producer {self.index}: ring full ({self.slots} slots) for {t} s; the consumer is not "
                    "keeping up"
                )
            spins += 1
            if spins <= 2:
                time.sleep(0)
            else:
                wait_fd(self._space_fd, min(deadline - now, next_check - now + 1e-3))

    def close(self) -> None:
        """Mark this producer closed (not dead) and unmap."""
        if self.seg.buf is None:
            return
        self._hb.stop()
        _U32.pack_into(self.seg.buf, self._cb + 24, _CLOSED)
        kick(self._data_fd)
        os.close(self._data_fd)
        os.close(self._space_fd)
        self.seg.close()


def _stale(pid: int, age: float, config: CommConfig) -> str | None:
    """Why a peer that has beaten counts as dead (``None``: alive)."""
    if not pid_alive(pid):
        return f"last heartbeat {age:.2f} s ago, its process is gone"
    if age > config.heartbeat_timeout_s:
        bound = config.heartbeat_timeout_s
        return f"last heartbeat {age:.2f} s ago (heartbeat timeout {bound:g} s: min(timeout_s, 5 s) on one host)"
    return None


def _not_started(pid: int, waited: float, config: CommConfig) -> str | None:
    """Why a peer that has not beaten yet (heartbeat 0) counts as dead (``None``: still starting)."""
    if not pid_alive(pid):
        return "its process is gone (it never started heartbeating)"
    if waited > config.start_timeout_s:
        grace = config.start_timeout_s
        return f"no heartbeat yet, {waited:.2f} s after it was first seen (a peer counts as starting for {grace:g} s)"
    return None


def shm_factory(config: CommConfig, *, n_producers: int, run_id: str, codec: Any = None) -> ShmConsumer:
    """Transport factory registered as ``shm``."""
    return ShmConsumer(config, n_producers=n_producers, run_id=run_id, codec=codec)
