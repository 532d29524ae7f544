"""Multi-turn rollouts on :class:`~mrl_plugins.rollout.runtime.PoolRuntime`: follow-up turns and batches run ahead.

A multi-turn rollout (TRL's tool loop, a ``rollout_func``) asks for more than the batch's first turn: each follow-up
turn (the conversation so far, tool results appended) is one more generation, decided only when the previous turn
and its tools are done. :meth:`MultiTurnMixin.generate_turn` serves one such turn where the current arrangement
generates, without touching the first-turn lookahead or the placement measurements.

With ``ahead=True`` the turn comes from a thread that rolls the *next* batch out while the trainer trains
(:mod:`mrl_plugins.adapters.trl_shadow`): it is submitted to the workers under the runtime's lock and waited for
outside it, so the trainer's own calls (publishing a version at a step end, lending checks) are never held up by a
turn in flight; :meth:`MultiTurnMixin.take_ahead` books such a batch when the trainer takes it.
"""

from __future__ import annotations

import time
from typing import Any

from mrl_plugins.hookspecs import RolloutResult

#: seconds between two looks at the workers' answers while a turn run ahead is in flight: from the first to the
#: last, doubling (the thread shares the trainer's cores: looking every 2 ms took ~40 % of its CPU time, measured)
AHEAD_POLL_S = (0.001, 0.01)


class AheadUnavailable(Exception):  # noqa: N818 - a state, not a fault
    """The workers stopped serving the split while a batch was rolled out ahead (released, or the run switched to
    taking turns): the trainer rolls that batch out itself when it comes to it."""


class MultiTurnMixin:
    """Mixed into :class:`~mrl_plugins.rollout.runtime.PoolRuntime`; uses its pool, lock and bookkeeping."""

    _lock: Any
    _pool: Any
    _batch_exact: bool

    def generate_turn(self, prompts: list[list[int]], model_id: str, *, ahead: bool = False) -> RolloutResult:
        """A follow-up turn: one completion per prompt, now, with the current version, where this batch's
        arrangement generates (the workers in the split; the trainer's own model while taking turns or warming
        up). ``ahead``: from the thread rolling the next batch out (the workers only, see the module docstring)."""
        if ahead:
            return self._turn_ahead(prompts, model_id)
        with self._lock:
            local = self.arrangement == "turns" or (self._warmup and not self._pool_was_ready and not self.pool.ready)
            if local:
                result = self._generate_locally(prompts, 1, model_id, warmup=self.arrangement != "turns")
            else:
                pool = self._split_pool()
                result = self._collect(pool.submit(prompts, 1, model_id=model_id, min_version=self.gen.version))
                self.ctx.metrics.add("rollout/worker_batches", 1)
            self._batch_exact = self._batch_exact and local  # one turn from the workers: TRL's correction stays on
            if self.exact is not None:
                self.exact(self._batch_exact)
            return result

    def _split_pool(self) -> Any:
        """The pool, ready to take a request in the split: the trainer's lent cores back, the current version
        published, the workers started."""
        self._apply_budget("split")
        pool = self.pool
        self._foreground(now=True)
        if self._unpublished:
            self._unpublished = False
            self.gen.sync_weights()
        if not pool.ready:
            self._wait_for_workers(pool)
        return pool

    def _turn_ahead(self, prompts: list[list[int]], model_id: str) -> RolloutResult:
        from mrl_plugins.errors import StageTimeoutError

        with self._lock:
            pool = self._pool
            if pool is None or self.arrangement != "split":
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
                pool._check_workers()
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
