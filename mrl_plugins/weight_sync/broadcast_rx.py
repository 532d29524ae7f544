"""The receiving side of the broadcast weight transports (:mod:`mrl_plugins.weight_sync.broadcast` has the
design): the picklable :class:`BroadcastHandle` and :class:`BroadcastReceiver`."""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from typing import Any

import torch

from mrl_plugins._net import td
from mrl_plugins.errors import choices

from .broadcast_group import CTRL_BYTES, HEAD, _ctrl_head, _Group, _peer_error, _tag
from .shards import CHECKSUM_ALGOS, ST_TO_DTYPE, Dest, WeightSyncError, as_bytes, chunk_checksums, dest_tensor


@dataclass(frozen=True)
class BroadcastHandle:
    """Picklable address of a broadcast sender: its store and the group size."""

    kind: str
    host: str
    port: int
    world_size: int
    model_id: str
    timeout_s: float
    verify: bool = True
    connections: int = 1

    def attach(self, rank: int = 1, group: Any = None) -> BroadcastReceiver:
        """Connect as ``rank`` (1..world_size-1); the group itself is built at the first fetch."""
        if not 1 <= rank < self.world_size:
            raise WeightSyncError(f"receiver rank must be in 1..{self.world_size - 1}, got {rank}")
        return BroadcastReceiver(self, rank, group)


class _Inbox:
    """The receiver's side of :class:`_Outbox`: the same tags, in the same order."""

    def __init__(self, g: _Group, timeout: float) -> None:
        self.g, self.timeout = g, timeout
        self.base: int | None = None
        self.seq = 0

    def post(self, buf: torch.Tensor, tag: int | None = None) -> tuple[torch.Tensor, Any]:
        if tag is None:
            tag = _tag(self.base or 0, self.seq)
            self.seq += 1
        return buf, self.g.post(buf, tag, self.timeout)[0]

    def post_ctrl(self) -> tuple[torch.Tensor, Any]:
        return self.post(torch.empty(CTRL_BYTES, dtype=torch.uint8), tag=0 if self.base is None else None)

    def ctrl(self, posted: tuple[torch.Tensor, Any]) -> dict:
        head, work = posted
        self.g.wait(work, self.timeout)
        n, base, body = _ctrl_head(head)
        if self.base is None:
            self.base = base
        elif base != self.base:
            raise WeightSyncError("weight broadcast: control message of another publish (stream out of step)")
        if n > CTRL_BYTES - HEAD:
            rest, work = self.post(torch.empty(n - (CTRL_BYTES - HEAD), dtype=torch.uint8))
            self.g.wait(work, self.timeout)
            body += bytes(rest.numpy())
        return json.loads(body)


