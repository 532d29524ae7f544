"""torch.distributed weight transports on a dedicated process group.

Both sides take part in every transfer. The sender owns a ``TCPStore`` (its address is the
picklable handle) and, on its first publish, builds a dedicated process group with the receivers
(rank 0 = sender). The store doubles as the *version notice*: ``publish`` sets ``<model_id>/latest``
before the first message, so ``latest_version()`` is one store round trip and a receiver joins the
transfer only when a newer version is being sent.

``broadcast`` (streaming, every chunk checksummed)
    The tensors are cut into *messages* of at most ``bucket_bytes`` (the unit of one transfer call):
    a tensor of at least ``min(BIG, bucket_bytes)`` bytes goes by whole rows straight from its own
    memory (no packing copy; the receiver writes it straight into a contiguous CPU destination),
    smaller ones are packed into one buffer per bucket. A *control* message (a 64 KiB ``uint8``
    head holding JSON) comes before every *group* of about ``group_bytes`` (64 MiB) of tensors: the
    group's tensors, their offsets and its message ranges, plus the checksums of the messages the
    sender has finished since the previous control.

    Integrity: the checksum is xxh3-64 (``"algo": "xxh3"`` in the controls; see
    :func:`~mrl_plugins.weight_sync.shards.checksum`) of every ``chunk_bytes`` slice of every
    message. Each side checksums a message right after its own transfer of it completed, while the
    next messages are on the wire, so the sender's checksums travel in a later control and the
    final ``end`` control carries the last ones and the totals; the receiver compares as they
    arrive. A mismatch, a missing checksum or a wrong total makes ``fetch_into`` raise
    :class:`WeightSyncError` naming the message and its tensors once the stream has ended (the
    stream is always consumed, so the group stays in step). The destination is a staging buffer, so
    no switch happens and the active version stays. A sender whose source fails sends ``abort``.

    Transfer: on the built-in gloo group the messages are tagged point-to-point send/recv over
    ``CONNECTIONS`` (2) TCP connections per pair (consecutive tags alternate between them, each has
    its own gloo I/O thread); gloo starts these at once instead of queueing them behind its two
    collective worker threads. The sender keeps up to ``WINDOW_BYTES`` (128 MiB) in flight, so it
    references at most that plus the group it is collecting; the receiver posts a whole group's
    receives on its control and checksums the group's last message only after posting the next
    group's. With a group handed in (hccl/nccl) the messages are broadcasts in issue order. The built-in group is
    gloo on every device: on a CUDA / NPU host (``weight_sync.transport: broadcast`` from a config, which hands in
    no group) device tensors are copied to host memory on the sender and from host memory into the destination on
    the receiver (unverified on hardware; on CPU tested with the device layer naming nccl).

    Measured: benchmarks/README.md (``python -m benchmarks weights``). What chose this design, in interleaved A/B
    runs: the earlier one (an async broadcast per tensor >= 1 MiB, 64 MiB buckets, crc32c) reached 1.03x per_param
    with checksums; a second connection adds 0-20%, a window of 128 instead of 16 MiB 5-10%.

``per_param`` (baseline)
    One control message listing every tensor, then one synchronous broadcast per parameter: what
    TRL's server mode does with its communicator. No checksums. It holds references to all tensors
    of the version (fine for a module's own parameters, not meant for ZeRO-3 gathers).

Modules: the senders here; the dedicated group and the control messages in
:mod:`~mrl_plugins.weight_sync.broadcast_group`; :class:`BroadcastHandle` and :class:`BroadcastReceiver` in
:mod:`~mrl_plugins.weight_sync.broadcast_rx` (both re-exported here).

A dead peer surfaces as :class:`~mrl_plugins.errors.StageTimeoutError`: every wait has the
configured timeout and a closed connection is reported as the peer's death.
"""

from __future__ import annotations

import secrets
import time
import uuid as uuidlib
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from mrl_plugins._net import td
from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs import PublishReport

from .broadcast_group import (  # noqa: F401 - re-exported: the transports' constants and group
    ALGO,
    BIG,
    CONNECTIONS,
    CTRL_BYTES,
    GROUP_BYTES,
    TAG_SPAN,
    WINDOW_BYTES,
    _ctrl_pack,
    _Group,
    _tag,
)
from .broadcast_rx import BroadcastHandle, BroadcastReceiver
from .config import WeightSyncConfig
from .shards import WeightSyncError, align, as_bytes, check_newer, chunk_checksums, row_split, st_dtype


