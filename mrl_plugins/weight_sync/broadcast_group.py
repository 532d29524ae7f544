"""The dedicated process group and the control messages of the broadcast weight transports
(:mod:`mrl_plugins.weight_sync.broadcast` has the design; senders there, receivers in
:mod:`~mrl_plugins.weight_sync.broadcast_rx`)."""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import torch

from mrl_plugins._net import gloo_broadcast, gloo_group, td
from mrl_plugins.errors import StageTimeoutError

from .shards import WeightSyncError

LOG = logging.getLogger("mrl_plugins.weight_sync")
_said_host_path: list[str] = []  # the host-path line is logged once per process
CTRL_BYTES = 64 << 10
MAGIC = b"MRLWSBC2"
HEAD = 24  # MAGIC, JSON length, tag base
BIG = 1 << 20  # tensors >= 1 MiB (or >= one bucket) are sent from their own memory
GROUP_BYTES = 64 << 20  # tensor bytes described by one control message
WINDOW_BYTES = 128 << 20  # the sender waits for (and checksums) its oldest message beyond this many bytes in flight
CONNECTIONS = 2  # TCP connections per pair of the built-in gloo group (one gloo I/O thread each)
ALGO = "xxh3"
TAG_SPAN = (1 << 31) - 2  # gloo tags are non-negative 32-bit ints; tag 0 is each publish's first control


def _peer_error(exc: BaseException, what: str, timeout: float) -> StageTimeoutError:
    return StageTimeoutError(f"{what}: peer dead or not answering within {timeout:.1f}s ({type(exc).__name__}: {exc})")


def _tag(base: int, seq: int) -> int:
    return 1 + (base + seq) % TAG_SPAN


class _Group:
    """A dedicated group: a raw ``ProcessGroupGloo`` on our own store, or a group handed in by the caller."""

    def __init__(
        self, store: Any, rank: int, world: int, timeout: float, group: Any = None, connections: int = 1,
        host: str = "127.0.0.1",
    ) -> None:  # fmt: skip
        self.store, self.rank, self.world, self.timeout, self.host = store, rank, world, timeout, host
        self.group, self.connections = group, connections
        self.pg: Any = None

    def connect(self, timeout: float) -> None:
        if self.pg is not None or self.group is not None:
            return
        from mrl_plugins import device

        try:
            backend = device.collective_backend()
        except Exception:  # noqa: BLE001 - device layer unavailable: CPU path
            backend = "gloo"
        if backend != "gloo" and not _said_host_path:  # a CUDA / NPU host: the built-in group still moves host bytes
            _said_host_path.append(backend)
            LOG.info(
                "weight sync: the dedicated broadcast group is gloo, device tensors go through host memory (the "
                "device's %s carries the stream only in a group handed in as group=)", backend
            )  # fmt: skip
        try:
            self.pg = gloo_group(self.store, self.rank, self.world, timeout, self.host, self.connections)
        except (RuntimeError, OSError) as exc:
            raise _peer_error(exc, "creating the weight-sync process group", timeout) from None

    def bcast(self, t: torch.Tensor, timeout: float, async_op: bool = False) -> Any:
        import torch.distributed as dist

        try:
            if self.group is not None:
                work = dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group, async_op=True)
            else:
                work = gloo_broadcast(self.pg, t, timeout)
            if not async_op:
                work.wait(td(timeout))
                return None
            return work
        except RuntimeError as exc:
            raise _peer_error(exc, "weight broadcast", timeout) from None

    def post(self, t: torch.Tensor, tag: int, timeout: float) -> list[Any]:
        """Start moving ``t``: the sender to every receiver, a receiver from the sender (``tag`` on our own group)."""
        if self.group is not None:
            return [self.bcast(t, timeout, async_op=True)]
        try:
            if self.rank == 0:
                return [self.pg.send([t], r, tag) for r in range(1, self.world)]
            return [self.pg.recv([t], 0, tag)]
        except RuntimeError as exc:
            raise _peer_error(exc, "weight transfer", timeout) from None

    def wait(self, work: Any, timeout: float) -> None:
        try:
            work.wait(td(timeout))  # a handed-in group's backend may also enforce its own timeout
        except RuntimeError as exc:
            raise _peer_error(exc, "weight transfer", timeout) from None


def _ctrl_pack(msg: dict, base: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A control message: the fixed-size head (MAGIC, length, tag base, JSON) and the JSON that did not fit."""
    raw = json.dumps(msg, separators=(",", ":")).encode()
    head = torch.zeros(CTRL_BYTES, dtype=torch.uint8)
    room = CTRL_BYTES - HEAD
    head[:HEAD] = torch.frombuffer(bytearray(MAGIC + struct.pack("<QQ", len(raw), base)), dtype=torch.uint8)
    first = raw[:room]
    head[HEAD : HEAD + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
    rest = None
    if len(raw) > room:
        rest = torch.frombuffer(bytearray(raw[room:]), dtype=torch.uint8)
    return head, rest


def _ctrl_head(head: torch.Tensor) -> tuple[int, int, bytes]:
    """Length, tag base and the first part of the JSON of a control head."""
    raw = bytes(head[:HEAD].numpy())
    if raw[:8] != MAGIC:
        raise WeightSyncError("weight broadcast: bad control message (stream out of step)")
    n, base = struct.unpack("<QQ", raw[8:])
    return n, base, bytes(head[HEAD : HEAD + min(n, CTRL_BYTES - HEAD)].numpy())
