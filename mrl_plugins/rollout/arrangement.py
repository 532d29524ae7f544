"""Where generation runs: the one owner of that choice for a :class:`~mrl_plugins.rollout.runtime.PoolRuntime`.

:class:`Placement` decides, for every batch the host asks for, who generates it:

* **warm-up** -- the trainer's own model while the workers start (``rollout.local_warmup``: resolved from the
  engine's registration), until the pool first reports ready;
* **split** or **turns** -- with ``rollout.placement: auto`` the
  :class:`~mrl_plugins.rollout.autoplace.PlacementController` (its policy is pure functions in
  :mod:`~mrl_plugins.rollout.autoplace`) chooses per generation from the samples this class feeds it; a run that
  starts taking turns starts its workers at the first generation in the background (lowest CPU priority), or never
  when the run is too short for the split to be chosen; with ``placement: fixed`` always the split;
* the trainer's share of the machine, lent the idle workers' share (:class:`TrainerShare`);
* hybrid rebalancing (``rollout.rebalance``): the :class:`~mrl_plugins.rollout.hybrid.HybridBalancer` moving workers
  between the colocated and dedicated pools by the trainer's wait share.

The runtime asks :meth:`Placement.place` before each batch and generates where it says; it reports what it served
(:meth:`Placement.served`) and what the trainer waited (:meth:`Placement.waited`). Invariants: ``arrangement`` is
``"split"`` without a controller; the workers' priority is raised back before they serve the split
(:meth:`Placement.foreground`); a lent share goes back before the workers get a request
(``share.apply("split")``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("mrl_plugins.rollout")


def trainer_device(model: Any) -> Any:
    """The :class:`~mrl_plugins.device.Device` the trainer's model lives on (CPU for a model without parameters)."""
    from mrl_plugins.device import CpuDevice, get_device

    model = getattr(model, "module", model)
    try:
        dev = next(model.parameters()).device
    except StopIteration:
        return CpuDevice()
    return CpuDevice() if dev.type == "cpu" else get_device(f"{dev.type}:{dev.index or 0}")


def prompt_key(prompts: list[list[int]]) -> tuple[tuple[int, ...], ...]:
    """A batch of prompt ids as a hashable key (lookahead tickets are filed under it)."""
    return tuple(tuple(int(t) for t in p) for p in prompts)


