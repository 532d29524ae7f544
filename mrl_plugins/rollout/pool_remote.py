"""The worker pool's remote workers (``rollout.remote_workers``): each is watched through the rendezvous store
(:class:`~mrl_plugins.rollout.remote.RemoteSlots`) and, with ``rollout.launcher: ray``, through Ray
(:class:`~mrl_plugins.rollout.ray_launcher.RayLauncher`); a restarted process that joins takes over its
predecessor's work. A mixin of :class:`~mrl_plugins.rollout.pool.WorkerPool`, apart to keep that module small."""

from __future__ import annotations

import logging
from typing import Any

from .pool_checks import WorkerDiedError

log = logging.getLogger("mrl_plugins.rollout")


class RemoteWorkers:
    """``_check_remote`` / ``_rejoin`` of :class:`~mrl_plugins.rollout.pool.WorkerPool` (its state is the pool's)."""

    remote: Any
    launcher: Any
    cfg: Any
    ctx: Any

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
