"""``torch_distributed`` transport: frames sent with point-to-point send/recv over private process groups.

Every producer has a group of its own with the consumer, two ranks on the consumer's ``TCPStore`` (so it works
beside, and independent of, any default group the trainer already has): the consumer is rank 0, the producer
rank 1. Each batch goes as two messages: a length header and the encoded frame (:mod:`mrl_plugins.comm.frame`,
codec applied, its checksum (``comm.checksum``, xxh3 by default) checked on receipt).

Rejoinable: a producer that attaches takes the next *incarnation* number of its index (``join/<i>`` in the store)
and forms the pair group of that incarnation; the consumer starts a receiver for each new incarnation it sees, so a
restarted worker (a new process on this or another host) sends again under the same index while its dead
predecessor's group is abandoned. Producers attach independently: frames flow as soon as one has joined.

Backend: always gloo, whatever the device layer names: frames live in host memory, and an ``hccl``/``nccl``
backend would need each frame copied to the device and back.

Every wait has a deadline. Gloo's own timeouts break the connection, so blocking gloo waits run
in receiver threads (consumer) and a sender thread (producer) with a week-long group timeout,
and ``receive``/``send`` wait on bounded in-process queues of ``ring_slots`` frames with their own
deadlines (backpressure: a producer blocks once ``ring_slots`` frames wait unreceived). Producers
stamp a heartbeat counter in the store (no clock comparison across hosts) and the consumer raises
:class:`PeerDeadError` when one stops changing for ``heartbeat_timeout_s`` (once; a new incarnation of that
producer is watched again).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

from mrl_plugins._net import gloo_group, td
from mrl_plugins.errors import MrlError, StageTimeoutError
from mrl_plugins.shmem import check_run_id

from .base import ChannelClosedError, Heartbeat, PeerDeadError, Received, deadline_of, queue_get
from .codec import make_codec
from .config import CommConfig
from .frame import FrameError, FramePlan, decode_frame

LOG = logging.getLogger("mrl_plugins.comm")

_TAG_LEN, _TAG_FRAME = 11, 12
#: seconds between two looks of the consumer for producers that joined (a new one or a restarted one)
JOIN_POLL_S = 0.05
#: seconds close() waits for the receiver threads to leave
CLOSE_JOIN_S = 2.0


def _pair_group(host: str, port: int, rank: int, prefix: str, timeout_s: float) -> tuple[Any, Any]:
    """``(store client, group)``: the two-rank gloo group under ``prefix`` of the consumer's store, on a store
    connection of its own (a blocking wait on a shared client would hold up the other users)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, None, False, timeout=td(timeout_s))
    # a week: gloo timeouts kill the pair, so deadlines are enforced above it
    return store, gloo_group(dist.PrefixStore(prefix, store), rank, 2, 7 * 86400, host)


def _prefix(run_id: str, index: int, incarnation: int) -> str:
    return f"mrl-comm/{run_id}/{index}/{incarnation}/"


