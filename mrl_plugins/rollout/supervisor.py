"""The rollout workers as processes: :class:`WorkerSupervisor` starts, watches, restarts, moves and stops them for
a :class:`~mrl_plugins.rollout.pool.WorkerPool`, which routes requests to them.

It owns every worker's spec, request queue and ready flag, the local processes (forked or spawned on their cores,
:func:`~mrl_plugins.rollout.lifecycle.start_method`), the remote workers' slots in the rendezvous store
(:class:`~mrl_plugins.rollout.remote.RemoteSlots`) and, with ``rollout.ray_address``, the Ray actors that run them
(:class:`~mrl_plugins.rollout.ray_launcher.RayLauncher`), the error and event queues, the restart budget
(``rollout.restart_workers``) and the finalizer that releases all of it on ``close()``, garbage collection or exit.

Invariants: worker ``i``'s request queue is ``requests[i]`` (a new one for every new local process: one killed
inside ``Queue.get()`` keeps the old queue's reader lock); a worker in ``draining`` takes no new request (it is
moving); a dead worker is replaced only where every end the pool opened is rejoinable (``no_rejoin`` is None) and
restarts are left (:meth:`why_no_restart`), else :meth:`check` raises :class:`WorkerDiedError` naming it.
:meth:`check` returns the workers that got a new process, whose unanswered requests the pool hands to them again.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import queue
import time
from typing import Any

from mrl_plugins.errors import StageTimeoutError

from .lifecycle import ReadyClock, finalizer, main_not_reimported, release, spawn_quiet, start_method
from .pool_checks import WorkerDiedError
from .wire import STOP, WorkerError
from .worker import worker_main

log = logging.getLogger("mrl_plugins.rollout")


class WorkerSupervisor:
    """``len(placements)`` local and ``rollout.remote_workers`` remote workers (see the module docstring), built in
    two steps: the constructor refuses an unsafe fork and reserves the Ray cluster (nothing else is open yet);
    :meth:`launch` starts the workers once the pool has opened its ends."""

    def __init__(self, ctx: Any, engine: Any, placements: list[dict], *, rejoinable_ends: bool) -> None:
        cfg = ctx.config
        self.ctx, self.cfg, self._engine = ctx, cfg, engine
        self.started_at = time.monotonic()
        self.n_local, n_remote = len(placements), cfg.rollout.remote_workers
        self.n = self.n_local + n_remote
        self._mp = mp.get_context("spawn")
        for place in placements:  # an unsafe rollout.start_method 'fork' is refused before anything opens
            threads = place.get("threads", cfg.rollout.engine_threads)
            start_method(cfg.rollout.start_method, device=place.get("device", "cpu"), threads=threads, engine=engine)
        self.launcher: Any = None  # rollout.ray_address: the cluster's actors that run the remote workers
        if n_remote and cfg.rollout.launch == "ray":  # the cluster and its reservation first
            from .ray_launcher import RayLauncher

            self.launcher = RayLauncher(cfg, range(self.n_local, self.n), rejoinable_ends)
        self.no_rejoin: str | None = None  # why a new process cannot take a worker's place (set by the pool)
        self.specs: list[Any] = []
        self.requests: list[Any] = []
        self.ready_events: list[Any] = []
        self.procs: list[Any] = []
        self.remote: Any = None
        self.draining: set[int] = set()  # moving workers: no new requests
        self._moving: dict[int, tuple[float, float, dict]] = {}  # worker -> (deadline, timeout, placement)
        self.restarts = 0
        self._errors = self._mp.Queue()
        self._events = self._mp.Queue()
        self._error_qs, self.event_qs = [self._errors], [self._events]
        self._clock: ReadyClock | None = None
        self._lifetime: dict[str, Any] = {}  # the remote slots, the launcher, the ready clock: for the finalizer
        self._finalizer: Any = None
        self._all_joined = False  # every remote worker started by hand connected at least once

    def abort(self) -> None:
        """The pool failed before :meth:`launch`: release what the constructor reserved."""
        if self.launcher is not None:
            self.launcher.close()

    def launch(self, specs: list[Any], channels: list[Any]) -> None:
        """Start every worker of ``specs`` (the local ones as processes; the remote ones offered in the rendezvous
        store, started by Ray or by hand) and arm the finalizer, which also closes ``channels`` (the pool's
        ends). Raises after releasing everything when a start fails."""
        cfg = self.cfg
        self._finalizer = finalizer(
            self, self.procs, self.ready_events, self.requests, [*self._error_qs, *self.event_qs],
            list(channels), self._lifetime, STOP,
        )  # fmt: skip
        if self.launcher is not None:
            self._lifetime["launcher"] = self.launcher
        try:
            if self.n > self.n_local:  # the rendezvous store (its port may be taken: released like the rest)
                from .remote import RemoteSlots

                self.remote = RemoteSlots(
                    cfg.rollout.rendezvous, self.n_local, self.n - self.n_local, cfg.rollout.timeout_s
                )
                self._lifetime["remote"] = self.remote
            for i, spec in enumerate(specs):
                self.specs.append(spec)
                self.procs.append(None)
                if i >= self.n_local:
                    requests, errors, events, ready = self.remote.offer(i, spec)
                    self.requests.append(requests)
                    self._error_qs.append(errors)
                    self.event_qs.append(events)
                    self.ready_events.append(ready)
                    if self.launcher is None:  # started by hand: say how, visible under any logging setup
                        log.warning("rollout worker %d: waiting for `%s` on its host", i, self.worker_command(i))
                    continue
                self.requests.append(self._mp.Queue())
                self._start(i)
            if self.launcher is not None:
                self.launcher.start(self.remote.address)  # each remote worker: `mrl worker --connect` in a Ray actor
        except BaseException:
            release(self._finalizer)
            raise
        self._clock = self._lifetime["clock"] = ReadyClock(self.ready_events, cfg.rollout.start_timeout_s)

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        """Every worker has built its engine and attached its weight and experience paths."""
        return all(e.is_set() for e in self.ready_events)

    @property
    def ready_s(self) -> float | None:
        """Seconds from the start until every worker was first ready (None: not yet)."""
        return self._clock.ready_s if self._clock is not None else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p is not None]

    @property
    def active(self) -> list[int]:
        """The workers that take new requests (all but the moving ones)."""
        return [w for w in range(self.n) if w not in self.draining]

    def worker_command(self, i: int) -> str:
        """The command that starts remote worker ``i`` by hand on its host."""
        return f"mrl worker --connect {self.remote.address} --index {i}"

    # ------------------------------------------------------------------ processes
    def _start(self, i: int) -> None:
        spec = self.specs[i]
        method, why = start_method(
            self.cfg.rollout.start_method, device=spec.device, threads=spec.threads, engine=self._engine
        )
        ready = self._mp.Event()  # in place: the finalizer and the ready clock hold this list
        if i < len(self.ready_events):
            self.ready_events[i] = ready
        else:
            self.ready_events.append(ready)
        proc = mp.get_context(method).Process(
            target=worker_main,
            args=(spec, self.requests[i], self._errors, os.getpid(), ready, self._events),
            name=f"mrl-rollout-{i}",
            daemon=True,
        )
        with main_not_reimported():
            spawn_quiet(proc)  # SIGINT ignored (the trainer stops its workers), SIGTERM at its default
        self.procs[i] = proc
        log.info("rollout worker %d started (pid %d, cores %s, %s: %s)", i, proc.pid, spec.cores, method, why)

    def _fresh_queue(self, i: int) -> None:
        """A new process gets a new request queue: one killed inside ``Queue.get()`` keeps the old queue's reader
        lock forever, and the old queue may hold requests already handed to other workers."""
        old = self.requests[i]
        old.cancel_join_thread()
        old.close()
        self.requests[i] = self._mp.Queue()

    def check(self) -> list[int]:
        """Raise :class:`WorkerDiedError` for a worker that failed or died and cannot be replaced; replace the
        others (restarted local processes, remote ones that rejoined). Returns the workers with a new process."""
        for q in self._error_qs:
            try:
                err: WorkerError = q.get_nowait()
            except queue.Empty:
                continue
            raise WorkerDiedError(f"rollout worker {err.worker} failed: {err.text}")
        self.check_joined()
        fresh = [i for i in (self.remote.indices if self.remote is not None else ()) if self._check_remote(i)]
        for i, proc in enumerate(self.procs):
            if proc is None or proc.is_alive():
                continue
            why = self.why_no_restart()
            if why is not None:
                raise WorkerDiedError(
                    f"rollout worker {i} (pid {proc.pid}) died with exit code {proc.exitcode}; it is not "
                    f"restarted: {why}"
                )
            self._count_restart()
            log.warning("rollout worker %d died (exit %s): restarting", i, proc.exitcode)
            self._fresh_queue(i)
            self._start(i)
            fresh.append(i)
        return fresh

    def why_no_restart(self) -> str | None:
        """Why no new process may take a dead worker's place now (None: one may): ends that are not rejoinable,
        or the restart budget (``rollout.restart_workers``) off or spent."""
        if self.no_rejoin is not None:
            return self.no_rejoin
        budget = self.cfg.rollout.restart_workers
        if budget == 0:
            return "set rollout.restart_workers > 0 to restart dead workers"
        if self.restarts >= budget:
            return f"the restart budget is spent ({self.restarts} of rollout.restart_workers {budget} used)"
        return None

    def _count_restart(self) -> None:
        self.restarts += 1
        self.ctx.metrics.add("rollout/worker_restarts", 1)

    def check_joined(self, waited: float | None = None) -> None:
        """Remote workers started by hand that never connected within ``rollout.start_timeout_s`` of the start (or
        during a wait of ``waited`` s on them that timed out, e.g. a collective weight publish): one
        StageTimeoutError naming the command for each (Ray's launcher reports its own actors)."""
        bound = self.cfg.rollout.start_timeout_s if waited is None else waited
        if self.remote is None or self.launcher is not None or self._all_joined:
            return
        if waited is None and time.monotonic() - self.started_at < bound:
            return
        missing = [i for i in self.remote.indices if self.remote.joined(i) == 0]
        self._all_joined = not missing
        if missing:
            run = "; ".join(f"`{self.worker_command(i)}`" for i in missing)
            raise StageTimeoutError(
                f"rollout: remote worker(s) {missing} never connected within {bound:.0f} s"
                f"{' (the start bound)' if waited is None else ''}: run {run} on its host"
            )

    def _check_remote(self, i: int) -> bool:
        """Remote worker ``i``: a restarted process that joined takes over its work (True); a dead one is an error
        (with Ray, as Ray sees it: dead, restarting, or its node lost)."""
        incarnation = self.remote.rejoined(i)
        if incarnation is not None:
            self._rejoin(i, incarnation)
        if self.launcher is not None:
            why = self.launcher.check(i, self.remote.silent_s(i), self.remote.joined(i) >= self.remote.incarnation[i])
            if why is not None:
                raise WorkerDiedError(why)
            return incarnation is not None
        why = self.remote.check_alive(i, self.ready_events[i].is_set())
        if why is not None:
            raise WorkerDiedError(
                f"{why} (the trainer does not restart remote workers: `mrl worker` started again within "
                "rollout.timeout_s rejoins, where the transports are rejoinable and rollout.restart_workers allows)"
            )
        return incarnation is not None

    def _rejoin(self, i: int, incarnation: int) -> None:
        """A new process joined as remote worker ``i`` (Ray restarted its actor, or `mrl worker` was started again);
        the restart is counted."""
        why = self.why_no_restart()
        if why is not None:
            raise WorkerDiedError(f"rollout worker {i} was restarted (a new process joined) but cannot rejoin: {why}")
        self._count_restart()
        log.warning("rollout worker %d: a restarted process (incarnation %d) rejoined the pool", i, incarnation)
        self.requests[i], self.ready_events[i] = self.remote.rejoin(i, incarnation)
        if self.launcher is not None:
            self.launcher.rejoined(i)

    # ------------------------------------------------------------------ moves
    def move(self, i: int, placement: dict, timeout: float) -> None:
        """Stop local worker ``i`` (already drained: it is in ``draining``, the pool handed its chunks to the others,
        so what still waits in its queue is dropped) after the request it serves, and start it in ``placement``; it
        takes requests again once ready (:meth:`moved`), at most ``timeout`` s from now."""
        deadline = time.monotonic() + timeout
        proc = self.procs[i]
        _drop_queued(self.requests[i])  # its chunks went to the other workers: stop after the one it generates
        self.requests[i].put(STOP)
        proc.join(max(0.1, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(2)
        self._fresh_queue(i)
        spec = self.specs[i]
        spec.cores = placement.get("cores", spec.cores)
        spec.threads = placement.get("threads", spec.threads)
        spec.env = placement.get("env", spec.env)
        spec.device = placement.get("device", spec.device)
        self._start(i)
        self._moving[i] = (deadline, timeout, placement)

    def moved(self) -> None:
        """Workers that finished moving take requests again; one that is not ready in time is an error."""
        for i, (deadline, timeout, placement) in list(self._moving.items()):
            if self.ready_events[i].is_set():
                del self._moving[i]
                self.draining.discard(i)
                log.info("rollout worker %d moved to %s", i, placement)
            elif time.monotonic() > deadline:
                del self._moving[i]
                self.draining.discard(i)
                raise StageTimeoutError(f"move_worker: worker {i} not ready within {timeout:.0f} s")

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers and release the queues, the channels and the shared memory (see
        :func:`~mrl_plugins.rollout.lifecycle.teardown`)."""
        if timeout is not None:
            self._lifetime["grace"] = float(timeout)
        release(self._finalizer)  # set by launch(), which the pool always ran (or it was never built)


def _drop_queued(requests: Any) -> None:
    """Discard what waits in a local worker's request queue (at most ``INFLIGHT_PER_WORKER`` chunks and notices).
    A worker idle in ``get()`` holds the queue's reader lock: then nothing waits and this returns within 0.05 s."""
    while True:
        try:
            requests.get(timeout=0.05)
        except queue.Empty:
            return
