"""Lifetime of rollout worker processes, apart from the pool object so that nothing here keeps a pool (or the
trainer behind it) alive.

Workers start with SIGINT ignored (:func:`spawn_quiet`): Ctrl-C reaches the whole foreground process group, and
the trainer, not each worker, decides what happens (it stops them). They are forked where :func:`start_method`
finds that safe, inheriting the trainer's imports (seconds of one core on a small host), else spawned.
:func:`teardown` is the pool's ``weakref.finalize`` callback: it runs on ``close()``, when the pool is
garbage-collected, or at interpreter exit, whichever comes first, and only once. A worker still starting (not
ready) is terminated at once: it reads no stop request before its imports are done, and one torn down while it
unpickles its queues dies on their semaphores.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import signal
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("mrl_plugins.rollout")

# Engines declare whether their CPU worker may be forked (RolloutEngine.fork_safe): 'transformers', and 'vllm',
# which forks its own workers by default and whose in-process engine core starts only in the worker (measured here
# on 2 cores: a forked vLLM worker ready in 4.3 s, a spawned one in 14.0 s; spawned, most of the difference is
# importing torch, transformers and vLLM again). No worker is forked after a vLLM engine ran in the trainer (TRL's
# use_vllm=True colocate): a vLLM worker forked from there hung at its first request (measured).

#: seconds a ready worker gets to take its stop request and exit before it is terminated
STOP_GRACE_S = 1.0
#: seconds remote workers get to acknowledge their stop through the rendezvous store
REMOTE_GRACE_S = 10.0


@contextmanager
def signal_kept(sig: int, handler: Any = None) -> Iterator[None]:
    """``sig``'s handler as it was before the block once it ends (``handler``, when given, inside it: else whatever
    the block sets, e.g. ``ray.init``'s own); off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(sig)
    if handler is not None:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        signal.signal(sig, previous if previous is not None else signal.SIG_DFL)


def sigint_ignored() -> Any:
    """SIGINT ignored while a child starts (an ignored signal stays ignored across fork and exec, and Python then
    installs no KeyboardInterrupt handler in the child) or while the trainer shuts its stages down."""
    return signal_kept(signal.SIGINT, signal.SIG_IGN)


@contextmanager
def main_not_reimported() -> Iterator[None]:
    """Spawned workers need nothing from ``__main__``: do not re-run the user's script in them.

    ``multiprocessing`` spawn re-executes the main script in each child (unless it is guarded by
    ``if __name__ == "__main__"``); a training script that builds a trainer at top level would then
    build it again in every worker. Hiding ``__main__.__file__`` while starting the process skips that.
    """
    import sys

    main = sys.modules.get("__main__")
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if main is not None and k in main.__dict__}
    try:
        if main is not None and getattr(main, "__spec__", None) is None:
            main.__dict__.pop("__file__", None)
        yield
    finally:
        if main is not None:
            main.__dict__.update(saved)


def spawn_quiet(proc: Any) -> None:
    """``proc.start()`` with SIGINT ignored and SIGTERM at its default in the child (a forked child would otherwise
    inherit the trainer's SIGTERM handler, which the TRL adapter installs, and the pool's ``terminate()`` would not
    end it)."""
    with sigint_ignored(), signal_kept(signal.SIGTERM, signal.SIG_DFL), warnings.catch_warnings():
        # Python >= 3.12 warns on fork() in a process with threads; start_method forks only a worker that
        # never starts an OpenMP team or touches a device runtime, the parts that do not survive a fork
        warnings.filterwarnings(
            "ignore", message=r".*use of fork\(\) may lead to deadlocks", category=DeprecationWarning
        )
        proc.start()


def _fork_unsafe(device: str, threads: int | None, engine: Any) -> str | None:
    """Why a worker of this kind must not be forked from this process (None: it may)."""
    import sys

    if "fork" not in mp.get_all_start_methods():
        return "this platform has no fork"
    if str(device).split(":")[0] != "cpu":
        return f"worker device {device!r}: a CUDA / NPU runtime does not survive a fork"
    if threads != 1:
        return (
            f"worker threads {threads}: a forked child hangs in its first OpenMP region with more than one thread "
            f"once the trainer has used OpenMP (GNU libgomp, measured)"
        )
    if not engine.fork_safe:
        return f"rollout.engine {engine.name!r} is not registered as safe in a forked worker (fork_safe)"
    if any(m.startswith("vllm.v1.worker.") and m.endswith("_model_runner") for m in sys.modules):
        return "a vLLM engine ran in the trainer process (e.g. TRL's use_vllm=True): a vLLM worker forked from it hung"
    import torch

    if torch.cuda.is_initialized() or "torch_npu" in sys.modules:
        return "the trainer process has a device runtime (CUDA or torch_npu) loaded"
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return "the trainer process is part of a torch.distributed group (its threads and sockets)"
    return None


def start_method(asked: str, *, device: str, threads: int | None, engine: Any) -> tuple[str, str]:
    """``(method, why)`` for a local worker of ``engine`` (its :class:`~mrl_plugins.hookspecs.RolloutEngine`):
    ``rollout.start_method`` ``spawn`` / ``fork`` as asked (a fork that is unsafe here is a ConfigError naming the
    reason), ``auto``: fork where :func:`_fork_unsafe` finds nothing."""
    from mrl_plugins.errors import ConfigError

    if asked == "spawn":  # the value itself is validated with the config (RolloutConfig.validate)
        return "spawn", "asked"
    unsafe = _fork_unsafe(device, threads, engine)
    if asked == "fork" and unsafe:
        raise ConfigError(f"rollout.start_method 'fork' is unsafe here ({unsafe}); use start_method: spawn or auto")
    return ("spawn", unsafe) if unsafe else ("fork", "imports inherited from the trainer")


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
    close the queues and unlink the shared memory. ``lifetime``: the pool's ``remote`` slots, ready ``clock``, stop
    ``grace`` (s) and ``launcher`` (Ray's actors, closed once the remote workers took their stop), where it has
    them. Never raises: it also runs at interpreter exit."""
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
    launcher = lifetime.get("launcher")
    if launcher is not None:  # launcher 'ray': the actors (their work is stopped), the placement group, ray.init
        launcher.close()
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
            obj.close()  # a consumer unlinks its shared memory by default
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