class DistConsumer:
    """Rank 0 of every producer's pair group: receives frames from ``n_producers`` producers (and from their
    restarted incarnations)."""

    def __init__(
        self, config: CommConfig, *, n_producers: int, run_id: str, host: str = "127.0.0.1", codec: Any = None
    ) -> None:
        import torch.distributed as dist

        config.validate()
        self.config = config
        self.n = n_producers
        self.run_id = check_run_id(run_id)
        self.host = host
        self._timeout = max(config.receive_timeout_s, config.send_timeout_s)
        self._master = dist.TCPStore(host, 0, None, True, timeout=td(self._timeout), wait_for_workers=False)
        self.port = self._master.port
        self._err: BaseException | None = None
        self._closing = threading.Event()
        self._inbox: queue.Queue = queue.Queue(maxsize=config.ring_slots)
        self._joined = [0] * n_producers  # latest incarnation of each producer (0: none attached yet)
        self._links: dict[tuple[int, int], Any] = {}  # (producer, incarnation) -> its (store, group), kept alive
        self._seen: dict[int, tuple[int, float]] = {}
        self._reported: dict[int, int] = {}  # producer -> the incarnation reported dead
        self._arrived: dict[tuple[int, int], int] = {}  # frames queued per (producer, incarnation)
        self._link_errors: dict[tuple[int, int], str] = {}  # (producer, incarnation) -> how its link failed
        self._stats = dict.fromkeys(
            ("frames", "bytes", "raw_bytes", "fallbacks", "corrupt", "wait_s", "dead_peers", "rejoins", "link_errors"),
            0,
        )
        # the producers' codec: tells their overflow fallbacks from the frames
        self._codec = codec if codec is not None else make_codec(config)
        self._receivers: list[threading.Thread] = []
        self._watcher = threading.Thread(target=self._watch, name="mrl-comm-dist-join", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        """Start a receiver for the latest incarnation of every producer, as they join."""
        try:
            while not self._closing.wait(JOIN_POLL_S):
                for i in range(self.n):
                    latest = int(self._master.add(f"join/{i}", 0))
                    if latest > self._joined[i]:
                        if self._joined[i]:
                            self._stats["rejoins"] += 1
                        self._joined[i] = latest
                        rx = threading.Thread(
                            target=self._receive_from, args=(i, latest), name=f"mrl-comm-dist-rx{i}.{latest}",
                            daemon=True,
                        )  # fmt: skip
                        self._receivers.append(rx)
                        rx.start()
        except BaseException as exc:  # handed to receive()
            if not self._closing.is_set():
                self._err = exc

    def _receive_from(self, i: int, incarnation: int) -> None:
        """Form producer ``i``'s pair group of ``incarnation``, then receive its frames until it goes away (a dead
        producer's heartbeat tells receive(); a newer incarnation gets a receiver of its own)."""
        key = (i, incarnation)
        self._arrived[key] = 0
        try:
            self._links[key] = link = _pair_group(
                self.host, self.port, 0, _prefix(self.run_id, i, incarnation), self._timeout
            )
            pg = link[1]
            while not self._closing.is_set():
                hdr = torch.zeros(1, dtype=torch.int64)
                pg.recv([hdr], 1, _TAG_LEN).wait()
                frame = torch.empty(int(hdr[0]), dtype=torch.uint8)
                pg.recv([frame], 1, _TAG_FRAME).wait()
                while not self._closing.is_set():
                    try:
                        self._inbox.put((i, frame), timeout=0.1)
                        self._arrived[key] += 1  # after the put: a closed producer's last frame is queued
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 - its process died or its link broke: the heartbeat reports it
            if not self._closing.is_set() and not self._master.check([f"closed/{i}/{incarnation}"]):
                self._stats["link_errors"] += 1  # counted and logged, named in the dead-peer report
                self._link_errors[key] = f"{type(exc).__name__}: {exc}"[:300]
                LOG.warning("torch_distributed producer %d (incarnation %d): link failed: %s", i, incarnation, exc)
        finally:
            if self._joined[i] != incarnation:  # superseded: let its group go
                self._links.pop(key, None)

    def producer_handle(self, i: int) -> DistProducerHandle:
        """Picklable handle for producer ``i`` (any incarnation of it)."""
        if not 0 <= i < self.n:
            raise MrlError(f"producer index {i} out of range 0..{self.n - 1}")
        return DistProducerHandle(self.host, self.port, i, self.n, self.run_id, self.config.to_dict())

    def _check_peers(self) -> None:
        now = time.monotonic()
        closed = 0
        for i in range(self.n):
            g = self._joined[i]
            if i in self._reported:
                if g <= self._reported[i]:
                    closed += 1
                    continue
                del self._reported[i]  # a restarted producer joined: watched again
                self._seen.pop(i, None)
            if g and self._master.check([f"closed/{i}/{g}"]):
                # it closed after sending this many frames: closed for us once they all arrived (the last ones
                # may still be on the wire when the flag is set, on a slow link for a while)
                if self._arrived.get((i, g), 0) >= int(self._master.get(f"closed/{i}/{g}")):
                    closed += 1
                continue
            if not self._master.check([f"hb/{i}"]):
                continue
            val = int(self._master.get(f"hb/{i}"))
            last = self._seen.get(i)
            if last is None or last[0] != val:
                self._seen[i] = (val, now)
            elif now - last[1] > self.config.heartbeat_timeout_s:
                self._reported[i] = g
                self._stats["dead_peers"] += 1
                err = self._link_errors.get((i, g))
                link = f"; its link failed: {err}" if err else ""
                raise PeerDeadError(
                    f"torch_distributed producer {i} is dead: heartbeat unchanged for {now - last[1]:.2f} s "
                    f"(heartbeat timeout {self.config.heartbeat_timeout_s:g} s: timeout_s across hosts){link}"
                )
        if closed == self.n and self._inbox.empty() and self._err is None:
            raise ChannelClosedError(f"all {self.n} torch_distributed producers closed")
        if self._err is not None:
            raise PeerDeadError(f"torch_distributed consumer: its store failed: {self._err}") from self._err

    def receive(self, timeout: float | None = None) -> Received:
        """Next frame from any producer; StageTimeoutError / PeerDeadError / FrameError as for ``shm``."""
        t, deadline = deadline_of(timeout, self.config.receive_timeout_s)
        t0 = time.perf_counter()
        try:
            src, frame = queue_get(self._inbox, deadline, self._check_peers, lambda: StageTimeoutError(
                f"torch_distributed consumer: no frame within {t} s ({sum(1 for g in self._joined if g)} of {self.n} "
                "producers attached)"))  # fmt: skip
        finally:
            self._stats["wait_s"] += time.perf_counter() - t0
        try:
            raw_floats: list[str] = []
            meta, batch = decode_frame(frame.numpy().data, raw_floats=raw_floats)
        except FrameError as exc:
            self._stats["corrupt"] += 1
            raise FrameError(f"torch_distributed producer {src}: frame dropped: {exc}") from None
        self._stats["fallbacks"] += self._codec.fallbacks_among(raw_floats)
        self._stats["frames"] += 1
        self._stats["bytes"] += frame.numel()
        self._stats["raw_bytes"] += sum(int(v.nbytes) for v in batch.values())
        return Received(meta, batch, frame.numel(), src)

    def stats(self) -> dict[str, float]:
        """Counters: frames, bytes, raw_bytes, corrupt, wait_s, dead_peers, rejoins, link_errors (receiver links
        that broke), queue_depth (always 0)."""
        return {**self._stats, "queue_depth": 0}

    def close(self, unlink: bool = True) -> None:
        """Stop receiving and drop the groups (nothing to unlink). The receiver threads get ``CLOSE_JOIN_S`` to
        leave (a producer that has gone away ends its thread's wait): a thread still inside a gloo or store call
        when the interpreter finalizes dies in ``pthread_exit`` while unwinding C++ frames, which aborts the
        process (seen with Ray's terminate handler in the trainer). One blocked on a live producer is abandoned
        (daemon thread) after that."""
        self._closing.set()
        deadline = time.monotonic() + CLOSE_JOIN_S
        for thread in (self._watcher, *self._receivers):
            thread.join(max(0.0, deadline - time.monotonic()))
        self._links.clear()


class DistProducerHandle:
    """Picklable reference to producer ``index`` (rank ``index + 1``)."""

    def __init__(self, host: str, port: int, index: int, n: int, run_id: str, config: dict[str, Any]) -> None:
        self.host, self.port, self.index, self.n, self.run_id, self.config = host, port, index, n, run_id, config

    def attach(self, timeout: float | None = None, codec: Any = None) -> DistProducer:
        """Join as the next incarnation of producer ``index`` (blocks until the consumer formed the pair group, at
        most ``timeout`` s)."""
        return DistProducer(self, CommConfig.from_dict(self.config), timeout, codec)


class DistProducer:
    """Sending end of the ``torch_distributed`` transport."""

    def __init__(self, h: DistProducerHandle, config: CommConfig, timeout: float | None, codec: Any = None) -> None:
        self.config = config
        self.index = h.index
        self.codec = codec if codec is not None else make_codec(config)
        t = timeout if timeout is not None else max(config.send_timeout_s, config.receive_timeout_s)
        import torch.distributed as dist

        self._store = dist.TCPStore(h.host, h.port, None, False, timeout=td(t))
        self.incarnation = int(self._store.add(f"join/{h.index}", 1))
        self._link = _pair_group(h.host, h.port, 1, _prefix(h.run_id, h.index, self.incarnation), t)
        self._pg = self._link[1]
        self._beats = 0
        self._sent = 0  # frames the sender thread handed to gloo
        self._err: BaseException | None = None
        self._outbox: queue.Queue = queue.Queue(maxsize=config.ring_slots)
        self._tx = threading.Thread(target=self._run, name=f"mrl-comm-dist{h.index}-tx", daemon=True)
        self._tx.start()
        self._hb = Heartbeat(self._beat, config.heartbeat_interval_s, f"mrl-comm-dist{h.index}-hb")

    def _beat(self) -> None:
        self._beats += 1
        self._store.set(f"hb/{self.index}", str(self._beats))

    def _run(self) -> None:
        pg = self._pg
        while True:
            item = self._outbox.get()
            if item is None:
                return
            hdr, frame = item
            try:
                w1 = pg.send([hdr], 0, _TAG_LEN)
                w2 = pg.send([frame], 0, _TAG_FRAME)
                w1.wait()
                w2.wait()
                self._sent += 1
            except BaseException as exc:  # reported by the next send()
                self._err = exc
                return
            finally:
                self._outbox.task_done()

    def send(self, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float | None = None) -> int:
        """Encode one frame and queue it for the sender thread; blocks up to ``timeout`` s when
        ``ring_slots`` frames are already waiting for the consumer (backpressure)."""
        if self._err is not None:
            raise PeerDeadError(f"torch_distributed producer {self.index}: sending failed: {self._err}")
        if self._pg is None:
            raise MrlError("send on a closed torch_distributed producer")
        t = self.config.send_timeout_s if timeout is None else timeout
        plan = FramePlan(batch, meta, self.codec, self.config.checksum)
        frame = torch.empty(plan.nbytes, dtype=torch.uint8)
        plan.write_into(frame.numpy().data)
        hdr = torch.tensor([plan.nbytes], dtype=torch.int64)
        try:
            self._outbox.put((hdr, frame), timeout=t)
        except queue.Full:
            raise StageTimeoutError(
                f"torch_distributed producer {self.index}: {self.config.ring_slots} frames unreceived for {t} s"
            ) from None
        return plan.nbytes

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued frame was taken by the consumer (at most ``timeout`` s)."""
        _, deadline = deadline_of(timeout, self.config.send_timeout_s)
        while self._outbox.unfinished_tasks and self._err is None and self._tx.is_alive():
            if time.monotonic() >= deadline:
                raise StageTimeoutError(f"torch_distributed producer {self.index}: flush timed out")
            time.sleep(0.005)

    def close(self, timeout: float = 10.0) -> None:
        """Flush (bounded), mark closed in the store and stop heartbeating."""
        if self._pg is None:
            return
        try:
            self.flush(timeout)
        finally:
            try:  # a sender thread stuck on a consumer that stopped receiving, or dead, leaves the outbox full
                self._outbox.put_nowait(None)
            except queue.Full:
                pass  # the thread is abandoned (daemon); its frames were not taken
            self._tx.join(timeout=1.0)
            self._hb.stop()
            # the frames handed to the wire by this incarnation (no one to tell when the consumer's store is gone)
            with contextlib.suppress(RuntimeError):
                self._store.set(f"closed/{self.index}/{self.incarnation}", str(self._sent))
            self._pg = None


def dist_factory(config: CommConfig, *, n_producers: int, run_id: str, codec: Any = None) -> DistConsumer:
    """Transport factory registered as ``torch_distributed``."""
    return DistConsumer(config, n_producers=n_producers, run_id=run_id, host=config.host, codec=codec)
