"""Lifetime of rollout worker processes, apart from the pool object so that nothing here keeps a pool (or the
trainer behind it) alive.

- :func:`spawn_quiet` starts a process with SIGINT ignored: Ctrl-C reaches the whole foreground process group,
  and the trainer, not each worker, decides what happens (it stops them).
- :class:`ReadyClock` records when every worker of a pool was first ready (``mrl/rollout/worker_ready_s``).
- :func:`teardown` releases a pool's processes, queues and shared memory. It is the pool's ``weakref.finalize``
  callback, so it runs on ``close()``, when the pool is garbage-collected, or at interpreter exit, whichever comes
  first, and only once. A worker still starting (not ready) is terminated at once: it reads no stop request
  before its imports are done, and one torn down while it unpickles its queues dies on their semaphores.
"""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("mrl_plugins.rollout")

#: seconds a ready worker gets to take its stop request and exit before it is terminated
STOP_GRACE_S = 1.0
#: seconds remote workers get to acknowledge their stop through the rendezvous store
REMOTE_GRACE_S = 10.0


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a child is spawned (an ignored signal stays ignored across exec, and Python then
    installs no KeyboardInterrupt handler in the child). Off the main thread nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)


def spawn_quiet(proc: Any) -> None:
    """``proc.start()`` with SIGINT ignored in the child."""
    with sigint_ignored():
        proc.start()


class ReadyClock:
    """Seconds from a pool's start until every worker's ready event was set (first time only).

    A daemon thread waits on the events; it holds the list of events (which the pool updates in place on
    restarts), never the pool."""

    def __init__(self, events: list[Any], timeout: float) -> None:
        self.started = time.monotonic()
        self.ready_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(events, timeout), name="mrl-ready", daemon=True)
        self._thread.start()

    def _watch(self, events: list[Any], timeout: float) -> None:
        deadline = self.started + timeout
        while not self._stop.is_set() and time.monotonic() < deadline:
            if all(e.is_set() for e in list(events)):
                self.ready_s = time.monotonic() - self.started
                return
            waiting = next((e for e in list(events) if not e.is_set()), None)
            if hasattr(waiting, "wait"):
                waiting.wait(0.05)
            else:  # a remote worker's flag in the rendezvous store
                time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()


def teardown(
    procs: list[Any],
    ready: list[Any],
    requests: list[Any],
    queues: list[Any],
    channels: list[Any],
    lifetime: dict[str, Any],
    stop: Any,
) -> None:
    """Stop the workers (a stop request; terminate after :data:`STOP_GRACE_S`, or at once while starting), then
    close the queues and unlink the shared memory. ``lifetime``: the pool's ``remote`` slots, ready ``clock`` and
    stop ``grace`` (s), where it has them. Never raises: it also runs at interpreter exit."""
    remote, clock = lifetime.get("remote"), lifetime.get("clock")
    if clock is not None:
        clock.stop()
    for q in requests:
        try:
            q.put(stop)  # unbounded (multiprocessing) or a rendezvous-store queue (remote workers): no waiting
        except Exception:  # noqa: BLE001 - closed or broken: the process is terminated below
            pass
    if remote is not None:  # let remote workers take their stop before the store goes away
        try:
            remote.wait_stopped(time.monotonic() + REMOTE_GRACE_S)
        except Exception:  # noqa: BLE001
            pass
    deadline = time.monotonic() + lifetime.get("grace", STOP_GRACE_S)
    for i, proc in enumerate(procs):
        if proc is None or proc.pid is None:
            continue
        try:
            if i >= len(ready) or not ready[i].is_set():
                proc.terminate()  # still starting: it would read the stop request only after its imports
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        except Exception:  # noqa: BLE001 - keep releasing the rest
            log.debug("rollout worker %d: stop failed", i, exc_info=True)
    for q in [*requests, *queues]:
        for method in ("cancel_join_thread", "close"):  # the reader is gone: do not wait for buffered items
            try:
                getattr(q, method, lambda: None)()
            except Exception:  # noqa: BLE001
                pass
    for obj in channels:
        try:
            try:
                obj.close(unlink=True)
            except TypeError:
                obj.close()
        except Exception:  # noqa: BLE001
            log.debug("closing %r failed", obj, exc_info=True)


def finalizer(owner: Any, *args: Any) -> weakref.finalize:
    """``weakref.finalize(owner, teardown, *args)``, run at exit before ``multiprocessing``'s own exit handler
    (which unlinks the queues' semaphores: a worker still starting would then fail to unpickle them)."""
    fin = weakref.finalize(owner, teardown, *args)
    fin.atexit = False
    atexit.register(fin)  # registered after multiprocessing's handler, so it runs before it
    return fin


def release(fin: weakref.finalize) -> None:
    """Run ``fin`` now (once) and drop its exit registration."""
    fin()
    atexit.unregister(fin)
