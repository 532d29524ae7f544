"""What ``enable()`` does to the trainer and the process over time (used by :mod:`mrl_plugins.adapters.trl`).

- Every attribute ``enable()`` sets on the trainer is recorded (:meth:`State.patch`) so that ``disable()`` and a
  second ``enable()`` on the same trainer put the originals back.
- Process-wide state -- the CPU affinity and torch thread count of the trainer's budget, SIGTERM/SIGINT
  handling -- is changed only while ``train()`` runs and restored when it returns or raises
  (:func:`train_process_state`); a trainer built and never trained changes nothing.
- The rollout workers and their shared memory start when ``train()`` begins (or at the first generation) and are
  released when it ends, when ``disable()`` is called, when the trainer is garbage-collected or at exit (the
  pool's finalizer). Only one enabled trainer per process holds live workers: enabling or training another one
  stops the previous one's pool (it restarts if that trainer is used again).
- Ctrl-C during ``train()`` stops the workers and exits 130 with one line (outside interactive sessions, where
  ``KeyboardInterrupt`` propagates); SIGTERM stops them and exits 143 (or calls a previously installed handler).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

from mrl_plugins.errors import PluginError
from mrl_plugins.rollout.lifecycle import sigint_ignored

_MISSING = object()


class State:
    """The plugins' state on one trainer (``trainer._mrl_state``)."""

    #: every enabled trainer's state in this process (weak): at most one of them holds a live worker pool
    live: ClassVar[weakref.WeakSet[State]] = weakref.WeakSet()

    def __init__(self, pm: Any, ctx: Any, kind: str) -> None:
        self.pm = pm
        self.ctx = ctx
        self.kind = kind
        self.closed = False
        self.on_shutdown: list[Any] = []
        self.budget: tuple[list[int], int] | None = None  # (trainer cores, torch threads) while train() runs
        self.has_workers = False  # rollout worker processes (a pool) rather than none or an in-process engine
        self.shadow: Any = None  # adapters.trl_shadow.ShadowLookahead: the next batch's rollout run ahead
        self.fixed_by: str | None = None  # why the rollout keeps its split (None: placement auto decides)
        self._patches: list[tuple[Any, str, Any]] = []
        #: the rollout stage's runtime (``RolloutStage.open_runtime``), owned and closed by this state
        self.runtime: Any = None
        State.live.add(self)

    # ------------------------------------------------------------------ trainer attributes
    def patch(self, obj: Any, name: str, value: Any) -> None:
        """``setattr(obj, name, value)``, remembering what was there (an instance attribute or none)."""
        self._patches.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, value)

    def restore_patches(self) -> None:
        while self._patches:
            obj, name, old = self._patches.pop()
            if old is _MISSING:
                obj.__dict__.pop(name, None)
            else:
                setattr(obj, name, old)

    # ------------------------------------------------------------------ worker pool
    def start(self) -> None:
        """Start the rollout workers (spawn, shared memory), stopping any other trainer's first."""
        self.release_others()
        start = getattr(self.runtime, "start", None)
        if start is not None:
            start()

    def release_others(self) -> None:
        """Release every other live trainer's worker pool (one per process)."""
        for other in list(State.live):
            if other is not self:
                other.release_pool()

    def close_shadow(self) -> None:
        """No batch rolls out ahead any more (before the workers go)."""
        if self.shadow is not None:
            self.shadow.close()

    def release_pool(self) -> None:
        """Stop this trainer's workers and free their shared memory; they restart on the next use."""
        self.close_shadow()
        release = getattr(self.runtime, "release", None)
        if release is not None:
            release()

    def shutdown(self, reason: str = "normal") -> None:
        if self.closed:
            return
        self.closed = True
        State.live.discard(self)
        runtime, self.runtime = self.runtime, None
        self.close_shadow()
        try:
            try:
                if runtime is not None:
                    runtime.close()  # the rollout stage's runtime and the ends it opened
            finally:
                self.pm.shutdown(self.ctx, reason)
        finally:
            while self.on_shutdown:
                self.on_shutdown.pop()()


