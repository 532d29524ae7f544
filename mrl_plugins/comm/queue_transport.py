"""``queue`` transport: ``multiprocessing.Queue`` carrying pickled numpy arrays (the naive baseline).

Every batch is pickled in :meth:`QueueProducer.send` (so the caller may reuse its tensors as soon
as ``send`` returns) and unpickled by the consumer: two full copies plus pickle overhead per batch.
Tensors are converted to numpy first -- after ``import torch``, ``multiprocessing`` would otherwise
ship tensors through torch's own shared-memory path, which is not what this baseline measures.
The codec is not applied (fields travel in their own dtype). Handles pass through a
``multiprocessing`` spawn (as ``Process`` arguments), not through a queue.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import queue as _queue
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from mrl_plugins.errors import MrlError, StageTimeoutError
from mrl_plugins.shmem import check_run_id

from .base import ChannelClosedError, Heartbeat, PeerDeadError, Received, deadline_of, pid_alive, queue_get
from .config import CommConfig

LOG = logging.getLogger("mrl_plugins.comm")

_FREE, _ATTACHED, _CLOSED = 0, 1, 2


def _to_wire(v: Any) -> tuple[str, Any]:
    if isinstance(v, torch.Tensor):
        t = v.detach().cpu()
        if t.dtype == torch.bfloat16:
            return "torch:bfloat16", t.view(torch.int16).numpy()
        return "torch", t.numpy()
    if isinstance(v, np.ndarray):
        return "numpy", v
    raise MrlError(f"queue transport: expected tensors or arrays, got {type(v).__name__}")


def _from_wire(kind: str, a: np.ndarray) -> Any:
    if kind == "numpy":
        return a
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if kind == "torch:bfloat16" else t


class QueueConsumer:
    """Receiving end of the ``queue`` transport."""

    def __init__(self, config: CommConfig, *, n_producers: int, run_id: str, codec: Any = None) -> None:
        check_run_id(run_id)
        config.validate()
        ctx = mp.get_context("spawn")
        self.config = config
        self.n = n_producers
        self.q = ctx.Queue(maxsize=config.ring_slots * n_producers)
        self.hb = ctx.RawArray("d", n_producers)
        self.state = ctx.RawArray("i", n_producers)
        self.pids = ctx.RawArray("q", n_producers)
        self._stats = dict.fromkeys(("frames", "bytes", "raw_bytes", "wait_s", "dead_peers", "corrupt"), 0)
        self._reported: dict[int, int] = {}  # producer -> the pid reported dead (a new pid is watched again)
        self._closed = False

    def producer_handle(self, i: int) -> QueueProducerHandle:
        """Handle for producer ``i``; pass it as a ``Process`` argument."""
        if not 0 <= i < self.n:
            raise MrlError(f"producer index {i} out of range 0..{self.n - 1}")
        return QueueProducerHandle(self.q, self.hb, self.state, self.pids, i, self.config.to_dict(), os.getpid())

    def receive(self, timeout: float | None = None) -> Received:
        """Next batch (fields are owned arrays/tensors; ``release`` is a no-op)."""
        t, deadline = deadline_of(timeout, self.config.receive_timeout_s)
        t0 = time.perf_counter()
        try:
            data = queue_get(self.q, deadline, self._check_peers,
                             lambda: StageTimeoutError(f"queue consumer: no batch within {t} s"))  # fmt: skip
        finally:
            self._stats["wait_s"] += time.perf_counter() - t0
        i, meta, fields = pickle.loads(data)
        batch = {k: _from_wire(kind, a) for k, (kind, a) in fields.items()}
        self._stats["frames"] += 1
        self._stats["bytes"] += len(data)
        self._stats["raw_bytes"] += sum(a.nbytes for _k, a in fields.values())
        return Received(meta, batch, len(data), i)

    def _check_peers(self) -> None:
        now = time.monotonic()
        for i in range(self.n):
            if i in self._reported and self.state[i] == _ATTACHED and self.pids[i] != self._reported[i]:
                del self._reported[i]  # a restarted producer attached under this index
            if self.state[i] != _ATTACHED or i in self._reported:
                continue
            age = now - self.hb[i]
            if age > self.config.heartbeat_timeout_s or not pid_alive(self.pids[i]):
                self._reported[i] = self.pids[i]
                self._stats["dead_peers"] += 1
                raise PeerDeadError(f"queue producer {i} (pid {self.pids[i]}) is dead: last heartbeat {age:.2f} s ago")
        if all(self.state[i] == _CLOSED or i in self._reported for i in range(self.n)) and self.q.empty():
            raise ChannelClosedError(f"all {self.n} queue producers closed and were drained")

    def stats(self) -> dict[str, float]:
        """Counters: frames, bytes (pickled), raw_bytes, wait_s, dead_peers, corrupt, queue_depth."""
        out = dict(self._stats)
        try:
            out["queue_depth"] = self.q.qsize()
        except NotImplementedError:  # macOS
            out["queue_depth"] = 0
        return out

    def close(self, unlink: bool = True) -> None:
        """Close the queue (nothing to unlink)."""
        if not self._closed:
            self._closed = True
            self.q.close()
            self.q.cancel_join_thread()


class QueueProducerHandle:
    """Picklable (at process spawn) reference to one producer of a :class:`QueueConsumer`."""

    def __init__(self, q, hb, state, pids, index: int, config: dict[str, Any], consumer_pid: int) -> None:
        self.q, self.hb, self.state, self.pids = q, hb, state, pids
        self.index = index
        self.config = config
        self.consumer_pid = consumer_pid

    def attach(self, codec: Any = None) -> QueueProducer:
        """Start heartbeating and return the producer."""
        return QueueProducer(self, CommConfig.from_dict(self.config))


class QueueProducer:
    """Sending end of the ``queue`` transport."""

    def __init__(self, h: QueueProducerHandle, config: CommConfig) -> None:
        self.h = h
        self.index = h.index
        self.config = config
        h.pids[h.index] = os.getpid()
        h.state[h.index] = _ATTACHED
        self._hb = Heartbeat(self._beat, config.heartbeat_interval_s, f"mrl-comm-qproducer{h.index}-hb")
        self._closed = False

    def _beat(self) -> None:
        self.h.hb[self.index] = time.monotonic()

    def send(self, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float | None = None) -> int:
        """Pickle and enqueue; blocks up to ``timeout`` when the queue is full."""
        fields = {k: _to_wire(v) for k, v in batch.items()}
        data = pickle.dumps((self.index, dict(meta), fields), protocol=pickle.HIGHEST_PROTOCOL)
        t, deadline = deadline_of(timeout, self.config.send_timeout_s)
        while True:
            try:
                self.h.q.put(data, timeout=max(0.0, min(0.25, deadline - time.monotonic())))
                return len(data)
            except _queue.Full:
                if not pid_alive(self.h.consumer_pid):
                    raise PeerDeadError(
                        f"queue producer {self.index}: consumer pid {self.h.consumer_pid} is dead"
                    ) from None
                if time.monotonic() >= deadline:
                    raise StageTimeoutError(f"queue producer {self.index}: queue full for {t} s") from None

    def close(self) -> None:
        """Flush the queue's feeder thread (at most ``send_timeout_s``; not waited for once the consumer is dead)
        and mark this producer closed. Items the consumer did not take by then are dropped, with a warning."""
        if self._closed:
            return
        self._closed = True
        self._hb.stop()
        q = self.h.q
        q.close()
        feeder = getattr(q, "_thread", None)  # the feeder writing buffered items into the pipe
        deadline = time.monotonic() + self.config.send_timeout_s
        while feeder is not None and feeder.is_alive():
            if time.monotonic() >= deadline or not pid_alive(self.h.consumer_pid):
                q.cancel_join_thread()  # neither here nor at exit: a consumer that stopped reading keeps it blocked
                LOG.warning(
                    "queue producer %d: the consumer (pid %d) took no more items; unsent ones dropped at close",
                    self.index, self.h.consumer_pid,
                )  # fmt: skip
                break
            feeder.join(0.05)
        else:
            q.join_thread()
        self.h.state[self.index] = _CLOSED


def queue_factory(config: CommConfig, *, n_producers: int, run_id: str, codec: Any = None) -> QueueConsumer:
    """Transport factory registered as ``queue`` (``codec`` is accepted and not applied: fields are pickled)."""
    return QueueConsumer(config, n_producers=n_producers, run_id=run_id)
