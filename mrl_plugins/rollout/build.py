"""The ``mrl`` rollout stage's trainer side, built for the host (``RolloutStage.open_runtime``).

No local or remote workers: a :class:`~mrl_plugins.rollout.runtime.LocalEngineRuntime`. Otherwise a
:class:`~mrl_plugins.rollout.runtime.PoolRuntime` over a :class:`~mrl_plugins.rollout.pool.WorkerPool` started when
``train()`` begins, with the trainer's own model answering while the workers start (``rollout.local_warmup``) and,
with ``rollout.rebalance``, a :class:`~mrl_plugins.rollout.hybrid.HybridBalancer`. Either one opens the weight-sync
and comm ends through the stages' hooks (``ctx.plugins``) and owns them.
"""

from __future__ import annotations

from typing import Any

from mrl_plugins.hookspecs import RolloutSetup, StageContext

from .config import ENGINES, configured_engine


def open_runtime(ctx: StageContext, setup: RolloutSetup) -> Any:
    """The runtime for ``setup`` (see the module docstring)."""
    from .runtime import LocalEngineRuntime, PoolRuntime

    pm, cfg = ctx.plugins, ctx.config
    trainer, model, sampling, seed, device = setup.host, setup.model, setup.sampling, setup.seed, setup.device
    engine = configured_engine(pm, cfg)  # with what it declares it can do
    if setup.placements is None:
        return LocalEngineRuntime(pm, ctx, model, sampling, engine, seed)
    places, _trainer_cores, shared = setup.placements
    score_models = dict(setup.score_models) or None

    def start_pool() -> Any:  # at train() start or the first generation, not at enable()
        from mrl_plugins.weight_sync.sources import iter_trainer_weights

        from .pool import WorkerPool

        pool = WorkerPool(
            pm, ctx, model, sampling, placements=places, engine=engine, seed=seed, score_models=score_models,
        )  # fmt: skip
        for mid, scored in (score_models or {}).items():
            pool.publish(0, iter_trainer_weights(scored, getattr(trainer, "accelerator", None)), model_id=mid)
        return pool

    # the warm-up engine runs in the trainer process: always the light 'transformers' one (a vLLM engine there
    # would take far longer to start than the workers it stands in for)
    local_factory = pm.backend(ENGINES, "transformers").factory

    def local_engine() -> Any:  # the trainer's own model answers while the workers start
        from .engine import build_engine

        was_training = model.training
        engine = build_engine(local_factory, model, sampling, device=str(device.torch_device), seed=seed)
        model.train(was_training)  # engines may switch their model to eval mode when built
        return engine

    balancer = None
    if cfg.rollout.rebalance:

        def balancer(pool: Any) -> Any:
            from .hybrid import COLOCATED, DEDICATED, HybridBalancer

            rc = cfg.rollout
            kinds = [COLOCATED if i < rc.colocated_workers else DEDICATED for i in range(rc.workers)]
            return HybridBalancer(
                pool,
                places,
                kinds,
                shared,
                window=rc.rebalance_window,
                high=rc.rebalance_high,
                low=rc.rebalance_low,
                metrics=ctx.metrics,
            )

    # placement auto: the trainer's own model also generates while the run takes turns on all cores
    auto = cfg.rollout.fixed_by(cfg.mode, setup.processes, engine) is None
    return PoolRuntime(
        pm,
        ctx,
        setup.generation,
        start_pool,
        local_engine if cfg.rollout.warmup or auto else None,
        balancer_factory=balancer,
        **placement_kwargs(ctx, places, _trainer_cores, device.type, auto),
    )


def placement_kwargs(
    ctx: StageContext, places: list[dict], trainer_cores: list[int] | None, device_type: str, auto: bool
) -> dict:
    """:class:`~mrl_plugins.rollout.runtime.PoolRuntime` keyword arguments from the config and the workers'
    placements: the cores the workers are spawned on (CPU), the warm-up switch and, where ``rollout.placement:
    auto`` decides (``auto``), the controller and the trainer's budget in each arrangement (split: as configured;
    turns: every core of the trainer and its workers, one torch thread each) and whether it lends
    (``rollout.lend_cores``)."""
    import os

    from .autoplace import SPLIT, TURNS, PlacementController, default_scaling

    cfg = ctx.config
    rc = cfg.rollout
    worker_cores = sorted({c for p in places for c in (p.get("cores") or [])}) if device_type == "cpu" else []
    out: dict[str, Any] = {"spawn_cores": worker_cores or None, "warmup": rc.warmup}
    if not auto:
        return out
    budgets = None
    wide, narrow = len(os.sched_getaffinity(0)), rc.trainer_threads
    if trainer_cores and device_type == "cpu":
        split = (list(trainer_cores), max(1, min(rc.trainer_threads, len(trainer_cores))))
        cores = sorted(set(trainer_cores) | set(worker_cores))
        budgets = {SPLIT: split, TURNS: (cores, len(cores))}
        wide, narrow = len(cores), split[1]
    out["controller"] = PlacementController(
        default_scaling(narrow, wide, rc.engine_threads),
        initial=rc.placement_start,
        interval=rc.placement_interval,
        margin=rc.placement_margin,
        metrics=ctx.metrics,
    )
    out["budgets"] = budgets
    # a publish every worker joins as it runs (a collective group, e.g. the upstream weight sync's per-parameter
    # one) cannot be timed around a lend: no lending
    out["lend"] = bool(rc.lend_cores) and not ctx.plugins.capabilities("weight_sync", ctx).collective
    return out