def _interactive() -> bool:
    return bool(hasattr(sys, "ps1") or sys.flags.interactive or "ipykernel" in sys.modules)


@contextlib.contextmanager
def train_process_state(state: State) -> Iterator[dict]:
    """The trainer's CPU budget and the SIGTERM handler, for the duration of ``train()`` only.

    Yields a dict where the SIGTERM handler records the signal it got (``"signal"``)."""
    got: dict[str, Any] = {}
    saved_affinity = saved_threads = None
    if state.budget is not None:
        import torch

        cores, threads = state.budget
        saved_affinity, saved_threads = os.sched_getaffinity(0), torch.get_num_threads()
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    installed: list[tuple[int, Any, Any]] = []
    main = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
    if main:
        previous = saved[signal.SIGTERM]
        if previous is not signal.SIG_IGN:

            def on_sigterm(signum: int, frame: Any, previous: Any = previous) -> None:
                got["signal"] = signum
                if callable(previous):  # someone else's handler: release first, then let it decide
                    with sigint_ignored():
                        state.shutdown("signal")
                    previous(signum, frame)
                    return
                raise SystemExit(128 + signum)  # train() releases everything on the way out

            signal.signal(signal.SIGTERM, on_sigterm)
            installed.append((signal.SIGTERM, on_sigterm, previous))
    try:
        yield got
    finally:
        # ours, and those the shared-memory modules install when their first segment is made, go; a handler
        # someone else installed meanwhile stays
        ours = {handler for _, handler, _ in installed}
        for sig, before in saved.items():
            now = signal.getsignal(sig)
            if now is not before and (now in ours or getattr(now, "__module__", "").startswith("mrl_plugins")):
                signal.signal(sig, before if before is not None else signal.SIG_DFL)
        if main:
            from mrl_plugins import shmem

            shmem.forget_signal_handlers()  # they chained to ours, which holds this trainer
        if saved_affinity is not None:
            import torch

            os.sched_setaffinity(0, saved_affinity)
            torch.set_num_threads(saved_threads)


def wrap_train(trainer: Any, state: State) -> None:
    """``trainer.train`` starts the workers, holds the process budget and signal handling while TRL trains, and
    shuts the plugins down when it ends (normally, by an error, Ctrl-C or SIGTERM)."""
    orig_train = trainer.train

    def train(*args: Any, **kwargs: Any) -> Any:
        if state.closed:
            raise PluginError(
                "mrl_plugins: this trainer's plugins were shut down when its first train() ended (or by disable()); "
                "call mrl_plugins.enable(trainer, config) again to train it again"
            )
        reason = "error"
        with train_process_state(state) as got:
            try:
                state.start()
                out = orig_train(*args, **kwargs)
                reason = "normal"
                return out
            except KeyboardInterrupt:
                reason = "interrupt"
                with sigint_ignored():
                    state.shutdown(reason)
                if _interactive():
                    raise
                print(f"mrl-plugins: interrupted (Ctrl-C) {_where(trainer)}; {_released(state)}", file=sys.stderr)
                raise SystemExit(130) from None
            except SystemExit:
                if "signal" in got:
                    reason = "signal"
                    with sigint_ignored():
                        state.shutdown(reason)
                    name = signal.Signals(got["signal"]).name
                    print(f"mrl-plugins: stopped by {name} {_where(trainer)}; {_released(state)}", file=sys.stderr)
                raise
            finally:
                with sigint_ignored():
                    state.shutdown(reason)

    state.patch(trainer, "train", train)


def _where(trainer: Any) -> str:
    st = getattr(trainer, "state", None)
    step, total = getattr(st, "global_step", 0), getattr(st, "max_steps", 0)
    return f"at step {step}/{total}" if total else f"at step {step}"


def _released(state: State) -> str:
    return "rollout workers stopped, shared memory released" if state.has_workers else "plugins shut down"


def at_exit(ref: weakref.ref) -> None:
    st = ref()
    if st is not None:
        st.shutdown("exit")
