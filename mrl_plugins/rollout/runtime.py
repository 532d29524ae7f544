"""The rollout stage's runtimes on the trainer's side: what generates where the host (TRL: the adapter's
:class:`~mrl_plugins.adapters.trl_generation.MrlGeneration`, a :class:`~mrl_plugins.hookspecs.RolloutHost`) asks.
The runtime knows the host only through that protocol: its weight version and publishing, its next prompts (the
lookahead), how often it generates and its model.

Engines: ``rollout.workers: 0`` runs the engine inside the trainer process (a separate inference
copy, no overlap); ``workers >= 1`` runs :class:`~mrl_plugins.rollout.pool.WorkerPool` processes, with
``rollout.max_staleness >= 1`` one generation batch ahead of the trainer (docs/architecture.md, the async
pipeline).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mrl_plugins.hookspecs import RolloutHost, RolloutResult, StageContext

from .arrangement import Placement, prompt_key, trainer_device

log = logging.getLogger("mrl_plugins.rollout")


class LocalEngineRuntime:
    """``rollout.workers: 0``: an engine on an inference copy inside the trainer process, built with its weight-sync
    ends by :meth:`start` (when ``train()`` begins or at the first generation / weight sync), not at ``enable()``;
    :meth:`close` drops them (a later use builds them again)."""

    replaces_host = True

    def __init__(self, pm: Any, ctx: StageContext, model: Any, sampling: Any, engine: Any, seed: int) -> None:
        """``engine``: the configured engine's registration (:class:`~mrl_plugins.hookspecs.RolloutEngine`)."""
        self.pm, self.ctx, self._build = pm, ctx, (model, sampling, engine, seed)
        self.receiver: Any = None  # set last by start(): built

    def start(self) -> None:
        if self.receiver is not None:
            return
        from mrl_plugins.weight_sync.sources import inference_copy

        from .engine import build_engine

        model, sampling, engine, seed = self._build
        copy = inference_copy(model)  # PEFT: the merged base model, named as published
        self.own_weights = engine.own_weights
        self.engine = build_engine(
            engine.factory, copy, sampling, device=trainer_device(model).spec, seed=seed,
            options=dict(self.ctx.config.rollout.engine_options or {}),
        )  # fmt: skip
        # the weight-sync stage's ends, opened through the manager: the receiver loads into this copy
        self.sender = self.pm.weight_sync_open_sender(
            ctx=self.ctx, model_id="policy", run_id=f"local{id(self):x}", receivers=1, same_process=True
        )
        self.receiver = self.pm.weight_sync_open_receiver(
            ctx=self.ctx, model=copy, handle=self.sender.receiver_handle(), model_id="policy", rank=0
        )

    def publish(self, version: int, named_tensors: Any) -> Any:
        from mrl_plugins.metrics import record_publish

        self.start()
        report = self.sender.publish(version, named_tensors)
        record_publish(self.ctx.metrics, report)
        return report

    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        from mrl_plugins.metrics import record_switch

        from .worker import switch_engine

        self.start()
        timeout = self.ctx.config.weight_sync.timeout_s
        switched = switch_engine(self.receiver, self.engine, self.own_weights, timeout, timeout)
        if switched is not None:
            record_switch(self.ctx.metrics, switched[1], self.receiver.stats())
            if self.own_weights:  # vLLM: its own copy got the switched version
                self.ctx.metrics.gauge("weights/engine_apply_ms", self.engine.last_apply_ms)
        with self.receiver.active():
            version = self.receiver.version
            out = self.engine.generate(prompts, num_generations)
        flat = [list(p) for p in prompts for _ in range(num_generations)]
        return RolloutResult(flat, out.completion_ids, out.logprobs, int(version), model_id)

    def close(self) -> None:
        if self.receiver is None:
            return
        receiver, self.receiver = self.receiver, None
        for end in (receiver, self.sender):
            end.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


