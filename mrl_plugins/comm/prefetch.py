"""Receive batch k+1 in a background thread while the caller computes on batch k."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

from mrl_plugins.errors import MrlError, StageTimeoutError

from .base import Received


class Prefetcher:
    """Keeps up to ``depth`` received batches ready, copied out of the transport buffer.

    The thread copies each batch (:meth:`Received.detach`) and releases the ring slot at once, so
    the producers are never held up by batches waiting here. Errors of the consumer (a dead
    producer, a corrupted frame) are re-raised by the next :meth:`get`, in order.

    :param consumer: any transport consumer (``receive(timeout) -> Received``).
    :param depth: batches held ready (>= 1).
    :param poll_s: receive timeout per attempt of the thread (bounds how long :meth:`stop` waits).
    """

    def __init__(self, consumer: Any, depth: int = 1, poll_s: float = 0.1) -> None:
        if depth < 1:
            raise MrlError(f"prefetch depth must be >= 1, got {depth}")
        self.consumer = consumer
        self.depth = depth
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._poll = poll_s
        self.received = 0
        self._thread = threading.Thread(target=self._run, name="mrl-comm-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                item: Any = self.consumer.receive(timeout=self._poll).detach()
            except StageTimeoutError as exc:
                if type(exc) is StageTimeoutError:
                    continue  # plain poll timeout: try again
                item = exc
            except Exception as exc:  # handed to the caller by get()
                item = exc
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=self._poll)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Received):
                self.received += 1

    def get(self, timeout: float | None = None) -> Received:
        """Next batch (owned tensors); raises StageTimeoutError after ``timeout`` s, or the consumer's error."""
        if self._stop.is_set():
            raise MrlError("prefetcher is stopped")
        t = 60.0 if timeout is None else timeout
        try:
            item = self._q.get(timeout=t)
        except queue.Empty:
            raise StageTimeoutError(f"prefetch: no batch within {t} s") from None
        if isinstance(item, BaseException):
            raise item
        return item

    def ready(self) -> int:
        """Batches waiting in the prefetch buffer."""
        return self._q.qsize()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (waits at most ``timeout`` s) and drop what it holds."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
