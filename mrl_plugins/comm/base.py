"""Pieces shared by the experience transports: errors, received batches, heartbeats, waiting."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mrl_plugins._proc import pid_alive  # noqa: F401 - re-exported for the comm transports
from mrl_plugins.errors import MrlError, StageTimeoutError


class PeerDeadError(StageTimeoutError):
    """The process at the other end stopped heartbeating (killed, crashed or hung)."""


class ChannelClosedError(MrlError):
    """Every producer closed its end and all their frames were received."""


@dataclass(slots=True, eq=False)
class Received:
    """One received batch: ``meta`` (dict), ``batch`` (field -> tensor/array), ``nbytes`` (frame bytes).

    For the shared-memory ring, raw fields of ``batch`` are zero-copy views into the ring, valid
    until :meth:`release` (also called on leaving a ``with`` block); copy what you keep longer (:func:`owned`).
    """

    meta: dict[str, Any]
    batch: dict[str, Any]
    nbytes: int
    producer: int = 0
    _release: Callable[[], None] | None = None

    def release(self) -> None:
        """Give the ring slot back to the producer (idempotent)."""
        rel, self._release = self._release, None
        if rel is not None:
            rel()

    @property
    def released(self) -> bool:
        """Whether the slot was given back."""
        return self._release is None

    def __enter__(self) -> Received:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Received(meta={self.meta!r}, fields={list(self.batch)}, nbytes={self.nbytes})"


def owned(v: Any) -> Any:
    """``v`` as a value that outlives the transport buffer it was decoded from, with one copy at most.

    Decoded raw fields are views on the buffer (a tensor with ``_base`` set, a numpy array with ``base``): they
    are copied once. Cast (fp16 -> fp32) and bit-unpacked fields were built by the decoder and are returned as
    they are. A third-party consumer keeps to the same rule: fields aliasing its buffer are views."""
    if isinstance(v, torch.Tensor):
        return v.clone() if v._base is not None else v
    if isinstance(v, np.ndarray):
        return v.copy() if v.base is not None else v
    return v


class Heartbeat:
    """A daemon thread calling ``beat()`` every ``interval`` seconds until :meth:`stop`, or until a beat fails: the
    mapping was closed under it, or the peer's store is gone with the peer (torch's store errors are RuntimeErrors).
    Nobody is left to read the beats then; the transfer itself reports the dead peer."""

    def __init__(self, beat: Callable[[], None], interval: float, name: str) -> None:
        self._beat = beat
        self._interval = interval
        self._stop = threading.Event()
        beat()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except (ValueError, OSError, BufferError, RuntimeError):
                return

    def stop(self) -> None:
        """Stop beating (waits at most two intervals for the thread)."""
        self._stop.set()
        self._thread.join(timeout=2 * self._interval + 1.0)


def deadline_of(timeout: float | None, default: float) -> tuple[float, float]:
    """``(seconds, absolute monotonic deadline)`` for ``timeout`` (``None`` -> ``default``)."""
    t = default if timeout is None else timeout
    return t, time.monotonic() + max(0.0, float(t))


def queue_get(q: Any, deadline: float, check: Callable[[], None], timeout_error: Callable[[], Exception]) -> Any:
    """``q.get()`` (a ``queue.Queue`` or ``multiprocessing.Queue``) in steps of at most 50 ms, calling ``check()``
    (the peers' liveness; it raises) between them; ``timeout_error()`` is raised at ``deadline``."""
    while True:
        try:
            return q.get(timeout=max(0.0, min(0.05, deadline - time.monotonic())))
        except queue.Empty:
            pass
        check()
        if time.monotonic() >= deadline:
            raise timeout_error()