class BroadcastReceiver:
    """Receiving side of :class:`BroadcastSender` and :class:`PerParamSender`."""

    def __init__(self, h: BroadcastHandle, rank: int, group: Any = None) -> None:
        import torch.distributed as dist

        self.h = h
        try:
            self.store = dist.TCPStore(
                h.host, h.port, world_size=h.world_size, is_master=False, timeout=td(h.timeout_s)
            )
        except RuntimeError as exc:
            raise _peer_error(exc, f"connecting to the weight-sync store {h.host}:{h.port}", h.timeout_s) from None
        self.g = _Group(self.store, rank, h.world_size, h.timeout_s, group, h.connections, h.host)
        self._key = f"{h.model_id}/latest"

    def latest_version(self) -> int | None:
        """The version the sender is publishing or has published (one store round trip)."""
        try:
            if not self.store.check([self._key]):
                return None
            return int(self.store.get(self._key))
        except RuntimeError as exc:
            raise _peer_error(exc, f"reading the version of model_id={self.h.model_id}", self.h.timeout_s) from None

    def _recv_ctrl(self, timeout: float) -> dict:
        """A control message of the per-parameter baseline (broadcasts)."""
        head = torch.empty(CTRL_BYTES, dtype=torch.uint8)
        self.g.bcast(head, timeout)
        n, _, body = _ctrl_head(head)
        if n > CTRL_BYTES - HEAD:
            rest = torch.empty(n - (CTRL_BYTES - HEAD), dtype=torch.uint8)
            self.g.bcast(rest, timeout)
            body += bytes(rest.numpy())
        return json.loads(body)

    def fetch_into(self, version: int, dest: Dest, timeout: float | None = None) -> int:
        """Take part in the sender's next publish and copy it into ``dest``. Returns tensor bytes."""
        timeout = self.h.timeout_s if timeout is None else timeout
        self.g.connect(timeout)
        bad: list[str] = []
        if self.h.kind == "per_param":
            msg = self._recv_ctrl(timeout)
            self._check_version(msg, version, bad)
            n = self._recv_params(msg, dest, timeout, bad)
        else:
            inbox = _Inbox(self.g, timeout)
            msg = inbox.ctrl(inbox.post_ctrl())
            self._check_version(msg, version, bad)
            n = self._recv_stream(inbox, msg, dest, bad, version)
        if bad:
            raise WeightSyncError(f"model_id={self.h.model_id}: " + "; ".join(bad[:3]))
        return n

    @staticmethod
    def _check_version(msg: dict, version: int, bad: list[str]) -> None:
        if msg.get("v") != version:
            bad.append(f"asked for version {version}, the sender is publishing {msg.get('v')}")

    def _target(self, dest: Dest, name: str, dtype: torch.dtype, shape: list[int], bad: list[str]) -> Any:
        """:func:`dest_tensor`, its error kept in ``bad`` (the stream is received to its end: the group stays in
        step)."""
        try:
            return dest_tensor(dest, name, dtype, shape)
        except WeightSyncError as exc:
            bad.append(str(exc))
            return None

    @staticmethod
    def _deliver(target: Any, view: torch.Tensor, row0: int = 0) -> None:
        if target is not None:
            if row0 or (view.dim() and view.shape[0] != target.shape[0]):
                target = target[row0 : row0 + view.shape[0]]
            target.copy_(view)

    def _recv_params(self, msg: dict, dest: Dest, timeout: float, bad: list[str]) -> int:
        n = 0
        for name, dt, shape, _, nb in msg["entries"]:
            dtype = ST_TO_DTYPE[dt]
            target = self._target(dest, name, dtype, shape, bad)
            if nb == 0:
                continue
            if target is not None and target.is_contiguous() and target.device.type == "cpu":
                self.g.bcast(as_bytes(target), timeout)
            else:
                buf = torch.empty(nb, dtype=torch.uint8)
                self.g.bcast(buf, timeout)
                self._deliver(target, buf.view(dtype).view(shape))
            n += nb
        return n

    def _plan(self, msg: dict, dest: Dest, bad: list[str]) -> tuple[list[tuple[torch.Tensor, list, str]], dict]:
        """Per message of a group: the buffer to receive into, the copies to make from it, its tensors' names.

        A message that is exactly a row range of one tensor whose destination is a contiguous CPU tensor is
        received in place; anything else goes through a temporary buffer. Also returns the destinations.
        """
        entries = [e for e in msg["entries"] if e[4]]
        targets: dict[str, Any] = {}
        for name, dt, shape, _, _ in msg["entries"]:
            targets[name] = self._target(dest, name, ST_TO_DTYPE[dt], shape, bad)
        starts = [e[3] for e in entries]
        plan = []
        for a, nb in msg["msgs"]:
            b = a + nb
            i = max(0, bisect.bisect_right(starts, a) - 1)
            copies = []  # (name, dtype, piece shape, offset in the message, bytes, row0, offset in the tensor)
            while i < len(entries) and entries[i][3] < b:
                name, dt, shape, off, enb = entries[i]
                lo, hi = max(a, off), min(b, off + enb)
                if lo < hi:
                    row = enb // (shape[0] if shape else 1)
                    if (lo - off) % row or (hi - off) % row:
                        raise WeightSyncError(f"weight broadcast: message [{a}, {b}) cuts a row of {name}")
                    r0, r1 = (lo - off) // row, (hi - off) // row
                    piece = [r1 - r0, *shape[1:]] if shape else []
                    copies.append((name, ST_TO_DTYPE[dt], piece, lo - a, hi - lo, r0, lo - off))
                i += 1
            if not copies:
                raise WeightSyncError(f"weight broadcast: message [{a}, {b}) holds no tensor (stream out of step)")
            label = ", ".join(c[0] for c in copies[:3]) + (", ..." if len(copies) > 3 else "")
            name, _, _, mo, cnb, _, toff = copies[0]
            tgt = targets.get(name)
            direct = len(copies) == 1 and mo == 0 and cnb == nb and tgt is not None
            if direct and tgt.is_contiguous() and tgt.device.type == "cpu":
                plan.append((as_bytes(tgt)[toff : toff + nb], [], label))
            else:
                plan.append((torch.empty(nb, dtype=torch.uint8), copies, label))
        return plan, targets

    def _recv_stream(self, inbox: _Inbox, msg: dict, dest: Dest, bad: list[str], version: int) -> int:
        n, groups, uid = 0, 0, msg.get("uuid")
        mine: list[list[int]] = []  # checksums of the received messages, in order
        theirs: list[list[int]] = []  # ... as the sender computed them
        labels: list[str] = []
        checked = 0
        verify, algo = self.h.verify, None

        def compare(m: dict) -> None:
            nonlocal checked
            if m.get("c0") != len(theirs):
                raise WeightSyncError("weight broadcast: checksums out of step with the messages")
            theirs.extend(m.get("crcs") or [])
            upto = min(len(theirs), len(mine))
            for i in range(checked, upto):
                if theirs[i] != mine[i]:
                    bad.append(f"checksum mismatch in message {i} ({labels[i]}) of version {version}")
            checked = max(checked, upto)

        held: list[tuple] = []  # received, not yet checksummed and delivered

        def finish(item: tuple) -> None:
            buf, copies, label, targets, chunk, algo = item
            labels.append(label)
            if verify:  # right away, while the message is in the caches
                mine.append(chunk_checksums(buf, chunk, algo))
            if not bad:
                for name, dtype, piece, mo, cnb, r0, _ in copies:
                    self._deliver(targets[name], buf[mo : mo + cnb].view(dtype).view(piece), r0)

        while True:
            k = msg["k"]
            if k == "abort":
                raise WeightSyncError(f"model_id={self.h.model_id}: the sender aborted version {msg.get('v')}")
            if msg.get("uuid") != uid:
                raise WeightSyncError(f"weight broadcast: control message of another publish ({k!r})")
            if k == "end":
                for item in held:
                    finish(item)
                if verify:
                    compare(msg)
                if msg["count"] != groups or msg["nbytes"] != n or msg["msgs"] != len(labels):
                    bad.append(
                        f"got {groups} groups/{len(labels)} messages/{n} bytes, the sender sent "
                        f"{msg['count']}/{msg['msgs']}/{msg['nbytes']}"
                    )
                if verify and not len(theirs) == len(mine) == len(labels):
                    bad.append(f"{len(theirs)} checksums for {len(labels)} messages (version {version})")
                return n
            if verify:
                compare(msg)  # a held message is compared at a later control
            if k != "bucket" or msg.get("i") != groups:
                raise WeightSyncError(f"weight broadcast: unexpected control message {k!r} (group {groups})")
            if verify:
                algo = msg.get("algo")
                if algo not in CHECKSUM_ALGOS:
                    raise WeightSyncError(
                        f"weight broadcast: the sender checksums with {algo!r}; this receiver knows "
                        f"{choices(CHECKSUM_ALGOS)}"
                    )
            chunk = int(msg["chunk"])
            plan, targets = self._plan(msg, dest, bad)
            posted = [inbox.post(buf)[1] for buf, _, _ in plan]
            nxt = inbox.post_ctrl()  # the next control, so that the sender never waits for us
            for item in held:  # the previous group's last message: only now, so that the wire kept going
                finish(item)
            held = []
            for j, ((buf, copies, label), work) in enumerate(zip(plan, posted)):
                self.g.wait(work, inbox.timeout)
                item = (buf, copies, label, targets, chunk, algo)
                if j == len(plan) - 1:
                    held.append(item)  # finished once the next group's receives are posted
                else:
                    finish(item)
            n += sum(e[4] for e in msg["entries"])
            groups += 1
            msg = inbox.ctrl(nxt)

    def close(self) -> None:
        self.g.pg = None
        self.store = None


__all__ = ["BroadcastHandle", "BroadcastReceiver"]
