"""Control channel: fixed-length binary messages on their own small shared-memory segment.

Control traffic (pause, resume, stop, new weight version, heartbeat) never waits behind bulk
experience frames: it has its own segment with one pair of single-producer/single-consumer rings
per peer (hub -> peer "down", peer -> hub "up"), each holding ``capacity`` messages of 48 bytes::

    <B 3x I Q q q Q d>  kind, sender (peer index, 0xFFFFFFFF = hub), model hash (blake2b-64 of
                        model_id), version, value (free int), seq, send time (monotonic s)

The hub (trainer side) owns and unlinks the segment; peers attach through picklable handles.
"""

from __future__ import annotations

import enum
import hashlib
import os
import struct
import time
from dataclasses import dataclass

from mrl_plugins.errors import MrlError, StageTimeoutError

from .base import Backoff, deadline_of
from .segment import Segment, new_path, remove_stale

_MSG = struct.Struct("<B3xIQqqQd")
_U64 = struct.Struct("<Q")
_HDR = struct.Struct("<4sII")  # magic, n_peers, capacity
_MAGIC = b"MRLC"
HUB = 0xFFFFFFFF


class ControlKind(enum.IntEnum):
    """Control message kinds."""

    PAUSE = 1
    RESUME = 2
    STOP = 3
    NEW_VERSION = 4
    HEARTBEAT = 5


def model_hash(model_id: str) -> int:
    """64-bit hash of a model id as carried in control messages."""
    return int.from_bytes(hashlib.blake2b(model_id.encode("utf-8"), digest_size=8).digest(), "little")


@dataclass(frozen=True)
class ControlMessage:
    """One decoded control message."""

    kind: ControlKind
    sender: int
    model_hash: int = 0
    version: int = 0
    value: int = 0
    seq: int = 0
    sent_at: float = 0.0


class _Ring:
    """SPSC ring of fixed-size messages at ``base`` in ``buf``: head @0, tail @64, slots @128."""

    def __init__(self, buf: memoryview, base: int, capacity: int) -> None:
        self.buf, self.base, self.cap = buf, base, capacity

    @staticmethod
    def size(capacity: int) -> int:
        return 128 + capacity * _MSG.size

    def push(self, data: tuple, timeout: float, what: str) -> None:
        head = _U64.unpack_from(self.buf, self.base)[0]
        deadline = deadline_of(timeout, timeout)
        backoff = Backoff()
        while head - _U64.unpack_from(self.buf, self.base + 64)[0] >= self.cap:
            if time.monotonic() >= deadline:
                raise StageTimeoutError(f"control channel {what}: {self.cap} messages unread for {timeout} s")
            backoff.wait()
        _MSG.pack_into(self.buf, self.base + 128 + (head % self.cap) * _MSG.size, *data)
        _U64.pack_into(self.buf, self.base, head + 1)

    def pop(self) -> ControlMessage | None:
        tail = _U64.unpack_from(self.buf, self.base + 64)[0]
        if _U64.unpack_from(self.buf, self.base)[0] <= tail:
            return None
        kind, sender, mh, ver, val, seq, t = _MSG.unpack_from(
            self.buf, self.base + 128 + (tail % self.cap) * _MSG.size
        )
        _U64.pack_into(self.buf, self.base + 64, tail + 1)
        try:
            k = ControlKind(kind)
        except ValueError:
            raise MrlError(f"control channel: unknown message kind {kind} (corrupted segment?)") from None
        return ControlMessage(k, sender, mh, ver, val, seq, t)


def _pack(kind: ControlKind, sender: int, model_id: str | None, version: int, value: int, seq: int) -> tuple:
    return (
        int(ControlKind(kind)),
        sender,
        model_hash(model_id) if model_id else 0,
        version,
        value,
        seq,
        time.monotonic(),
    )