class TrainerShare:
    """The trainer process's share of the machine in each arrangement, and lending it the idle workers' share.

    CPU: the process's core affinity and torch threads (``budgets``: ``{"split": (cores, threads), "turns": (cores,
    threads)}``); an NPU shared with colocated workers: its training stream's core limit
    (:class:`~mrl_plugins.device.lending.NpuStreamLender`, opened at the first change, with ``lend``: placement
    auto, ``rollout.lend_cores``, a weight path that is not a collective). Inside the split, once ``idle()`` says
    the workers have answered every request they hold (nothing to generate until the next generation), the trainer
    borrows their share (CPU: the turns budget; NPU: the whole device) until the next :meth:`apply`, checked between
    its layers (:meth:`check`, forward and backward pre-hooks on the model's decoder layers).

    Invariants: ``now`` is the share applied (``"split"``, ``"turns"``, ``"lent"``; None before the first and after
    :meth:`release`); lending never fails a training step (a failure stops lending, logged).
    """

    #: seconds between two looks at the workers' answers while the trainer computes (lending)
    CHECK_S = 0.002

    def __init__(
        self,
        ctx: Any,
        model: Callable[[], Any],
        budgets: dict[str, tuple[list[int], int]] | None,
        *,
        lend: bool,
        idle: Callable[[], bool],
    ) -> None:
        self.ctx, self._model, self.budgets = ctx, model, budgets  # model(): the trainer's model, read when needed
        self.lend_cpu = bool(lend and budgets)  # CPU cores to lend (placement auto with budgets and lend_cores)
        self._lend_device = bool(lend)  # an NPU stream share, where the device has one to lend (lend: placement auto)
        self._idle = idle
        self.now: str | None = None
        self.hooks: list[Any] = []
        self.device_lender: Any = None
        self._device_open = False
        self._lent_at: float | None = None  # when the trainer last borrowed the workers' share
        self._last = 0.0

    def apply(self, arrangement: str) -> None:
        """The trainer's cores and torch threads for ``arrangement`` (CPU; no-op without budgets) and, on an NPU
        shared with a worker, its training stream's core limit."""
        lender = self.device()
        cpu = self.budgets is not None and arrangement in self.budgets
        if self.now == arrangement or not (cpu or lender is not None):
            return
        if cpu:
            cores, threads = self.budgets[arrangement]
            self._set(cores, threads)
        if lender is not None:  # the split's share before the workers compute again; the whole device otherwise
            lender.split() if arrangement == "split" else lender.lend()
            if arrangement == "split":
                self.install_hooks()
        lent, self._lent_at = self._lent_at, None
        if lent is not None:  # the workers' share goes back before their next request
            self.ctx.metrics.add("rollout/lent_s", time.perf_counter() - lent)
        elif cpu:
            log.info("mrl-plugins placement %s: trainer on cores %s, %d torch thread(s)", arrangement, cores, threads)
        self.now = arrangement

    @staticmethod
    def _set(cores: list[int], threads: int) -> None:
        import os

        import torch

        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)

    def device(self) -> Any:
        """This run's NPU stream lender, opened at the first share change: with ``lend`` (see the class), the
        trainer on an NPU that colocated workers share with an ``engine_budget`` core limit and torch_npu's
        stream-limit API present; else None, with one info line saying why (CUDA: nothing to lend). CPU runs never
        import torch_npu here."""
        if self._device_open:
            return self.device_lender
        self._device_open = True
        if not self._lend_device:
            return None
        device = trainer_device(self._model())
        if device.type == "cpu":
            return None
        from mrl_plugins.device.lending import open_lender
        from mrl_plugins.device.placement import colocated_count

        cfg = self.ctx.config
        rc = cfg.rollout
        colocated = colocated_count(cfg.mode, rc.workers, rc.colocated_workers)
        try:
            lender, why = open_lender(device, rc.engine_budget, colocated)
        except Exception as exc:  # noqa: BLE001 - a device query failing costs the lending, never the run
            lender, why = None, f"{type(exc).__name__}: {exc}"
        if lender is None:
            log.info("mrl-plugins rollout.lend_cores on %s: %s", device.spec, why)
        else:
            what = lender.describe()
            log.info("mrl-plugins rollout.lend_cores on %s (unverified on hardware): %s", device.spec, what)
        self.device_lender = lender
        return lender

    @property
    def lending(self) -> bool:
        """CPU cores or an NPU stream share to lend."""
        return self.lend_cpu or self.device_lender is not None

    def check(self, *_: Any) -> None:
        """Between the trainer's layers in the split: when the workers are idle, the trainer borrows their share
        (the next :meth:`apply` gives it back)."""
        if not self.lending or self.now != "split":
            return
        now = time.perf_counter()
        if now - self._last < self.CHECK_S:
            return
        self._last = now
        try:
            if not self._idle():
                return
            if self.device_lender is not None:
                self.device_lender.lend()
        except Exception as exc:  # noqa: BLE001 - never fail a training step over lending: stop lending
            log.warning("mrl-plugins: lending the workers' cores stopped (%s: %s)", type(exc).__name__, exc)
            self.lend_cpu, self.device_lender = False, None
            return
        if self.lend_cpu:
            self._set(*self.budgets["turns"])
        self.now = "lent"
        self._lent_at = now
        self.ctx.metrics.add("rollout/lends", 1)

    def install_hooks(self) -> None:
        """Forward and backward pre-hooks on the trainer model's layers (or the model) calling :meth:`check`."""
        if self.hooks or not self.lending:
            return
        model = self._model()
        layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))]
        for m in layers or [model]:
            self.hooks.append(m.register_forward_pre_hook(self.check))
            self.hooks.append(m.register_full_backward_pre_hook(self.check))

    def release(self) -> None:
        """``train()`` ends: hooks removed, the training stream back to torch_npu's default limit; the process's
        affinity and threads are restored by the adapter. A later use opens a lender again."""
        self.now = None
        while self.hooks:
            self.hooks.pop().remove()
        lender, self.device_lender = self.device_lender, None
        self._device_open = False
        if lender is not None:
            lender.close()