def too_stale(metrics: Any, cfg: Any, stale: int, samples: int) -> bool:
    """Book a batch ``stale`` versions older than the trainer: past ``rollout.staleness_bound`` (``cfg``) its
    ``samples`` count as stale and, with ``stale_policy: drop``, as dropped. Returns whether it must be generated
    again (dropped)."""
    if stale <= cfg.staleness_bound:
        return False
    metrics.add("rollout/stale_samples", samples)
    if cfg.stale_policy != "drop":
        return False
    metrics.add("rollout/dropped_samples", samples)
    return True


class AheadUnavailable(Exception):  # noqa: N818 - a state, not a fault
    """The workers stopped serving the split while a batch was rolled out ahead (released, or the run switched to
    taking turns): the trainer rolls that batch out itself when it comes to it."""


#: seconds between two looks at the workers' answers while a turn run ahead is in flight: from the first to the
#: last, doubling (the thread shares the trainer's cores: looking every 2 ms took ~40 % of its CPU time, measured)
AHEAD_POLL_S = (0.001, 0.01)


class PoolRuntime:
    """``rollout.workers >= 1``: worker processes, optionally one batch ahead of the trainer.

    Where each batch is generated (warm-up, split or turns, the trainer's share and lending, hybrid rebalancing) is
    decided by one :class:`~mrl_plugins.rollout.arrangement.Placement` (``where``); this class generates there and
    keeps what that needs: the pool's lifetime, the lookahead tickets, weight publishing, staleness, and the
    follow-up turns of multi-turn rollouts (also from a thread rolling the next batch out ahead).

    The pool is started lazily: by :meth:`start` (the adapter calls it when ``train()`` begins) or by the first
    use (a generation or a weight sync), and :meth:`release` stops it (workers and shared memory gone); a later
    use starts a new one. Its users are the trainer's thread and, with a rollout run ahead, that thread
    (:mod:`mrl_plugins.adapters.trl_shadow`): every use of the pool holds ``_lock``, except a turn run ahead, which
    is submitted under it and waited for outside it, so the trainer's own calls (publishing a version at a step
    end, lending checks) are never held up by a turn in flight.
    """

    replaces_host = True  # a RolloutRuntime (mrl_plugins.hookspecs.channels): TRL generates through it

    def __init__(
        self,
        pm: Any,
        ctx: StageContext,
        gen: RolloutHost,
        pool_factory: Any,
        local_engine: Any = None,
        balancer_factory: Any = None,
        *,
        warmup: bool,
        controller: Any = None,
        budgets: dict[str, tuple[list[int], int]] | None = None,
        spawn_cores: list[int] | None = None,
        lend: bool = False,
    ) -> None:
        """``pool_factory()`` builds the :class:`~mrl_plugins.rollout.pool.WorkerPool`; ``local_engine()``
        (optional) builds an engine on the trainer's own model, for the warm-up (``warmup``) and for taking turns;
        ``balancer_factory``, ``controller``, ``budgets`` and ``lend`` go to the
        :class:`~mrl_plugins.rollout.arrangement.Placement`. ``spawn_cores``: the CPU cores the workers are started
        on (a spawned process inherits the trainer's affinity, and a worker's imports and model build would
        otherwise compete with the trainer on its cores for seconds). ``exact(local)``, set after construction:
        called per generation with whether the batch came from the trainer's own current model (TRL's
        importance-sampling pass is then skipped, as in TRL's own generation)."""
        self.pm, self.ctx, self.gen = pm, ctx, gen
        self._pool_factory = pool_factory
        self.cfg = ctx.config.rollout
        self._pool: Any = None
        self._local_factory = local_engine
        self._local: Any = None
        self.where = Placement(
            ctx,
            lambda: gen.model,
            controller=controller,
            warmup=bool(warmup),
            budgets=budgets,
            lend=lend,
            idle=self._workers_idle,
            balancer_factory=balancer_factory,
            interval=self.generation_interval,
        )
        self.exact: Any = None  # set after construction (the adapter's importance-sampling switch)
        self._spawn_cores = list(spawn_cores) if spawn_cores else None
        self._unpublished = False  # a version was skipped while taking turns: publish before the workers serve
        self._batch_exact = False  # every turn of the current batch came from the trainer's own current model
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._pending: dict[tuple, int] = {}
        self._deferred: tuple[list[list[int]], int, str, int] | None = None
        self._delivered = 0  # batches the workers delivered to the trainer since the pool started
        self._local_count = 0
        self._ready_reported = False

    # ---------------------------------------------------------------- lifetime
    @property
    def pool(self) -> Any:
        """The worker pool, started on first use."""
        if self._pool is None:
            self._start_pool()
        return self._pool

    def start(self) -> None:
        """Start the workers (no-op when running, or deferred while the run takes turns first)."""
        if self._pool is None and not self.where.defer_start():
            self._start_pool()

    def _start_pool(self) -> Any:
        import os

        self._reset()
        saved = None
        if self._spawn_cores and hasattr(os, "sched_setaffinity"):
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, self._spawn_cores)  # inherited by the spawned workers until they pin themselves
        try:
            self._pool = self._pool_factory()
        finally:
            if saved is not None:
                os.sched_setaffinity(0, saved)
        self.where.started(self._pool)
        return self._pool

    def release(self) -> None:
        """Stop the workers and release their shared memory (fast: a worker still starting is terminated).

        Warns once when the pool ran but delivered no batch (every batch came from the trainer's own model)."""
        with self._lock:
            pool, self._pool = self._pool, None
        self.where.released()  # the trainer's share (NPU: the training stream's core limit) let go
        if pool is None:
            return
        try:
            if self._delivered == 0 and self._local_count:
                ready = pool.ready_s
                log.warning(
                    "mrl-plugins: the rollout workers delivered no batch in this run (%s); all %d generation%s "
                    "came from the trainer's own model while they started. Worker start-up (spawn, imports, "
                    "model build) takes seconds: longer runs overlap generation with training.",
                    f"ready after {ready:.1f} s, too late to serve" if ready is not None else
                    f"not ready {time.monotonic() - pool.started_at:.1f} s after the start",
                    self._local_count,
                    "" if self._local_count == 1 else "s",
                )  # fmt: skip
        finally:
            pool.close()  # the workers and the ends the pool opened

    def close(self) -> None:
        self.release()

    def publish(self, version: int, named_tensors: Any) -> Any:
        """Every sync goes through the pool: its workers get a notice."""
        with self._lock:
            if self.where.arrangement == "turns":
                self._unpublished = True  # the trainer's own model generates: no worker needs (or computes) it
                return None
            self._unpublished = False  # the workers get the current version
            return self.pool.publish(version, named_tensors)

    # ---------------------------------------------------------------- one batch
    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        with self._lock:
            t0 = time.perf_counter()
            if self._place(t0) == "turns":
                result, engine_s, tag = self._generate_turns(prompts, num_generations, model_id)
            else:
                result, engine_s, tag = self._generate_split(prompts, num_generations, model_id)
            self._served(t0, time.perf_counter() - t0, engine_s, tag)
            return result

    def _place(self, t0: float) -> str:
        """The arrangement for the batch starting at ``t0`` (the controller is told the generations left)."""
        left = self.gen.steps_left() if self.where.controller is not None else None
        left = None if left is None else -(-left // self.generation_interval())  # generations left
        return self.where.place(t0, left, self._start_pool)

    def _served(self, t0: float, blocked: float, engine_s: float, tag: str | None) -> None:
        """Bookkeeping of a batch handed to the trainer: who generated it, TRL's importance-sampling switch."""
        self._batch_exact = tag in ("turns", "warmup")
        if self.exact is not None:  # the trainer's own current model generated: no importance sampling
            self.exact(self._batch_exact)
        self.where.served(t0, blocked, engine_s, tag)

    def _generate_locally(
        self, prompts: list[list[int]], num_generations: int, model_id: str, *, warmup: bool = True
    ) -> RolloutResult:
        if self._local is None:
            self._local = self._local_factory()
        out = self._local.generate(prompts, num_generations)
        flat = [list(p) for p in prompts for _ in range(num_generations)]
        if warmup:
            self.ctx.metrics.add("rollout/local_batches", 1)
            self._local_count += 1
        else:
            self.ctx.metrics.add("rollout/turns_batches", 1)
        return RolloutResult(flat, out.completion_ids, out.logprobs, int(self.gen.version), model_id)

    def _collect(self, ticket: int) -> RolloutResult:
        result = self.pool.collect(ticket)
        self._delivered += 1
        return result

    def _generate_turns(
        self, prompts: list[list[int]], num_generations: int, model_id: str
    ) -> tuple[RolloutResult, float, str | None]:
        """Taking turns: the trainer's own model generates on all cores; a lookahead the workers already hold for
        these prompts (submitted before the switch) is used, any other is dropped."""
        ticket = self._pending.pop(prompt_key(prompts), None) if self._pool is not None else None
        self._deferred = None
        tag: str | None = "turns"
        if ticket is not None:
            result = self._collect(ticket)  # generated before the switch: used, not lost, not generated twice
            engine_s, tag = float(result.metrics.get("generate_s", 0.0)), None
            self.ctx.metrics.add("rollout/lookahead_hits", 1)
        if self._pool is not None:
            self._drop_unused()
        # all cores once no worker computes at normal priority: one starting beside the trainer at the same priority
        # would share its cores (oversubscribed: see doctor_checks.check_threads); started in the background it
        # takes only what is left
        ready = self._pool is None or self._pool.ready
        self.where.foreground(self._pool)
        self.where.share.apply("turns" if ready or self.where.background else "split")
        if ticket is None:
            t0 = time.perf_counter()
            result = self._generate_locally(prompts, num_generations, model_id, warmup=False)
            engine_s = time.perf_counter() - t0
        return result, engine_s, tag

    def _generate_split(
        self, prompts: list[list[int]], num_generations: int, model_id: str
    ) -> tuple[RolloutResult, float, str | None]:
        metrics = self.ctx.metrics
        pool = self._split_pool(wait=False)
        current = self.gen.version
        ticket = self._pending.pop(prompt_key(prompts), None)
        warming = self.where.warming(pool)
        if warming:
            if ticket is not None:
                pool.discard(ticket)
            t0 = time.perf_counter()
            result = self._generate_locally(prompts, num_generations, model_id)  # workers still starting
            engine_s, tag = time.perf_counter() - t0, "warmup"
        else:
            if not pool.ready:  # no warm-up: the first generation waits for the engine that was asked for
                self._wait_for_workers(pool)
            if ticket is None:
                if self.cfg.pipeline == "async":
                    metrics.add("rollout/lookahead_misses", 1)
                ticket = pool.submit(prompts, num_generations, model_id=model_id, min_version=current)
            else:
                metrics.add("rollout/lookahead_hits", 1)
            self._drop_unused()
            t0 = time.perf_counter()
            result = self._collect(ticket)
            waited = time.perf_counter() - t0
            metrics.add("time/wait_s", waited)
            self.where.waited(waited)
            engine_s, tag = float(result.metrics.get("generate_s", 0.0)), "split"
            metrics.add("rollout/worker_batches", 1)  # generated by the workers' engine (local ones: local_batches)
        if too_stale(metrics, self.cfg, current - result.weight_version, len(result.completion_ids)):
            result = self._collect(pool.submit(prompts, num_generations, model_id=model_id, min_version=current))
        # the lookahead goes to the workers only once they can take it: submitted while they start, it would
        # wait in their queue and be discarded when the trainer's own model answers the next batch too
        if self.cfg.pipeline == "async" and (not warming or pool.ready):
            nxt = self.gen.next_prompts(prompts) if self.gen.lookahead else None  # None: the host cannot tell
            if nxt is not None:
                every = self.generation_interval()
                if every <= 1:
                    self._pending[prompt_key(nxt)] = pool.submit(
                        nxt, num_generations, model_id=model_id, min_version=current
                    )
                else:  # submitted one optimizer step before it is needed: one version stale, not `every`
                    self._deferred = (nxt, num_generations, model_id, current + every - 1)
        metrics.update("rollout", {"generate_s": result.metrics.get("generate_s", 0.0)})
        if result.metrics.get("engine_apply_ms"):
            metrics.gauge("weights/engine_apply_ms", result.metrics["engine_apply_ms"])
        metrics.update(pool.stats(), gauge=True)
        if tag == "split":
            self.where.share.install_hooks()  # lending (where there is something to lend)
        if pool.ready_s is not None and not self._ready_reported:
            metrics.gauge("rollout/worker_ready_s", pool.ready_s)
            self._ready_reported = True
        return result, engine_s, tag

    def _split_pool(self, wait: bool = True) -> Any:
        """The pool, ready to take a request in the split: the trainer's lent share back, the workers at normal
        priority, the current version published (versions skipped while taking turns), and with ``wait`` the
        workers started."""
        self.where.share.apply("split")  # before the workers compute again on their cores
        pool = self.pool
        self.where.foreground(pool, now=True)  # their cores are their own again: finish starting at normal priority
        if self._unpublished:
            self._unpublished = False
            self.gen.sync_weights()
        if wait and not pool.ready:
            self._wait_for_workers(pool)
        return pool

    def _wait_for_workers(self, pool: Any) -> None:
        """Wait for the workers' first start, saying so on stderr after a second and every 5 s (at most
        ``rollout.start_timeout_s`` from their start). Once they were all ready, a worker that moves or restarts holds
        up nothing here: a moving one takes no request until ready, a restarted one's requests wait in its queue
        (``collect`` bounds them), and the start bound, counted from the pool's start, is no bound for it."""
        import sys

        if pool.ready_s is not None:
            return
        what = f"{pool.n} rollout worker{'s' if pool.n != 1 else ''} ({self.cfg.engine} engine)"

        bound = self.cfg.start_timeout_s

        def progress(seconds: float) -> None:
            say = f"waiting for {what} to start: {seconds:.0f} s so far, at most {bound:g} s (1.5 x timeout_s)"
            print(f"mrl-plugins: {say}", file=sys.stderr, flush=True)

        waited = pool.wait_ready(progress)
        if waited >= 1.0:
            since = time.monotonic() - pool.started_at
            print(f"mrl-plugins: {what} ready {since:.1f} s after the start; generating with it", file=sys.stderr)
        self.ctx.metrics.add("rollout/start_wait_s", waited)

    def _workers_idle(self) -> bool:
        """Lending's test (:meth:`TrainerShare.check`): in the split, the workers have answered every lookahead
        they hold (nothing to generate until the next generation). Never waits for the lock: a rollout run ahead
        using the pool means not now."""
        if self.where.arrangement != "split" or not self._pending or not self._lock.acquire(blocking=False):
            return False
        try:
            pool = self._pool
            if pool is None or not pool.ready:
                return False
            pool.poll()
            return all(pool.answered(t) for t in self._pending.values())
        finally:
            self._lock.release()

    # ---------------------------------------------------------------- the lookahead
    def can_run_ahead(self) -> bool:
        """Whether a rollout started ahead now would be served: the run is in the split and its workers are ready
        (a rollout ahead never uses the trainer's own model)."""
        return self.where.arrangement == "split" and self._pool is not None and self._pool.ready

    def generation_interval(self) -> int:
        """Optimizer steps between two of the host's generations (its :meth:`RolloutHost.generation_interval`)."""
        return self.gen.generation_interval()

    def on_step_end(self, global_step: int) -> None:
        """After an optimizer step: submit a deferred lookahead once the trainer is one step from using it.

        The weights of this step are published first, so the lookahead is generated with them and is one
        version old when TRL asks for it (TRL publishes again at its own sync point).
        """
        if self._deferred is None or global_step < self._deferred[3]:
            return
        with self._lock:
            self._submit_deferred()

    def _submit_deferred(self) -> None:
        nxt, num_generations, model_id, _ = self._deferred
        self._deferred = None
        if self._pool is None:  # released meanwhile
            return
        self.where.share.apply("split")  # lent cores back before the workers compute again
        self.gen.sync_weights()
        self._pending[prompt_key(nxt)] = self.pool.submit(
            nxt, num_generations, model_id=model_id, min_version=self.gen.version
        )
        self.ctx.metrics.add("rollout/deferred_lookaheads", 1)

    def _drop_unused(self) -> None:
        """A lookahead that was not asked for (data order changed) is discarded without waiting for it."""
        self._deferred = None
        for key in list(self._pending):
            self.pool.discard(self._pending.pop(key))

    # ---------------------------------------------------------------- multi-turn rollouts
    # A multi-turn rollout (TRL's tool loop, a rollout_func) asks for more than the batch's first turn: each
    # follow-up turn (the conversation so far, tool results appended) is one more generation, decided only when the
    # previous turn and its tools are done.

    def generate_turn(self, prompts: list[list[int]], model_id: str, *, ahead: bool = False) -> RolloutResult:
        """A follow-up turn: one completion per prompt, now, with the current version, where this batch's
        arrangement generates (the workers in the split; the trainer's own model while taking turns or warming
        up), without touching the first-turn lookahead or the placement's samples. ``ahead``: from the thread
        rolling the next batch out (the workers only, see the class docstring)."""
        if ahead:
            return self._turn_ahead(prompts, model_id)
        with self._lock:
            turns = self.where.arrangement == "turns"
            local = turns or self.where.warming(self.pool, settle=False)
            if local:
                result = self._generate_locally(prompts, 1, model_id, warmup=not turns)
            else:
                pool = self._split_pool()
                result = self._collect(pool.submit(prompts, 1, model_id=model_id, min_version=self.gen.version))
                self.ctx.metrics.add("rollout/worker_batches", 1)
            self._batch_exact = self._batch_exact and local  # one turn from the workers: TRL's correction stays on
            if self.exact is not None:
                self.exact(self._batch_exact)
            return result

    def _turn_ahead(self, prompts: list[list[int]], model_id: str) -> RolloutResult:
        from mrl_plugins.errors import StageTimeoutError

        with self._lock:
            pool = self._pool
            if pool is None or self.where.arrangement != "split":
                raise AheadUnavailable("the workers are not serving the split (released or taking turns)")
            ticket = pool.submit(prompts, 1, model_id=model_id, min_version=self.gen.version)
        deadline = time.monotonic() + self.cfg.timeout_s
        pause = AHEAD_POLL_S[0]
        while True:
            with self._lock:
                if self._pool is not pool:
                    raise AheadUnavailable("the worker pool was released")
                pool.poll()
                if pool.answered(ticket):
                    result = self._collect(ticket)
                    break
                pool.check_workers()
            if time.monotonic() > deadline:
                with self._lock:
                    pool.discard(ticket)
                raise StageTimeoutError(f"rollout ahead: no answer within {self.cfg.timeout_s:.0f} s (timeout_s)")
            time.sleep(pause)
            pause = min(2 * pause, AHEAD_POLL_S[1])
        self.ctx.metrics.add("rollout/worker_batches", 1)
        return result

    def take_ahead(self, t0: float, waited: float, engine_s: float) -> None:
        """The trainer takes a batch rolled out ahead (after waiting ``waited`` s for it): booked as a batch of the
        split (placement samples and decisions, TRL's importance-sampling correction on, what waited)."""
        with self._lock:
            self._place(t0)
            self.ctx.metrics.add("time/wait_s", waited)
            self.ctx.metrics.add("rollout/ahead_batches", 1)
            self._served(t0, waited, engine_s, "split")
