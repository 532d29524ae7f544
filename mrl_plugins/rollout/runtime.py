"""The rollout stage's runtimes on the trainer's side: what generates where the host (TRL: the adapter's
:class:`~mrl_plugins.adapters.trl_generation.MrlGeneration`, a :class:`~mrl_plugins.hookspecs.RolloutHost`) asks.
The runtime knows the host only through that protocol: its weight version and publishing, its next prompts (the
lookahead), how often it generates and its model.

Engines: ``rollout.workers: 0`` runs the engine inside the trainer process (a separate inference
copy, no overlap); ``workers >= 1`` runs :class:`~mrl_plugins.rollout.pool.WorkerPool` processes.
With ``rollout.max_staleness >= 1`` the runtime looks one generation batch ahead in the trainer's dataloader
and has the workers generate it while the trainer trains on the current one (one version of
staleness; with TRL ``num_iterations = k`` the lookahead is submitted one optimizer step before the
next generation, after publishing that step's weights, so it is one version old too); samples
older than ``max_staleness`` versions are dropped and regenerated (``max_staleness: null``: kept and counted);
``max_staleness: 0`` takes turns.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from mrl_plugins.hookspecs import RolloutHost, RolloutResult, StageContext

from .arrangement import ArrangementMixin, prompt_key, trainer_device
from .multiturn import MultiTurnMixin

log = logging.getLogger("mrl_plugins.rollout")


_key = prompt_key


class LocalEngineRuntime:
    """``rollout.workers: 0``: an engine on an inference copy inside the trainer process."""

    replaces_host = True

    def __init__(self, pm: Any, ctx: StageContext, model: Any, sampling: Any, engine_factory: Any, seed: int) -> None:
        import torch

        self.pm, self.ctx = pm, ctx
        from mrl_plugins.weight_sync.sources import inference_copy

        self.model = inference_copy(_unwrap(model))  # PEFT: the merged base model, named as published
        options = dict(ctx.config.rollout.engine_options or {})
        self.engine = engine_factory(
            self.model, None, params=sampling, device=trainer_device(model).spec, seed=seed,
            **({"options": options} if options else {}),
        )  # fmt: skip
        # the weight-sync stage's ends, opened through its plugin's hooks: the receiver loads into this copy
        self.sender = pm.weight_sync_open_sender(
            ctx=ctx, model_id="policy", run_id=f"local{id(self):x}", receivers=1, same_process=True
        )
        self.receiver = pm.weight_sync_open_receiver(
            ctx=ctx, model=self.model, handle=self.sender.receiver_handle(), model_id="policy", rank=0
        )
        self._torch = torch

    def publish(self, version: int, named_tensors: Any) -> Any:
        from mrl_plugins.metrics import record_publish

        report = self.sender.publish(version, named_tensors)
        record_publish(self.ctx.metrics, report)
        return report

    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        from mrl_plugins.metrics import record_switch

        timeout = self.ctx.config.weight_sync.timeout_s
        staged = self.receiver.poll(timeout)
        if staged is not None:
            report = self.receiver.switch(timeout)
            record_switch(self.ctx.metrics, report, self.receiver.stats())
            if getattr(self.engine, "applies_weights", False):  # vLLM: its own copy gets the switched version
                self.engine.apply_weights(version=int(report.to_version) if report is not None else int(staged))
                self.ctx.metrics.gauge("weights/engine_apply_ms", self.engine.last_apply_ms)
        with self.receiver.active():
            version = self.receiver.version
            out = self.engine.generate(prompts, num_generations)
        flat = [list(p) for p in prompts for _ in range(num_generations)]
        return RolloutResult(flat, out.completion_ids, out.logprobs, int(version), model_id)

    def close(self) -> None:
        for end in (self.receiver, self.sender):
            end.close()
        close = getattr(self.engine, "close", None)
        if callable(close):
            close()


class PoolRuntime(ArrangementMixin, MultiTurnMixin):
    """``rollout.workers >= 1``: worker processes, optionally one batch ahead of the trainer.

    The pool is started lazily: by :meth:`start` (the adapter calls it when ``train()`` begins) or by the first
    use (a generation or a weight sync), and :meth:`release` stops it (workers and shared memory gone); a later
    use starts a new one.
    """

    def __init__(
        self,
        pm: Any,
        ctx: StageContext,
        gen: RolloutHost,
        pool_factory: Any,
        local_engine: Any = None,
        balancer_factory: Any = None,
        *,
        warmup: bool | None = None,
        placement: Any = None,
        budgets: dict[str, tuple[list[int], int]] | None = None,
        exact: Any = None,
        spawn_cores: list[int] | None = None,
        lend: bool = False,
    ) -> None:
        """``pool_factory()`` builds the :class:`~mrl_plugins.rollout.pool.WorkerPool`; ``local_engine()``
        (optional) builds an engine on the trainer's own model: it answers while the workers are still starting
        (spawning and importing takes seconds, ``warmup``, default on when it is given), instead of the trainer
        idling; ``balancer_factory(pool)`` (optional, hybrid mode) moves workers between the pools.

        ``placement`` (``rollout.placement: auto``): a :class:`~mrl_plugins.rollout.autoplace.PlacementController`
        choosing per generation between the split (the workers) and taking turns on all cores (``local_engine``);
        ``budgets``: ``{"split": (cores, threads), "turns": (cores, threads)}`` of the trainer process in each;
        ``exact(local)``: called per generation with whether the batch came from the trainer's own current model
        (TRL's importance-sampling pass is then skipped, as in TRL's own generation); ``spawn_cores``: the CPU
        cores the workers are started on (a spawned process inherits the trainer's affinity, and a worker's
        imports and model build would otherwise compete with the trainer on its cores for seconds); ``lend`` (with
        ``budgets``): in the split, once the workers have answered every lookahead they hold they have nothing to
        do until the next generation, and the trainer borrows their cores (all cores, all threads: the turns
        budget) until then, checked between its layers (:meth:`lend_check`)."""
        from .autoplace import SPLIT

        self.pm, self.ctx, self.gen = pm, ctx, gen
        self._pool_factory = pool_factory
        self._balancer_factory = balancer_factory
        self.cfg = ctx.config.rollout
        self._pool: Any = None
        self.balancer: Any = None  # hybrid mode: a HybridBalancer moving workers between the pools
        self._local_factory = local_engine
        self._warmup = local_engine is not None if warmup is None else bool(warmup and local_engine is not None)
        self._local: Any = None
        self.placement = placement
        self._budgets = budgets
        self.exact = exact  # settable after construction (the adapter's importance-sampling switch)
        self._spawn_cores = list(spawn_cores) if spawn_cores else None
        self._lend = bool(lend and budgets)
        self._lend_hooks: list[Any] = []
        self._lent_at: float | None = None  # when the trainer last borrowed the workers' cores
        self._lend_last = 0.0
        self.arrangement = placement.current if placement is not None else SPLIT
        self._budget_now: str | None = None
        self._unpublished = False  # a version was skipped while taking turns: publish before the workers serve
        self._background = False  # the workers were started at the lowest CPU priority (taking turns meanwhile)
        self._start_in_background = False  # taking turns: the workers start at the first generation (or never)
        self._last_gen: tuple[float, float, float, str | None] | None = None  # (start, blocked s, engine s, tag)
        self.served = {"split": 0, "turns": 0, "warmup": 0}  # batches per arrangement (tests, reports)
        self.last_source = ""
        self._batch_exact = False  # every turn of the current batch came from the trainer's own current model
        #: the pool's users: the trainer's thread and, with a rollout run ahead, its thread (adapters.trl_shadow)
        self._lock = threading.RLock()
        self._reset()

    def _reset(self) -> None:
        self._pending: dict[tuple, int] = {}
        self._deferred: tuple[list[list[int]], int, str, int] | None = None
        self._pool_was_ready = False
        self._delivered = 0  # batches the workers delivered to the trainer since the pool started
        self._local_count = 0
        self._ready_reported = False

    # ---------------------------------------------------------------- lifetime
    @property
    def started(self) -> bool:
        return self._pool is not None

    @property
    def pool(self) -> Any:
        """The worker pool, started on first use."""
        if self._pool is None:
            self._start_pool()
        return self._pool

    def start(self) -> None:
        """Start the workers (no-op when running): spawns them and creates the shared memory."""
        if self._pool is not None:
            return
        if self.placement is not None and self.arrangement == "turns":
            # taking turns on all cores; the workers start at the first generation (when the host knows how many
            # are left), at the lowest CPU priority (they take only what the trainer leaves), so that trying the
            # split later does not wait for their start-up -- or never, when the run is too short to choose it
            self._apply_budget("turns")
            self._start_in_background = True
            return
        self._start_pool()

    def _background_start(self, generations_left: int | None) -> None:
        """Taking turns: start the workers now at the lowest priority, unless the run ends before the split could
        ever be chosen (then they would only take memory and CPU)."""
        self._start_in_background = False
        if generations_left is not None and not self.placement.split_possible(generations_left):
            log.info(
                "mrl-plugins placement: %d generations left: too few for the split to be chosen; the rollout workers "
                "are not started (the trainer's own model generates, on all cores)",
                generations_left,
            )
            return
        self._start_pool()
        self._background = self._renice(self.BACKGROUND_NICE)
        self._apply_budget("turns")

    def _start_pool(self) -> None:
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
        if self._balancer_factory is not None:
            self.balancer = self._balancer_factory(self._pool)

    def release(self) -> None:
        """Stop the workers and release their shared memory (fast: a worker still starting is terminated).

        Warns once when the pool ran but delivered no batch (every batch came from the trainer's own model)."""
        with self._lock:
            pool, self._pool, self.balancer = self._pool, None, None
        self._start_in_background = False
        self._budget_now = None  # train() ends: its process state (affinity, threads) is restored by the adapter
        while self._lend_hooks:
            self._lend_hooks.pop().remove()
        self._release_device_lend()  # NPU: the training stream's core limit goes (no-op on CPU)
        if pool is None:
            return
        try:
            if self._delivered == 0 and self._local_count:
                ready = pool.ready_s
                log.warning(
                    "mrl-plugins: the rollout workers delivered no batch in this run (%s); all %d generation%s "
                    "came from the trainer's own model (rollout.local_warmup). Worker start-up (spawn, imports, "
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

    replaces_host = True  # a RolloutRuntime (mrl_plugins.hookspecs.channels): TRL generates through it

    def publish(self, version: int, named_tensors: Any) -> Any:
        """Every sync goes through the pool: its workers get a notice."""
        with self._lock:
            return self._publish(version, named_tensors)

    def _publish(self, version: int, named_tensors: Any) -> Any:
        if self.placement is not None and self.arrangement == "turns":
            self._unpublished = True  # the trainer's own model generates: no worker needs (or computes) it
            return None
        self._unpublished = False  # the workers get the current version
        return self.pool.publish(version, named_tensors)

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

    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        with self._lock:
            t0 = time.perf_counter()
            self._place(t0)
            if self.arrangement == "turns":
                result, engine_s, tag = self._generate_turns(prompts, num_generations, model_id)
            else:
                result, engine_s, tag = self._generate_split(prompts, num_generations, model_id)
            self._served(t0, time.perf_counter() - t0, engine_s, tag)
            return result

    def _place(self, t0: float) -> None:
        """``placement: auto``: the interval since the previous batch as a sample; switch where it decides."""
        if self.placement is not None:
            self._observe(t0)
            left = self.gen.steps_left()
            left = None if left is None else -(-left // self.generation_interval())  # generations left
            if self._start_in_background and self._pool is None:
                self._background_start(left)
            target = self.placement.check(left)
            if target != self.arrangement:
                self.arrangement = target
                self.ctx.metrics.add("rollout/placement_switch_batches", 1)
            self.placement.report()

    def _served(self, t0: float, blocked: float, engine_s: float, tag: str | None) -> None:
        """Bookkeeping of a batch handed to the trainer: who generated it, TRL's importance-sampling switch."""
        self._batch_exact = tag in ("turns", "warmup")
        if self.exact is not None:  # the trainer's own current model generated: no importance sampling
            self.exact(self._batch_exact)
        self.last_source = tag or "split"  # who generated this batch: split (workers), turns or warmup (trainer)
        self.served[self.last_source] += 1
        self._last_gen = (t0, blocked, engine_s, tag)

    def _generate_split(
        self, prompts: list[list[int]], num_generations: int, model_id: str
    ) -> tuple[RolloutResult, float, str | None]:
        metrics = self.ctx.metrics
        self._apply_budget("split")  # before the workers compute again on their cores
        pool = self.pool
        self._foreground(now=True)  # their cores are their own again: finish starting at normal priority
        if self._unpublished:  # versions skipped while taking turns: the workers get the current one now
            self._unpublished = False
            self.gen.sync_weights()
        current = self.gen.version
        ticket = self._pending.pop(_key(prompts), None)
        warming = self._warmup and not self._pool_was_ready
        if warming:
            self._pool_was_ready = pool.ready  # once ready, a worker that moves or restarts is not a warm-up
            warming = not self._pool_was_ready
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
            if self.balancer is not None:
                self.balancer.observe(waited)
            engine_s, tag = float(result.metrics.get("generate_s", 0.0)), "split"
            metrics.add("rollout/worker_batches", 1)  # generated by the workers' engine (local ones: local_batches)
        stale = current - result.weight_version
        if stale > self.cfg.staleness_bound:
            metrics.add("rollout/stale_samples", len(result.completion_ids))
            if self.cfg.stale_policy == "drop":
                metrics.add("rollout/dropped_samples", len(result.completion_ids))
                ticket = pool.submit(prompts, num_generations, model_id=model_id, min_version=current)
                result = self._collect(ticket)
        # the lookahead goes to the workers only once they can take it: submitted while they start, it would
        # wait in their queue and be discarded when the trainer's own model answers the next batch too
        if self.cfg.pipeline == "async" and (not warming or pool.ready):
            nxt = self._next_prompts(prompts)
            if nxt is not None:
                every = self.generation_interval()
                if every <= 1:
                    self._pending[_key(nxt)] = pool.submit(
                        nxt, num_generations, model_id=model_id, min_version=current
                    )
                else:  # submitted one optimizer step before it is needed: one version stale, not `every`
                    self._deferred = (nxt, num_generations, model_id, current + every - 1)
        metrics.update("rollout", {"generate_s": result.metrics.get("generate_s", 0.0)})
        if result.metrics.get("engine_apply_ms"):
            metrics.gauge("weights/engine_apply_ms", result.metrics["engine_apply_ms"])
        metrics.update(pool.stats(), gauge=True)
        if self._lend and tag == "split":
            self._install_lend_hooks()
        if pool.ready_s is not None and not self._ready_reported:
            metrics.gauge("rollout/worker_ready_s", pool.ready_s)
            self._ready_reported = True
        return result, engine_s, tag

    def _wait_for_workers(self, pool: Any) -> None:
        """Wait for the workers to be ready, saying so on stderr after a second and every 5 s (at most
        ``rollout.start_timeout_s`` from their start)."""
        import sys

        what = f"{pool.n} rollout worker{'s' if pool.n != 1 else ''} ({self.cfg.engine} engine)"

        bound = self.cfg.start_timeout_s

        def progress(seconds: float) -> None:
            say = f"waiting for {what} to start: {seconds:.0f} s so far, at most {bound:g} s (1.5 x timeout_s)"
            print(f"mrl-plugins: {say}", file=sys.stderr, flush=True)

        waited = pool.wait_ready(progress, first=1.0, every=5.0)
        if waited >= 1.0:
            since = time.monotonic() - pool.started_at
            print(f"mrl-plugins: {what} ready {since:.1f} s after the start; generating with it", file=sys.stderr)
        self.ctx.metrics.add("rollout/start_wait_s", waited)

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
        self._apply_budget("split")  # lent cores back before the workers compute again
        self.gen.sync_weights()
        self._pending[_key(nxt)] = self.pool.submit(
            nxt, num_generations, model_id=model_id, min_version=self.gen.version
        )
        self.ctx.metrics.add("rollout/deferred_lookaheads", 1)

    def _drop_unused(self) -> None:
        """A lookahead that was not asked for (data order changed) is discarded without waiting for it."""
        self._deferred = None
        for key in list(self._pending):
            self.pool.discard(self._pending.pop(key))

    def _next_prompts(self, current: list[list[int]]) -> list[list[int]] | None:
        """The host's next batch after ``current`` (None where it cannot tell: no lookahead)."""
        return self.gen.next_prompts(current) if self.gen.lookahead else None


def _unwrap(model: Any) -> Any:
    return getattr(model, "module", model)
