"""Dead and restarted workers of the worker pool: whether a new process can take a worker's place (its ends are
rejoinable), handing it its predecessor's unanswered chunks, and the remote workers (``rollout.remote_workers``),
watched through the rendezvous store (:class:`~mrl_plugins.rollout.remote.RemoteSlots`) and, with
``rollout.ray_address``, through Ray (:class:`~mrl_plugins.rollout.ray_launcher.RayLauncher`), whose restarted
processes join as new incarnations; and waiting for workers still starting (:meth:`Restarts.wait_ready`). A mixin
of :class:`~mrl_plugins.rollout.pool.WorkerPool`, apart to keep that module small."""

from __future__ import annotations

import logging
import time
from typing import Any

from mrl_plugins.errors import StageTimeoutError

from .pool_checks import WorkerDiedError, no_rejoin

log = logging.getLogger("mrl_plugins.rollout")


class Restarts:
    """Restart and remote-worker methods of :class:`~mrl_plugins.rollout.pool.WorkerPool` (its state is the
    pool's)."""

    remote: Any
    launcher: Any
    cfg: Any
    ctx: Any
    started_at: float
    _ready: list[Any]

    def wait_ready(self, progress: Any = None, *, first: float = 1.0, every: float = 5.0) -> float:
        """Block until every worker is ready, at most ``rollout.start_timeout_s`` from the pool's start (a worker
        that fails meanwhile raises as in :meth:`collect`); ``progress(seconds since the start)`` after ``first`` s
        of waiting, then every ``every`` s. Returns the seconds waited."""
        start = time.monotonic()
        deadline, note = self.started_at + self.cfg.rollout.start_timeout_s, start + first
        while not self.ready:
            self._check_workers()
            now = time.monotonic()
            if now >= deadline:
                raise StageTimeoutError(
                    f"rollout: the workers were not ready {now - self.started_at:.0f} s after they started "
                    f"(the start bound {self.cfg.rollout.start_timeout_s:g} s = max(1.5 x timeout_s, the engine's "
                    "start)); raise timeout_s or look at the worker log for what the start is waiting on"
                )
            if progress is not None and now >= note:
                progress(now - self.started_at)
                note = now + every
            self._drain_events()
            waiting = next(e for e in self._ready if not e.is_set())
            waiting.wait(0.2) if hasattr(waiting, "wait") else time.sleep(0.2)
        return time.monotonic() - start

    def _check_remote(self, i: int) -> None:
        """Remote worker ``i``: a restarted process that joined takes over its work; a dead one is an error (with
        launcher 'ray', as Ray sees it: dead, restarting, or its node lost)."""
        incarnation = self.remote.rejoined(i)
        if incarnation is not None:
            self._rejoin(i, incarnation)
        if self.launcher is not None:
            why = self.launcher.check(i, self.remote.silent_s(i), self.remote.joined(i) >= self.remote.incarnation[i])
            if why is not None:
                raise WorkerDiedError(why)
            return
        why = self.remote.check_alive(i, self._ready[i].is_set())
        if why is not None:
            raise WorkerDiedError(
                f"{why} (the trainer does not restart remote workers: `mrl worker` started again within "
                "rollout.timeout_s rejoins, where the transports are rejoinable and rollout.restart_workers allows)"
            )

    def _rejoin(self, i: int, incarnation: int) -> None:
        """A new process joined as remote worker ``i`` (Ray restarted its actor, or `mrl worker` was started again):
        it gets the requests its predecessor left unanswered; the restart is counted."""
        why = self._not_rejoinable()
        if why is None and self._restarts >= self.cfg.rollout.restart_workers:
            why = f"rollout.restart_workers ({self.cfg.rollout.restart_workers}) restarts are used up"
        if why is not None:
            raise WorkerDiedError(f"rollout worker {i} was restarted (a new process joined) but cannot rejoin: {why}")
        self._restarts += 1
        self.ctx.metrics.add("rollout/worker_restarts", 1) if self.ctx.metrics else None
        log.warning("rollout worker %d: a restarted process (incarnation %d) rejoined the pool", i, incarnation)
        self._requests[i], self._ready[i] = self.remote.rejoin(i, incarnation)
        if self.launcher is not None:
            self.launcher.rejoined(i)
        for mid in self.models:
            self._versions.pop((i, mid), None)
        for key in [k for k in self._assigned[i] if k[0] not in self._tickets]:  # answers nobody waits for
            self._assigned[i].discard(key)
            self._finish(key)
        self._resubmit_worker(i)

    def _not_rejoinable(self) -> str | None:
        """Why a worker cannot be replaced by a new process (its ends are not rejoinable), or None."""
        for ends, caps, what in (
            ([*self.senders.values()], self._ws_caps, self._names[1]),
            ([self.consumer], self._comm_caps, self._names[0]),
        ):
            if not all(getattr(e, "capabilities", caps).rejoinable for e in ends):
                return no_rejoin(what)
        return None

    def _resubmit_worker(self, i: int) -> None:
        """A restarted worker ``i`` gets the chunks its predecessor had not answered (an answer already received,
        waiting in the stash, is not generated again)."""
        for t in self._tickets.values():
            for chunk, (worker, prompts) in t.chunks.items():
                if worker == i and chunk not in t.results and (t.req_id, chunk) not in self._stash:
                    self._send(i, t, chunk, prompts)
