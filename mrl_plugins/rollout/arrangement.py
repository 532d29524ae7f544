"""The placement side of :class:`~mrl_plugins.rollout.runtime.PoolRuntime` (``rollout.placement: auto``).

:class:`ArrangementMixin` holds what taking turns and lending need from a running pipeline: the trainer
process's budget per arrangement (CPU affinity and torch threads), the workers' CPU priority while they start in
the background, the per-generation samples fed to the
:class:`~mrl_plugins.rollout.autoplace.PlacementController`, the turns arrangement's generation, and lending the
idle workers' cores to the trainer inside the split. The decisions themselves are pure functions in
:mod:`mrl_plugins.rollout.autoplace`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from mrl_plugins.hookspecs import RolloutResult

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


class ArrangementMixin:
    """Mixed into :class:`~mrl_plugins.rollout.runtime.PoolRuntime`; uses its pool, budgets and bookkeeping."""

    _pool: Any
    _pending: dict
    _budgets: dict[str, tuple[list[int], int]] | None
    _lock: Any

    #: nice value of rollout workers started while the trainer takes turns on all cores (placement auto)
    BACKGROUND_NICE = 19

    def _renice(self, nice: int) -> bool:
        """Set the local workers' nice value (raising it is always allowed; lowering it back may need privileges:
        then they keep the low priority, which costs nothing while they have their cores to themselves)."""
        import os

        done = False
        for pid in self._pool.pids if self._pool is not None else ():
            try:
                os.setpriority(os.PRIO_PROCESS, pid, nice)
                done = True
            except (PermissionError, ProcessLookupError, OSError) as exc:
                log.debug("rollout worker %d: nice %d not applied (%s)", pid, nice, exc)
        return done

    def _foreground(self, now: bool = False) -> None:
        """The workers were started in the background and are ready (or, ``now``, the split needs them): back to
        normal priority (where allowed)."""
        if self._background and self._pool is not None and (now or self._pool.ready):
            self._background = False
            self._renice(0)

    def _apply_budget(self, arrangement: str) -> None:
        """The trainer process's cores and torch threads for ``arrangement`` (CPU; no-op without budgets) and, on
        an NPU shared with a worker, its training stream's core limit (:meth:`_device_lend`)."""
        lender = self._device_lend()
        cpu = self._budgets is not None and arrangement in self._budgets
        if self._budget_now == arrangement or not (cpu or lender is not None):
            return
        if cpu:
            import os

            import torch

            cores, threads = self._budgets[arrangement]
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
        if lender is not None:  # the split's share before the workers compute again; the whole device otherwise
            lender.split() if arrangement == "split" else lender.lend()
            if arrangement == "split":
                self._install_lend_hooks()
        lent, self._lent_at = self._lent_at, None
        if lent is not None:  # the workers' cores go back before their next request
            self.ctx.metrics.add("rollout/lent_s", time.perf_counter() - lent)
        elif cpu:
            log.info("mrl-plugins placement %s: trainer on cores %s, %d torch thread(s)", arrangement, cores, threads)
        self._budget_now = arrangement

    _device_lender: Any = None
    _device_lend_open = False

    def _device_lend(self) -> Any:
        """The :class:`~mrl_plugins.device.lending.NpuStreamLender` of this run, opened at the first budget change:
        ``rollout.placement: auto`` with ``lend_cores``, the trainer on an NPU that colocated workers share with an
        ``engine_budget`` core limit and torch_npu's stream-limit API present; else None, with one info line saying
        why (CUDA: nothing to lend). CPU runs never import torch_npu here."""
        if self._device_lend_open:
            return self._device_lender
        self._device_lend_open = True
        if getattr(self, "placement", None) is None or not self.ctx.config.rollout.lend_cores:
            return None
        device = trainer_device(self.gen.model)
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
        self._device_lender = lender
        return lender

    def _release_device_lend(self) -> None:
        """The training stream back to torch_npu's default limit (the run ends)."""
        lender, self._device_lender = self._device_lender, None
        self._device_lend_open = False  # a later use of this runtime (a new pool) opens a lender again
        if lender is not None:
            lender.close()

    #: seconds between two looks at the workers' answers while the trainer computes (lending)
    LEND_CHECK_S = 0.002

    def lend_check(self, *_: Any) -> None:
        """Between the trainer's layers (forward and backward hooks) in the split: when the workers have answered
        every lookahead they hold (nothing left to generate until the next generation), the trainer borrows their
        cores (CPU: affinity and threads; NPU: the whole device for its training stream);
        :meth:`_generate_split` gives them back before it sends the next request."""
        if not self._lending() or self._budget_now != "split" or self.arrangement != "split" or not self._pending:
            return
        now = time.perf_counter()
        if now - self._lend_last < self.LEND_CHECK_S:
            return
        self._lend_last = now
        if not self._lock.acquire(blocking=False):  # a rollout run ahead is using the pool: look next time
            return
        try:
            pool = self._pool
            if pool is None or not pool.ready:
                return
            pool.poll()
            if not all(pool.answered(t) for t in self._pending.values()):
                return
            if self._device_lender is not None:
                self._device_lender.lend()
        except Exception as exc:  # noqa: BLE001 - never fail a training step over lending: stop lending
            log.warning("mrl-plugins: lending the workers' cores stopped (%s: %s)", type(exc).__name__, exc)
            self._lend, self._device_lender = False, None
            return
        finally:
            self._lock.release()
        if self._lend:
            import os

            import torch

            cores, threads = self._budgets["turns"]
            os.sched_setaffinity(0, cores)
            torch.set_num_threads(threads)
        self._budget_now = "lent"  # the next generation applies the split's budget again first
        self._lent_at = now
        self.ctx.metrics.add("rollout/lends", 1)

    def _lending(self) -> bool:
        """CPU cores (``_lend``: budgets given) or an NPU stream share (:meth:`_device_lend`) to lend."""
        return bool(self._lend) or self._device_lender is not None

    def _install_lend_hooks(self) -> None:
        """Forward and backward pre-hooks on the trainer model's layers (or the model) calling :meth:`lend_check`."""
        if self._lend_hooks or not self._lending():
            return
        model = self.gen.model
        layers = [m for m in model.modules() if type(m).__name__.endswith(("DecoderLayer", "Block"))] or [model]
        for m in layers:
            self._lend_hooks.append(m.register_forward_pre_hook(self.lend_check))
            self._lend_hooks.append(m.register_full_backward_pre_hook(self.lend_check))

    # ---------------------------------------------------------------- generation

    def _observe(self, now: float) -> None:
        """The interval since the previous generation, per optimizer step, as one placement sample."""
        from .autoplace import Sample

        last = self._last_gen
        if last is None:
            return
        start, blocked, engine_s, tag = last
        every = self.generation_interval()
        interval = now - start
        if tag not in ("split", "turns") or interval <= 0:
            self.placement.observe(None)  # warm-up or the switch itself: not a measurement of either
            return
        self.placement.observe(
            Sample(tag, interval / every, max(0.0, interval - blocked) / every, max(0.0, engine_s) / every)
        )

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
        # all cores once no worker computes at normal priority: one starting beside the trainer at the same
        # priority would share its cores (15-200x slower); started in the background it takes only what is left
        ready = self._pool is None or self._pool.ready
        self._foreground()
        self._apply_budget("turns" if ready or self._background else "split")
        if ticket is None:
            t0 = time.perf_counter()
            result = self._generate_locally(prompts, num_generations, model_id, warmup=False)
            engine_s = time.perf_counter() - t0
        return result, engine_s, tag