class Placement:
    """Where each batch is generated (see the module docstring), and the workers' CPU priority while they start in
    the background.

    ``controller``: the :class:`~mrl_plugins.rollout.autoplace.PlacementController` (``placement: auto``) or None;
    ``warmup``: the trainer's own model answers while the workers start; ``balancer_factory(pool)``: hybrid
    rebalancing's balancer for a started pool (or None); ``budgets`` / ``lend`` / ``idle``: the
    :class:`TrainerShare`'s; ``interval()``: optimizer steps per generation (samples are per step).
    """

    #: nice value of rollout workers started while the trainer takes turns on all cores (placement auto)
    BACKGROUND_NICE = 19

    def __init__(
        self,
        ctx: Any,
        model: Callable[[], Any],
        *,
        controller: Any,
        warmup: bool,
        budgets: dict[str, tuple[list[int], int]] | None,
        lend: bool,
        idle: Callable[[], bool],
        balancer_factory: Callable[[Any], Any] | None,
        interval: Callable[[], int],
    ) -> None:
        from .autoplace import SPLIT

        self.ctx = ctx
        self.controller = controller
        self.arrangement = controller.current if controller is not None else SPLIT
        self.warmup = warmup
        self.share = TrainerShare(ctx, model, budgets, lend=lend, idle=idle)
        self._balancer_factory = balancer_factory
        self.interval = interval  # optimizer steps per generation (the host's generation interval)
        self.balancer: Any = None
        self.background = False  # the workers were started at the lowest CPU priority (taking turns meanwhile)
        self.start_deferred = False  # taking turns: the workers start at the first generation (or never)
        self._was_ready = False  # the pool has reported ready once: no more warm-up
        self._last: tuple[float, float, float, str | None] | None = None  # (start, blocked s, engine s, tag)

    # ---------------------------------------------------------------- the pool's lifetime
    def defer_start(self) -> bool:
        """At ``train()`` start: True when the run takes turns first (the trainer on all cores now, its workers
        started at the first generation, :meth:`place`); False: start the workers now."""
        if self.controller is None or self.arrangement != "turns":
            return False
        self.share.apply("turns")
        self.start_deferred = True
        return True

    def started(self, pool: Any) -> None:
        """A new pool runs: warm-up until it reports ready; hybrid rebalancing gets its balancer."""
        self._was_ready = False
        if self._balancer_factory is not None:
            self.balancer = self._balancer_factory(pool)

    def released(self) -> None:
        """The pool is released (``train()`` ends): no balancer, no deferred start, the trainer's share let go."""
        self.balancer = None
        self.start_deferred = False
        self.share.release()

    # ---------------------------------------------------------------- per batch
    def place(self, t0: float, generations_left: int | None, start_pool: Callable[[], Any]) -> str:
        """Before a batch at ``t0``: the interval since the previous one as a sample, a deferred start done or
        skipped, the controller's choice; returns the arrangement for this batch."""
        if self.controller is None:
            return self.arrangement
        self._observe(t0)
        if self.start_deferred:
            self._background_start(generations_left, start_pool)
        self.arrangement = self.controller.check(generations_left)  # a switch counted as rollout/placement_switches
        self.controller.report()
        return self.arrangement

    def warming(self, pool: Any, *, settle: bool = True) -> bool:
        """In the split: whether the trainer's own model answers this batch because the workers are still starting
        (once ready, a worker that moves or restarts is no warm-up); ``settle=False`` (a follow-up turn) asks
        without marking the pool ready."""
        if not self.warmup or self._was_ready:
            return False
        if not settle:
            return not pool.ready
        self._was_ready = pool.ready
        return not self._was_ready

    def served(self, t0: float, blocked: float, engine_s: float, tag: str | None) -> None:
        """A batch handed to the host: who generated it (``tag``: split, turns, warmup; None: a lookahead of the
        split taken while taking turns), how long the host was blocked and the engine ran."""
        self._last = (t0, blocked, engine_s, tag)

    def waited(self, seconds: float) -> None:
        """The trainer waited ``seconds`` for the workers' batch (hybrid rebalancing's signal)."""
        if self.balancer is not None:
            self.balancer.observe(seconds)

    def _observe(self, now: float) -> None:
        """The interval since the previous generation, per optimizer step, as one placement sample."""
        from .autoplace import Sample

        last = self._last
        if last is None:
            return
        start, blocked, engine_s, tag = last
        every = self.interval()
        interval = now - start
        if tag not in ("split", "turns") or interval <= 0:
            self.controller.observe(None)  # warm-up or the switch itself: not a measurement of either
            return
        self.controller.observe(
            Sample(tag, interval / every, max(0.0, interval - blocked) / every, max(0.0, engine_s) / every)
        )

    # ---------------------------------------------------------------- the workers' priority
    def _background_start(self, generations_left: int | None, start_pool: Callable[[], Any]) -> None:
        """Taking turns: start the workers now at the lowest priority, unless the run ends before the split could
        ever be chosen (then they would only take memory and CPU)."""
        self.start_deferred = False
        if generations_left is not None and not self.controller.split_possible(generations_left):
            log.info(
                "mrl-plugins placement: %d generations left: too few for the split to be chosen; the rollout workers "
                "are not started (the trainer's own model generates, on all cores)",
                generations_left,
            )
            return
        pool = start_pool()
        self.background = self._renice(pool, self.BACKGROUND_NICE)
        self.share.apply("turns")

    def foreground(self, pool: Any, now: bool = False) -> None:
        """The workers were started in the background and are ready (or, ``now``, the split needs them): back to
        normal priority (where allowed)."""
        if self.background and pool is not None and (now or pool.ready):
            self.background = False
            self._renice(pool, 0)

    @staticmethod
    def _renice(pool: Any, nice: int) -> bool:
        """Set the local workers' nice value, on every thread (Linux: a nice value is per thread, and a thread
        inherits its creator's). Raising it is always allowed; lowering it back may need privileges (CAP_SYS_NICE or
        RLIMIT_NICE): then they keep the low priority, which costs nothing while they have their cores to
        themselves."""
        import os

        done = False
        for pid in pool.pids if pool is not None else ():
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:  # no /proc (not Linux: a nice value per process), or the worker is gone
                tids = [pid]
            for tid in tids:
                try:
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
                    done = True
                except OSError as exc:  # not permitted, or the thread / worker ended meanwhile
                    log.debug("rollout worker %d (thread %d): nice %d not applied (%s)", pid, tid, nice, exc)
        return done