class _BaseSender:
    kind = "broadcast"
    connections = 1  # of the built-in gloo group

    def __init__(
        self,
        config: WeightSyncConfig,
        *,
        model_id: str = "policy",
        run_id: str = "run",
        host: str = "127.0.0.1",
        world_size: int = 2,
        group: Any = None,
        **_: Any,
    ) -> None:
        import torch.distributed as dist

        if world_size < 2:
            raise WeightSyncError(f"broadcast transport needs world_size >= 2 (sender + receivers), got {world_size}")
        self.config, self.model_id, self.run_id = config, model_id, run_id
        self.timeout = float(config.timeout_s)
        self.host, self.world = host, world_size
        self.store = dist.TCPStore(
            host, 0, world_size=world_size, is_master=True, timeout=td(self.timeout), wait_for_workers=False
        )
        self.port = self.store.port
        if group is not None:
            self.connections = 1
        self.g = _Group(self.store, 0, world_size, self.timeout, group, self.connections, host)
        # gloo moves host tensors only; device backends (hccl/nccl, via ``group``) take device tensors
        self._host_only = group is None or dist.get_backend(group) == "gloo"
        self._latest: int | None = None
        self._closed = False

    def receiver_handle(self) -> BroadcastHandle:
        return BroadcastHandle(
            self.kind,
            self.host,
            self.port,
            self.world,
            self.model_id,
            self.timeout,
            self.config.verify_checksum,
            self.connections,
        )

    def _start(self, version: int) -> None:
        if self._closed:
            raise WeightSyncError(f"{self.kind} sender is closed")
        check_newer(self.model_id, version, self._latest)
        self.store.set(f"{self.model_id}/latest", str(version))
        self.g.connect(self.timeout)

    def _ctrl(self, msg: dict) -> None:
        head, rest = _ctrl_pack(msg)
        self.g.bcast(head, self.timeout)
        if rest is not None:
            self.g.bcast(rest, self.timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.g.pg = None
        self.store = None


class _Outbox:
    """The sender's messages of one publish: tags, the in-flight window, checksums of the finished ones."""

    def __init__(self, g: _Group, timeout: float, chunk: int, algo: str | None, window_bytes: int) -> None:
        self.g, self.timeout, self.chunk, self.algo, self.window_bytes = g, timeout, chunk, algo, window_bytes
        self.base = secrets.randbelow(TAG_SPAN)
        self.seq = 0
        self.fifo: deque[tuple[list[Any], torch.Tensor, bool]] = deque()
        self.inflight = 0  # bytes
        self.sums: list[list[int]] = []  # checksums no control has carried yet, in message order
        self.carried = 0  # checksums carried by earlier controls
        self.first = True

    def post(self, buf: torch.Tensor, data: bool = True, tag: int | None = None) -> None:
        if tag is None:
            tag = _tag(self.base, self.seq)
            self.seq += 1
        self.fifo.append((self.g.post(buf, tag, self.timeout), buf, data))
        self.inflight += buf.numel()
        while len(self.fifo) > 1 and self.inflight > self.window_bytes:
            self.retire()

    def retire(self) -> None:
        """Wait for the oldest message; checksum it right away, while it is still in the caches."""
        works, buf, data = self.fifo.popleft()
        self.inflight -= buf.numel()
        for w in works:
            self.g.wait(w, self.timeout)
        if data and self.algo is not None:
            self.sums.append(chunk_checksums(buf, self.chunk, self.algo))

    def drain(self) -> None:
        while self.fifo:
            self.retire()

    def ctrl(self, msg: dict) -> None:
        msg["c0"], msg["crcs"] = self.carried, self.sums
        self.carried += len(self.sums)
        self.sums = []
        head, rest = _ctrl_pack(msg, self.base)
        self.post(head, data=False, tag=0 if self.first else None)
        self.first = False
        if rest is not None:
            self.post(rest, data=False)


class BroadcastSender(_BaseSender):
    """Streaming, checksummed transfer (see the module docstring)."""

    kind = "broadcast"
    connections = CONNECTIONS
    window_bytes = WINDOW_BYTES

    def __init__(self, config: WeightSyncConfig, *, group_bytes: int = GROUP_BYTES, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.bucket_bytes = config.bucket_for("broadcast")
        self.chunk_bytes = config.chunk_for("broadcast")
        self.group_bytes = max(int(group_bytes), 1)

    def _layout(self, group: list[tuple[str, torch.Tensor]]) -> tuple[list, list, list[torch.Tensor]]:
        """Entries ``[name, dtype, shape, offset, nbytes]``, message ranges ``[offset, nbytes]`` and their buffers."""
        entries: list[list] = []
        msgs: list[list[int]] = []
        bufs: list[torch.Tensor] = []
        small: list[tuple[str, str, torch.Tensor]] = []
        big, off = min(BIG, self.bucket_bytes), 0
        for name, t in group:
            dt = st_dtype(t.dtype)
            if t.dim() == 0 or t.nbytes < big:
                small.append((name, dt, t))
                continue
            entries.append([name, dt, list(t.shape), off, t.nbytes])
            b, row = as_bytes(t), t.nbytes // t.shape[0]
            for r0, r1 in row_split(t.shape[0], row, self.bucket_bytes):
                msgs.append([off + r0 * row, (r1 - r0) * row])
                bufs.append(b[r0 * row : r1 * row])
            off = align(off + t.nbytes)
        lay: list[tuple[int, torch.Tensor]] = []
        start = off

        def pack() -> None:
            buf = torch.empty(off - start, dtype=torch.uint8)
            for o, t in lay:
                buf[o : o + t.nbytes].copy_(as_bytes(t))
            msgs.append([start, off - start])
            bufs.append(buf)

        for name, dt, t in small:
            if lay and off + t.nbytes - start > self.bucket_bytes:
                pack()
                lay, start = [], off
            entries.append([name, dt, list(t.shape), off, t.nbytes])
            if t.nbytes:
                lay.append((off - start, t))
                off = align(off + t.nbytes)
        if lay:
            pack()
        return entries, msgs, bufs

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        self._start(version)
        t0 = time.perf_counter()
        uid = uuidlib.uuid4().hex
        algo = ALGO if self.config.verify_checksum else None
        out = _Outbox(self.g, self.timeout, self.chunk_bytes, algo, self.window_bytes)
        group: list[tuple[str, torch.Tensor]] = []
        nbytes, ngroups, nmsgs, held, meta_len = 0, 0, 0, 0, 0

        def flush() -> None:
            nonlocal group, held, meta_len, ngroups, nmsgs
            if not group:
                return
            entries, msgs, bufs = self._layout(group)
            out.ctrl(
                {
                    "k": "bucket",
                    "v": version,
                    "uuid": uid,
                    "model_id": self.model_id,
                    "i": ngroups,
                    "entries": entries,
                    "msgs": msgs,
                    "algo": out.algo,
                    "chunk": self.chunk_bytes,
                }
            )
            for b in bufs:
                out.post(b)
            ngroups += 1
            nmsgs += len(bufs)
            group, held, meta_len = [], 0, 0

        try:
            for name, t in named_tensors:
                t = t.detach()
                if t.device.type != "cpu" and self._host_only:
                    t = t.cpu()
                t = t.contiguous()
                nbytes += t.nbytes
                group.append((name, t))
                held += t.nbytes
                meta_len += len(name) + 96 + 48 * (t.nbytes // self.bucket_bytes + 1)
                if held >= self.group_bytes or meta_len > CTRL_BYTES // 2:
                    flush()
            flush()
            out.drain()
            out.ctrl({"k": "end", "v": version, "uuid": uid, "count": ngroups, "msgs": nmsgs, "nbytes": nbytes})
            out.drain()
        except StageTimeoutError:
            raise
        except BaseException:
            try:
                out.drain()
                out.ctrl({"k": "abort", "v": version, "uuid": uid})
                out.drain()
            except Exception:  # noqa: BLE001 - the original error matters more
                pass
            raise
        self._latest = version
        return PublishReport(self.model_id, version, nbytes, time.perf_counter() - t0, nmsgs)


class PerParamSender(_BaseSender):
    """Baseline: one synchronous broadcast per parameter (TRL server mode's way)."""

    kind = "per_param"

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        self._start(version)
        t0 = time.perf_counter()
        items = []
        for name, t in named_tensors:
            t = t.detach()
            if t.device.type != "cpu" and self._host_only:
                t = t.cpu()
            items.append((name, t.contiguous()))
        entries = [[n, st_dtype(t.dtype), list(t.shape), 0, t.nbytes] for n, t in items]
        self._ctrl(
            {"k": "params", "v": version, "uuid": uuidlib.uuid4().hex, "model_id": self.model_id, "entries": entries}
        )
        nbytes = 0
        for _, t in items:
            if t.nbytes:
                self.g.bcast(as_bytes(t), self.timeout)
            nbytes += t.nbytes
        self._latest = version
        return PublishReport(self.model_id, version, nbytes, time.perf_counter() - t0, len(items))


__all__ = ["BroadcastHandle", "BroadcastReceiver", "BroadcastSender", "PerParamSender"]
