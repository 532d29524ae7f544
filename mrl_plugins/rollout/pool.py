"""Rollout worker processes: each hosts an engine with its own cores/device, pulls weights through the
weight-sync stage and returns experience through the comm stage.

Trainer side: :class:`WorkerPool` owns the other stages' ends it opens (a weight sender per served model, the
experience consumer), submits requests (prompt ids, small: a plain queue), collects the answers as comm frames
and publishes weights; the processes are its :class:`~mrl_plugins.rollout.supervisor.WorkerSupervisor`'s; a
collect waits at most ``rollout.timeout_s``. Worker side: :func:`~mrl_plugins.rollout.worker.worker_main`.

Requests (one chunk of prompts per worker) wait in one first-in-first-out queue and are handed to a worker only
when it has fewer than ``INFLIGHT_PER_WORKER`` outstanding, so a backlog waits here, not in a worker's queue, and a
restarted or moved worker's chunks go to the others. ``score_models`` (e.g. the frozen reference) are held by every
worker besides the policy and never generate: each policy completion is scored with them right after it is
generated (teacher-forced logprobs, ``RolloutResult.scores``), in the same frame.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import time
import uuid
from typing import Any

from mrl_plugins.comm.base import ChannelClosedError
from mrl_plugins.errors import StageTimeoutError
from mrl_plugins.hookspecs import RolloutResult, StageContext
from mrl_plugins.metrics import record_publish

from .assemble import Ticket, assemble, own
from .pool_checks import WorkerDiedError, check_pool_config, no_rejoin, stage_names  # noqa: F401 - re-exported
from .supervisor import WorkerSupervisor
from .wire import SWITCHED, BatchMeta, GenerateRequest, WeightsNotice, WorkerEvent
from .worker import ServedModel, WorkerSpec, budget_metrics, param_dtypes

log = logging.getLogger("mrl_plugins.rollout")

#: requests handed to one worker before it answers; the rest wait in the pool's queue, first in first out
INFLIGHT_PER_WORKER = 2


class WorkerPool:
    """The trainer's side of the rollout workers (see the module docstring; the processes: ``workers``).

    :param engine: the configured engine's registration (:class:`~mrl_plugins.hookspecs.RolloutEngine`).
    :param model: the policy (model_id ``"policy"``); ``score_models``: the models that score each policy completion
        (published once or whenever they change).
    """

    def __init__(
        self,
        pm: Any,
        ctx: StageContext,
        model: Any,
        sampling: Any,
        *,
        placements: list[dict],
        engine: Any,
        seed: int = 0,
        score_models: dict[str, Any] | None = None,
    ) -> None:
        cfg = ctx.config
        self.pm, self.ctx, self.cfg = pm, ctx, cfg
        remote = cfg.rollout.remote_workers
        self.n = len(placements) + remote
        comm_caps, ws_caps = check_pool_config(pm, cfg, len(placements))
        self.score_with = tuple(score_models or ())
        self.models = {"policy": model, **(score_models or {})}
        self._waiting: collections.deque[tuple[int, int]] = collections.deque()  # (req_id, chunk), FIFO
        self.run_id = f"mrl{os.getpid()}{uuid.uuid4().hex[:6]}"
        self._ids = itertools.count(1)
        self._tickets: dict[int, Ticket] = {}
        self._abandoned: set[int] = set()
        self._stash: dict[tuple[int, int], Any] = {}
        self._assigned: list[set[tuple[int, int]]] = [set() for _ in range(self.n)]
        self._versions: dict[tuple[int, str], int] = {}  # (worker, model_id) -> version it switched to
        self.budgets: dict[int, dict] = {}  # worker -> {"budget": AppliedBudget.as_dict(), "memory": {...}}
        names = stage_names(pm, cfg)
        # an unsafe fork is refused and Ray's reservation made before anything else opens
        self.workers = WorkerSupervisor(
            ctx, engine, placements, rejoinable_ends=comm_caps.rejoinable and ws_caps.rejoinable
        )
        # the other stages' ends, opened through their plugins' hooks and owned by this pool
        self.senders: dict[str, Any] = {}
        self.consumer: Any = None
        try:
            self.consumer = pm.comm_open_consumer(ctx=ctx, run_id=self.run_id, producers=self.n)
            for m in self.models:
                self.senders[m] = pm.weight_sync_open_sender(
                    ctx=ctx, model_id=m, run_id=self.run_id, receivers=self.n, same_process=False
                )
            self.sender = self.senders["policy"]
            # a new process can take a worker's place only where every end is rejoinable
            for ends, what in (([*self.senders.values()], names[1]), ([self.consumer], names[0])):
                if self.workers.no_rejoin is None and not all(e.capabilities.rejoinable for e in ends):
                    self.workers.no_rejoin = no_rejoin(what)
            served = {
                m: ServedModel(
                    mod.config.to_dict(), type(mod).__name__, self.senders[m].receiver_handle(), *param_dtypes(mod)
                )
                for m, mod in self.models.items()
            }
            places = [*placements, *({"device": "auto"} for _ in range(remote))]
            specs = [
                WorkerSpec(
                    index=i,
                    config=cfg,
                    models=served,
                    sampling=sampling,
                    engine_factory=engine.factory,
                    own_weights=engine.own_weights,
                    comm_handle=self.consumer.producer_handle(i),
                    cores=place.get("cores"),
                    threads=place.get("threads", cfg.rollout.engine_threads),
                    plugin_factory=pm.factory,
                    env=place.get("env", {}),
                    device=place.get("device", "cpu"),
                    seed=seed,
                    log_level=logging.getLogger("mrl_plugins").getEffectiveLevel(),
                )
                for i, place in enumerate(places)
            ]
        except BaseException:  # nothing started yet: release the ends and Ray's reservation
            for end in (*self.senders.values(), self.consumer):
                if end is not None:
                    end.close()
            self.workers.abort()
            raise
        self.workers.launch(specs, [self.consumer, *self.senders.values()])  # releases all of it when it fails

    # ------------------------------------------------------------------ the workers
    # the supervisor's state, read through the pool (see WorkerSupervisor)
    ready = property(lambda self: self.workers.ready)
    ready_s = property(lambda self: self.workers.ready_s)
    started_at = property(lambda self: self.workers.started_at)
    pids = property(lambda self: self.workers.pids)

    def check_workers(self) -> None:
        """Raise :class:`WorkerDiedError` for a worker that failed or died and cannot be replaced; one that got a
        new process (restarted, or a remote one rejoined) gets the chunks its predecessor left unanswered."""
        for i in self.workers.check():
            self._new_process(i)
            self._resubmit_worker(i)

    def _new_process(self, i: int) -> None:
        """Worker ``i`` runs in a new process: it loads the latest versions again, and answers nobody waits for
        are forgotten."""
        for mid in self.models:
            self._versions.pop((i, mid), None)
        self._assigned[i] -= {k for k in self._assigned[i] if k[0] not in self._tickets}

    def _unanswered(self, i: int) -> list[tuple[Ticket, int, list[list[int]]]]:
        """``(ticket, chunk, prompts)`` handed to worker ``i`` and not answered (an answer already received, waiting
        in the stash, counts as answered)."""
        return [
            (t, chunk, prompts)
            for t in self._tickets.values()
            for chunk, (worker, prompts) in t.chunks.items()
            if worker == i and chunk not in t.results and (t.req_id, chunk) not in self._stash
        ]

    def _resubmit_worker(self, i: int) -> None:
        """A restarted worker ``i`` gets the chunks its predecessor had not answered."""
        for t, chunk, prompts in self._unanswered(i):
            self._send(i, t, chunk, prompts)

    def wait_ready(self, progress: Any = None) -> float:
        """Block until every worker is ready, at most ``rollout.start_timeout_s`` from the pool's start (a worker
        that fails meanwhile raises as in :meth:`collect`); ``progress(seconds since the start)`` after 1 s of
        waiting, then every 5 s. Returns the seconds waited."""
        start = time.monotonic()
        deadline, note = self.started_at + self.cfg.rollout.start_timeout_s, start + 1.0
        while not self.ready:
            self.check_workers()
            now = time.monotonic()
            if now >= deadline:
                raise StageTimeoutError(
                    f"rollout: the workers were not ready {now - self.started_at:.0f} s after they started "
                    f"(the start bound {self.cfg.rollout.start_timeout_s:g} s = max(1.5 x timeout_s, the engine's "
                    "start)); raise timeout_s or look at the worker log for what the start is waiting on"
                )
            if progress is not None and now >= note:
                progress(now - self.started_at)
                note = now + 5.0
            self._drain_events()
            # None: the last worker became ready meanwhile (the loop condition sees it)
            waiting = next((e for e in self.workers.ready_events if not e.is_set()), None)
            waiting.wait(0.2) if hasattr(waiting, "wait") else time.sleep(0.2)
        return time.monotonic() - start

    def _send(self, w: int, t: Ticket, chunk: int, prompts: list[list[int]]) -> None:
        t.chunks[chunk] = (w, prompts)
        self._assigned[w].add((t.req_id, chunk))
        self.workers.requests[w].put(
            GenerateRequest(t.req_id, chunk, prompts, t.num_generations, t.model_id, t.min_version, self.score_with)
        )

    def move_worker(self, i: int, placement: dict) -> None:
        """Move worker ``i`` to ``placement`` (``cores``/``threads``/``env``/``device``, as the adapter builds
        them) without stopping the service: new requests skip it, its unanswered chunks are handed to the other
        workers first, then it is stopped and restarted in its new place (hybrid mode: shifting capacity between
        the colocated and the dedicated pool; a local worker). Returns after the restart; it takes requests again
        when it reports ready (a StageTimeoutError surfaces from a later call if it does not within
        ``rollout.start_timeout_s``)."""
        from mrl_plugins.errors import ConfigError

        workers = self.workers
        if not 0 <= i < self.n or workers.procs[i] is None:
            raise ConfigError(
                f"move_worker: worker {i} is not a local worker of 0..{self.n - 1} (a remote one: restart "
                "its `mrl worker` instead)"
            )
        if i in workers.draining or len(workers.active) < 2:
            raise ConfigError("move_worker: needs another active worker to serve while this one moves")
        if workers.no_rejoin is not None:
            raise ConfigError(f"move_worker restarts the worker: {workers.no_rejoin}")
        workers.draining.add(i)
        try:
            others = workers.active
            for t, chunk, prompts in self._unanswered(i):  # drain: its unanswered chunks go to the others
                self._assigned[i].discard((t.req_id, chunk))
                self._send(others[chunk % len(others)], t, chunk, prompts)
            workers.move(i, placement, self.cfg.rollout.start_timeout_s)
        except BaseException:
            workers.draining.discard(i)
            raise
        self._new_process(i)
        self._dispatch()

    # ------------------------------------------------------------------ weights
    def publish(self, version: int, named_tensors: Any, model_id: str = "policy") -> Any:
        """Publish ``version`` of ``model_id`` (every worker fetches it and switches between two requests; a request
        names the version it needs)."""
        # every worker gets a notice: idle ones fetch at once instead of at their next poll. A collective transport
        # needs them to join while the publish runs (notice first); the others read a finished version (after)
        collective = self.senders[model_id].capabilities.collective
        if collective:
            self._notify(model_id, version)
        t0 = time.monotonic()
        try:
            report = self.senders[model_id].publish(version, named_tensors)
        except StageTimeoutError:
            if collective:  # the workers it waited for: one that failed (it said why) or never connected, if so
                self.workers.check()
                self.workers.check_joined(waited=time.monotonic() - t0)
            raise
        record_publish(self.ctx.metrics, report)
        if not collective:
            self._notify(model_id, version)
        return report

    def _notify(self, model_id: str, version: int) -> None:
        for w in self.workers.active:
            self.workers.requests[w].put(WeightsNotice(model_id, int(version)))

    def worker_versions(self, model_id: str = "policy") -> list[int]:
        """The version of ``model_id`` each worker last reported switching to (-1: none yet)."""
        self._drain_events()
        return [self._versions.get((w, model_id), -1) for w in range(self.n)]

    def _drain_events(self) -> None:
        self.workers.moved()
        for q in self.workers.event_qs:
            while True:
                try:
                    ev: WorkerEvent = q.get_nowait()
                except queue.Empty:
                    break
                w, mid = ev.worker, ev.model_id
                if ev.kind == SWITCHED:
                    self._versions[(w, mid)] = max(ev.value, self._versions.get((w, mid), -1))
                else:  # BUDGET / MEMORY: what the worker applied at start / reserved at its first batch
                    self.budgets.setdefault(w, {})[ev.kind] = ev.value

    # ------------------------------------------------------------------ requests
    def submit(
        self, prompts: list[list[int]], num_generations: int, *, model_id: str = "policy", min_version: int = -1
    ) -> int:
        """Split ``prompts`` into one chunk per active worker and queue them; returns a ticket id for
        :meth:`collect`. The chunks go to workers as they have a free slot (:meth:`_dispatch`)."""
        from mrl_plugins.errors import ConfigError

        if model_id != "policy":
            raise ConfigError(f"submit: only the policy generates (model_id 'policy'), got {model_id!r}")
        self._drain_events()
        req_id = next(self._ids)
        active = self.workers.active
        per = -(-len(prompts) // len(active))
        parts = [[list(p) for p in prompts[c * per : (c + 1) * per]] for c in range(len(active))]
        ticket = Ticket(
            req_id, num_generations, model_id, min_version, {c: (-1, part) for c, part in enumerate(parts) if part}
        )
        self._tickets[req_id] = ticket
        self._waiting.extend((req_id, c) for c in ticket.chunks)
        self._dispatch()
        return req_id

    def _dispatch(self) -> None:
        """Hand queued chunks, first in first out, to workers with a free slot (least loaded first)."""
        while self._waiting:
            w = min(self.workers.active, key=lambda k: len(self._assigned[k]))
            if len(self._assigned[w]) >= INFLIGHT_PER_WORKER:
                return
            req_id, chunk = self._waiting.popleft()
            t = self._tickets.get(req_id)
            if t is not None:  # else discarded after it was queued
                self._send(w, t, chunk, t.chunks[chunk][1])

    def discard(self, req_id: int) -> None:
        """Forget ticket ``req_id``: its answers are dropped when they arrive (no waiting)."""
        if self._tickets.pop(req_id, None) is not None:  # its chunks still queued are never sent (_dispatch)
            self._abandoned.add(req_id)
        for key in [k for k in self._stash if k[0] == req_id]:
            del self._stash[key]

    def answered(self, req_id: int) -> bool:
        """Whether every chunk of ticket ``req_id`` has arrived (no waiting, no receiving)."""
        t = self._tickets[req_id]
        return all(c in t.results or (req_id, c) in self._stash for c in t.chunks)

    def _pump(self, wait: float) -> None:
        """Process worker events, hand out queued requests, receive at most one answer (kept in the stash)."""
        self._drain_events()
        self._dispatch()
        try:
            got = self.consumer.receive(wait)
        except (TimeoutError, ChannelClosedError):
            # dead or closed producers: the callers' check_workers() raises or restarts them
            time.sleep(0.05)
            return
        self._take(got)

    def poll(self) -> None:
        """Take in every answer that has already arrived, without waiting (``answered`` then sees them)."""
        while True:
            try:
                got = self.consumer.receive(0)
            except (TimeoutError, ChannelClosedError):
                return
            self._take(got)

    def _take(self, got: Any) -> None:
        meta = BatchMeta.from_meta(got.meta)
        entry = (meta, {k: own(v) for k, v in got.batch.items()})
        got.release()
        key = (meta.seq, meta.chunk)
        w = meta.worker
        if 0 <= w < self.n:
            self._assigned[w].discard(key)
            self._versions[(w, meta.model_id)] = max(meta.version, self._versions.get((w, meta.model_id), -1))
        ticket = self._tickets.get(key[0])
        if ticket is not None and (key[1] in ticket.results or key in self._stash):
            # answered twice (a dead worker's last frame arrived after its chunk went to its successor): the first
            # answer counts, once
            self.ctx.metrics.add("rollout/duplicate_batches", 1)
        elif ticket is not None:
            self._stash[key] = entry
        elif key[0] in self._abandoned:
            self.ctx.metrics.add("rollout/discarded_batches", 1)
        self._dispatch()

    def collect(self, req_id: int, timeout: float | None = None) -> RolloutResult:
        """Wait for every chunk of ticket ``req_id``; never longer than ``timeout`` (rollout.timeout_s)."""
        ticket = self._tickets[req_id]
        timeout = self.cfg.rollout.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            for key in [k for k in self._stash if k[0] == req_id]:
                ticket.results[key[1]] = self._stash.pop(key)
            if len(ticket.results) >= len(ticket.chunks):
                break
            self.check_workers()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StageTimeoutError(
                    f"rollout: no answer for request {req_id} within {timeout:.0f} s (timeout_s); "
                    f"workers alive: {[p.is_alive() if p is not None else 'remote' for p in self.workers.procs]}"
                )
            self._pump(min(0.5, remaining))
        del self._tickets[req_id]
        return assemble(ticket)

    def stats(self) -> dict[str, float]:
        self._drain_events()  # budgets and memory reservations the workers reported since the last call
        out = {}
        for name, obj in (("comm", self.consumer), ("weights", self.sender)):
            st = getattr(obj, "stats", None)
            if st is not None:
                out.update({f"{name}/{k}": v for k, v in st().items() if isinstance(v, int | float)})
        out["rollout/sched/policy/queue_depth"] = float(sum(k[0] in self._tickets for k in self._waiting))
        out.update(budget_metrics(self.budgets))
        return out

    def close(self, timeout: float | None = None) -> None:
        """Stop the workers and release the queues and shared memory: a ready worker gets ``timeout`` s
        (default ``lifecycle.STOP_GRACE_S``, 1 s) to take its stop request, one still starting is terminated at
        once. Also done when the pool is garbage-collected or the process exits; idempotent."""
        self.workers.close(timeout)