class _Endpoint:
    def __init__(self, seg: Segment, n: int, cap: int) -> None:
        self.seg, self.n, self.cap = seg, n, cap
        rs = _Ring.size(cap)
        self._down = [_Ring(seg.buf, 64 + 2 * i * rs, cap) for i in range(n)]
        self._up = [_Ring(seg.buf, 64 + (2 * i + 1) * rs, cap) for i in range(n)]
        self._seq = 0

    def _poll_rings(self, rings: list[_Ring], timeout: float) -> ControlMessage | None:
        if self.seg.buf is None:
            raise MrlError("control channel is closed")
        deadline = time.monotonic() + timeout
        backoff = Backoff()
        while True:
            for r in rings:
                m = r.pop()
                if m is not None:
                    return m
            if time.monotonic() >= deadline:
                return None
            backoff.wait()


class ControlHub(_Endpoint):
    """Trainer side of the control channel: talks to ``n_peers`` peers (rollout workers).

    :param n_peers: number of peers.
    :param run_id: used in the segment name (stale segments of dead runs are removed first).
    :param capacity: messages each direction can hold unread.
    """

    def __init__(self, n_peers: int, run_id: str, capacity: int = 256) -> None:
        if n_peers < 1 or capacity < 1:
            raise MrlError(f"control channel: n_peers and capacity must be >= 1, got {n_peers}, {capacity}")
        remove_stale()
        seg = Segment.create(new_path(run_id, "ctl"), 64 + 2 * n_peers * _Ring.size(capacity))
        _HDR.pack_into(seg.buf, 0, _MAGIC, n_peers, capacity)
        super().__init__(seg, n_peers, capacity)

    def handle(self, i: int) -> ControlHandle:
        """Picklable handle for peer ``i``."""
        if not 0 <= i < self.n:
            raise MrlError(f"control peer index {i} out of range 0..{self.n - 1}")
        return ControlHandle(self.seg.path, i)

    def send(self, i: int, kind: ControlKind, *, model_id: str | None = None, version: int = 0, value: int = 0,
             timeout: float = 5.0) -> None:  # fmt: skip
        """Send one message to peer ``i`` (waits up to ``timeout`` if it has ``capacity`` unread)."""
        self._seq += 1
        self._down[i].push(_pack(kind, HUB, model_id, version, value, self._seq), timeout, f"to peer {i}")

    def broadcast(self, kind: ControlKind, *, model_id: str | None = None, version: int = 0, value: int = 0,
                  timeout: float = 5.0) -> None:  # fmt: skip
        """Send one message to every peer."""
        for i in range(self.n):
            self.send(i, kind, model_id=model_id, version=version, value=value, timeout=timeout)

    def poll(self, timeout: float = 0.0) -> ControlMessage | None:
        """Next message from any peer, or ``None`` after ``timeout`` seconds."""
        return self._poll_rings(self._up, timeout)

    def close(self, unlink: bool = True) -> None:
        """Unmap and (by default) remove the segment."""
        self.seg.close(unlink_file=unlink)


class ControlHandle:
    """Picklable reference to peer ``index`` of a :class:`ControlHub`."""

    def __init__(self, path: str, index: int) -> None:
        self.path, self.index = path, index

    def attach(self) -> ControlPeer:
        """Map the control segment."""
        return ControlPeer(self.path, self.index)


class ControlPeer(_Endpoint):
    """Rollout-worker side of the control channel."""

    def __init__(self, path: str, index: int) -> None:
        seg = Segment.attach(path)
        magic, n, cap = _HDR.unpack_from(seg.buf, 0)
        if magic != _MAGIC or not 0 <= index < n:
            seg.close()
            raise MrlError(f"{path} is not a control segment with peer {index}")
        super().__init__(seg, n, cap)
        self.index = index

    def send(self, kind: ControlKind, *, model_id: str | None = None, version: int = 0, value: int = 0,
             timeout: float = 5.0) -> None:  # fmt: skip
        """Send one message to the hub."""
        self._seq += 1
        self._up[self.index].push(_pack(kind, self.index, model_id, version, value, self._seq), timeout, "to hub")

    def heartbeat(self) -> None:
        """Send a HEARTBEAT carrying this process id."""
        self.send(ControlKind.HEARTBEAT, value=os.getpid())

    def poll(self, timeout: float = 0.0) -> ControlMessage | None:
        """Next message from the hub, or ``None`` after ``timeout`` seconds."""
        return self._poll_rings([self._down[self.index]], timeout)

    def close(self) -> None:
        """Unmap."""
        self.seg.close()
