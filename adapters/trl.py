"""TRL binding: ``mrl_plugins.enable(trainer, config)`` for GRPOTrainer and RLOOTrainer.

The seam is TRL's own: an object with ``trainer.vllm_generation``'s interface plus
``use_vllm=True``, so TRL keeps its weight-sync schedule and its importance-sampling correction.
With every stage on ``upstream`` nothing of TRL is replaced: only ``mrl/...`` metrics are added
to the logs, and a run equals vanilla TRL step for step.

``enable`` is check -> plan -> apply: everything that can fail (TRL version, trainer type, the TRL members used,
config, plugin and backend names, device, placement) is checked before the trainer is touched; the plan is where
the workers run; applying installs the stages and is undone if it fails half-way. Every member of the trainer
this package reads, wraps or sets is listed in :mod:`mrl_plugins.adapters.trl_members`.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import weakref
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from mrl_plugins.adapters.trl_lifetime import State, at_exit, wrap_train
from mrl_plugins.adapters.trl_members import check_members
from mrl_plugins.device.placement import worker_placements as _placements
from mrl_plugins.errors import ConfigError, MrlError, PluginError, UnsupportedVersionError, choices
from mrl_plugins.rollout.config import configured_engine

log = logging.getLogger("mrl_plugins.adapters.trl")

#: TRL releases this adapter is written and tested against (it uses private trainer attributes); what differs
#: between them is in :mod:`mrl_plugins.adapters.trl_members`
SUPPORTED_TRL = (">=1.14.0", "<1.17.0")
TESTED_TRL = ("1.14", "1.15", "1.16")
SUPPORTED_TRAINERS = ("GRPOTrainer", "RLOOTrainer")


def check_trl_version(installed: str | None = None) -> str:
    """Return the installed TRL version, or raise UnsupportedVersionError naming the supported range."""
    from packaging.specifiers import SpecifierSet

    if installed is None:
        try:
            installed = version("trl")
        except PackageNotFoundError:
            raise UnsupportedVersionError("TRL is not installed; pip install 'mrl-plugins[trl]'") from None
    spec = SpecifierSet(",".join(SUPPORTED_TRL))
    if installed not in spec:
        raise UnsupportedVersionError(
            f"TRL {installed} is not supported by this mrl-plugins release; supported: trl{spec} (tested: TRL "
            f"{', '.join(v + '.x' for v in TESTED_TRL)}; install one of those or an mrl-plugins release for TRL "
            f"{installed})"
        )
    return installed


def trainer_kind(trainer: Any) -> str:
    """``"grpo"`` or ``"rloo"``; PluginError for any other object."""
    from trl import GRPOTrainer, RLOOTrainer

    if isinstance(trainer, GRPOTrainer):
        return "grpo"
    if isinstance(trainer, RLOOTrainer):
        return "rloo"
    raise PluginError(
        f"mrl_plugins.enable: {type(trainer).__name__} is not supported; valid: {choices(SUPPORTED_TRAINERS)}"
    )


def enable(trainer: Any, config: Any = None) -> Any:
    """Switch the plugins on for ``trainer`` (see :func:`mrl_plugins.enable`)."""
    from mrl_plugins.hookspecs import StageContext
    from mrl_plugins.manager import get_plugin_manager
    from mrl_plugins.metrics import StageMetrics

    trl_version = check_trl_version()
    kind = trainer_kind(trainer)
    check_members(trainer, kind, trl_version)
    if config is None and os.environ.get("MRL_PLUGINS"):
        config = config_from_env(os.environ["MRL_PLUGINS"])
    pm = get_plugin_manager(config)  # refuses a stage combination that cannot run
    cfg = pm.config  # this run's own copy, as the manager resolved it (the caller's config is never changed)
    device = trainer_device(trainer)  # enable() follows the model (train.device is where mrl run puts it)
    cfg.device = device.spec
    _check_rollout(trainer, cfg, pm, kind, device)
    plan = None if pm.is_upstream("rollout") else _plan(trainer, pm, cfg, device)
    if getattr(trainer, "_mrl_state", None) is not None:  # enabled before (a notebook cell run again): start over
        disable(trainer)
    ctx = StageContext(config=cfg, host=trainer, metrics=StageMetrics(), plugins=pm)
    state = State(pm, ctx, kind)
    state.has_workers = plan is not None
    state.release_others()  # one live worker pool per process: the newest enabled trainer's
    try:
        _install_rollout(trainer, state, device, plan)
        _install_metrics(trainer, state)
        wrap_train(trainer, state)
        atexit.register(at_exit, weakref.ref(state))
        state.patch(trainer, "_mrl_state", state)
    except BaseException:
        state.shutdown("error")
        state.restore_patches()
        raise
    print(summary_line(trainer, state, device, plan), file=sys.stderr, flush=True)
    log.info("mrl-plugins enabled for %s: %s (mode %s)", type(trainer).__name__, pm.selected, cfg.mode)
    return trainer


def trainer_device(trainer: Any) -> Any:
    """The :class:`~mrl_plugins.device.Device` the trainer trains on (TRL's accelerator's)."""
    from mrl_plugins.device import get_device

    dev = trainer.accelerator.device
    return get_device("cpu" if dev.type == "cpu" else f"{dev.type}:{dev.index or 0}")


def _check_rollout(trainer: Any, cfg: Any, pm: Any, kind: str, device: Any) -> None:
    """What the 'mrl' rollout refuses on this trainer, before anything is changed."""
    if not pm.is_upstream("rollout"):
        if trainer.accelerator.num_processes == 1:  # several ranks split the cores / devices among their pools
            cfg.rollout.check_placement_on(cfg.mode, device)
        if cfg.rollout.old_logps == "engine":
            _check_engine_logps(trainer, kind)
        if cfg.rollout.ref_logps == "engine":
            _check_engine_ref_logps(trainer, cfg)
        engine = configured_engine(pm, cfg)
        if engine.check is not None:  # e.g. vLLM: installed, and a model it serves on this device (head_dim, arch)
            model = trainer.accelerator.unwrap_model(trainer.model)
            engine.check(getattr(model, "config", None), trainer.accelerator.device.type, type(model).__name__)
        if cfg.rollout.remote_workers and trainer.accelerator.num_processes > 1:
            raise ConfigError(
                f"rollout.remote_workers: remote workers serve a single training process; got "
                f"{trainer.accelerator.num_processes} (use local workers per rank, rollout.workers)"
            )


def config_from_env(value: str) -> Any:
    """``MRL_PLUGINS``: a YAML path / bundled config name, ``rollout=mrl,comm=upstream``, or ``1`` (defaults)."""
    value = value.strip()
    if value.lower() in ("1", "true", "yes", "on"):
        return None
    if value.lower() in ("", "0", "false", "no", "off"):
        raise ConfigError(
            f"MRL_PLUGINS={value}: the plugins are off when MRL_PLUGINS is unset (unset it); valid values: a bundled "
            f"config name, a YAML path, STAGE=PLUGIN[,STAGE=PLUGIN...], or 1 / true / yes / on for the defaults"
        )
    if "=" in value and not value.endswith((".yaml", ".yml")):
        from mrl_plugins.config import parse_plugin_selection

        return {"plugins": parse_plugin_selection(value, "MRL_PLUGINS")}
    return value


def enable_from_env(trainer: Any) -> Any:
    """Called by the start-up hook for trainers built while ``MRL_PLUGINS`` is set; an error names the variable."""
    value = os.environ["MRL_PLUGINS"]
    try:
        return enable(trainer, config_from_env(value))
    except MrlError as exc:
        if str(exc).startswith("MRL_PLUGINS="):
            raise
        raise type(exc)(f"MRL_PLUGINS={value}: {exc}") from None


def _install_rollout(trainer: Any, state: State, device: Any, plan: tuple | None) -> None:
    """Open the selected rollout plugin's runtime (``RolloutStage.open_runtime``) and put it where TRL generates.

    A runtime with ``replaces_host = False`` (``rollout: upstream``) leaves TRL's generation in place (timed only)."""
    from mrl_plugins.adapters.trl_generation import LookaheadLoader, MrlGeneration, sampling_params
    from mrl_plugins.hookspecs import RolloutSetup

    pm, ctx, cfg = state.pm, state.ctx, state.ctx.config
    gen = MrlGeneration(ctx, trainer)
    score_models = {}
    if cfg.rollout.ref_logps == "engine" and plan is not None:  # every worker scores its completions with the ref
        score_models["ref"] = trainer.accelerator.unwrap_model(trainer.ref_model)
    setup = RolloutSetup(
        host=trainer,
        model=trainer.accelerator.unwrap_model(trainer.model),
        sampling=sampling_params(trainer),
        seed=int(trainer.args.seed),
        device=device,
        placements=plan,
        generation=gen,
        score_models=score_models,
        processes=trainer.accelerator.num_processes,
    )
    runtime = pm.rollout_open_runtime(ctx=ctx, setup=setup)
    state.runtime = runtime
    if not runtime.replaces_host:
        _time_upstream_generation(trainer, state)
        return
    gen.runtime = runtime
    # why this run keeps the split (None: placement auto decides), said once in enable()'s line
    state.fixed_by = cfg.rollout.fixed_by(cfg.mode, setup.processes, configured_engine(pm, cfg))
    if state.fixed_by is None and hasattr(runtime, "exact"):
        _exact_local_batches(trainer, state, runtime)
    on_step_end = getattr(runtime, "on_step_end", None)
    if on_step_end is not None:
        _add_step_end_callback(trainer, state, on_step_end)
    if plan is not None:  # worker processes: the trainer's own cores, and a dataloader the lookahead can peek at
        trainer_cores = plan[1]
        if trainer_cores and device.type == "cpu":  # applied while train() runs only
            state.budget = (list(trainer_cores), max(1, min(cfg.rollout.trainer_threads, len(trainer_cores))))
        orig_loader = trainer.get_train_dataloader

        def get_train_dataloader() -> Any:
            gen.loader = LookaheadLoader(orig_loader())
            return gen.loader

        state.patch(trainer, "get_train_dataloader", get_train_dataloader)
    if getattr(trainer, "use_vllm", False):  # built with use_vllm=True: TRL's own engine is replaced, free it
        from mrl_plugins.adapters.trl_generation import release_trl_vllm

        release_trl_vllm(trainer)
    state.patch(trainer, "vllm_generation", gen)
    state.patch(trainer, "use_vllm", True)
    state.patch(trainer, "vllm_mode", "mrl")
    state.patch(trainer, "_last_loaded_step", -1)
    from mrl_plugins.adapters.trl_agentic import install_agentic

    install_agentic(trainer, state, gen)  # tools, environments, rollout_func: every turn served
    if state.shadow is not None:
        _add_step_end_callback(trainer, state, state.shadow.on_step_end)
    if cfg.rollout.old_logps == "engine":
        _use_engine_logps(trainer, state)
    if cfg.rollout.ref_logps == "engine":
        _use_engine_ref_logps(trainer, state, gen)


def _exact_local_batches(trainer: Any, state: State, runtime: Any) -> None:
    """``rollout.placement: auto``: a batch of the trainer's own current model (taking turns, warm-up) skips TRL's
    importance-sampling pass (its extra forward pass), as TRL's own generation does; worker batches keep it."""
    is_correction = bool(getattr(trainer, "vllm_importance_sampling_correction", False))
    state.patch(trainer, "vllm_importance_sampling_correction", is_correction)
    if state.ctx.config.rollout.old_logps == "engine":  # the loss takes the engine's logprobs: the flag stays off
        return

    def exact(local: bool) -> None:
        trainer.vllm_importance_sampling_correction = is_correction and not local

    runtime.exact = exact


def _plan(trainer: Any, pm: Any, cfg: Any, device: Any) -> tuple | None:
    """Where the rollout workers run (``_placements``), or None for the in-process engine (``workers: 0``)."""
    if cfg.rollout.workers == 0 and cfg.rollout.remote_workers == 0:
        return None
    from mrl_plugins.rollout.pool import check_pool_config

    acc = trainer.accelerator
    plan = _placements(cfg, device, acc.process_index, acc.num_processes)
    check_pool_config(pm, cfg, len(plan[0]))
    return plan


def _add_step_end_callback(trainer: Any, state: State, fn: Any) -> None:
    """Call ``fn(global_step)`` after every optimizer step (TRL callbacks never see the trainer itself)."""
    from transformers import TrainerCallback

    class _MrlStepEnd(TrainerCallback):
        def on_step_end(self, args: Any, trainer_state: Any, control: Any, **kwargs: Any) -> None:
            fn(int(trainer_state.global_step))

    callback = _MrlStepEnd()
    trainer.add_callback(callback)
    state.on_shutdown.append(lambda: trainer.remove_callback(callback))


def check_old_logps_trainer(kind: str) -> None:
    """``rollout.old_logps: engine`` with a ``kind`` (``grpo``, ``rloo``) of trainer: GRPO only."""
    if kind != "grpo":
        raise ConfigError(
            f"rollout.old_logps: 'engine' is supported for GRPO only ({kind} computes its old logprobs itself); "
            f"valid here: 'trainer'"
        )


def _check_engine_logps(trainer: Any, kind: str) -> None:
    """``rollout.old_logps: engine`` is sound only where the engine's logprobs are the trainer's definition."""
    check_old_logps_trainer(kind)
    from mrl_plugins.adapters.trl_generation import sampling_params

    used = sampling_params(trainer).filters()
    if used:
        raise ConfigError(
            f"rollout.old_logps: 'engine' needs temperature-only sampling (the engine's logprobs must be "
            f"log_softmax(logits / temperature), as the trainer computes them), but {', '.join(used)} is set; "
            f"use rollout.old_logps: trainer or turn those off"
        )


def _use_engine_logps(trainer: Any, state: State) -> None:
    """Put the engine's sampling logprobs (the behaviour policy) in GRPO's loss as ``old_per_token_logps``.

    TRL then skips its extra no-grad forward pass per generation (it runs it only for its importance-sampling
    correction, switched off here) and its clipped ratio is taken against the policy that actually sampled
    the tokens, stale or not: the loss of TRL's AsyncGRPO trainer.
    """
    import torch

    state.patch(trainer, "vllm_importance_sampling_correction", False)
    orig = trainer._generate_and_score_completions

    def generate_and_score(*args: Any, **kwargs: Any) -> Any:
        out = orig(*args, **kwargs)
        sampling = out.get("sampling_per_token_logps")
        if sampling is None:
            raise PluginError("rollout.old_logps: 'engine': the rollout engine returned no logprobs")
        if torch.isnan(sampling[out["completion_mask"].bool()]).any():
            raise PluginError("rollout.old_logps: 'engine': the engine returned NaN logprobs; use 'trainer'")
        out["old_per_token_logps"] = sampling
        return out

    state.patch(trainer, "_generate_and_score_completions", generate_and_score)


def _check_engine_ref_logps(trainer: Any, cfg: Any) -> None:
    """``rollout.ref_logps: engine`` needs a frozen reference model and rollout workers that can score."""
    problem = None
    if not getattr(trainer, "beta", 0.0):
        problem = "this trainer has no KL term (beta = 0), so no reference model to score with"
    elif getattr(trainer, "ref_model", None) is None:
        problem = "this trainer has no separate reference model (PEFT: the reference is the adapter-less policy)"
    elif getattr(trainer.args, "sync_ref_model", False):
        problem = "sync_ref_model changes the reference model during training; only a frozen one is served"
    # no rollout workers, or an engine that cannot score: refused with the config (RolloutConfig.validate, and
    # RolloutEngine.scores: RolloutConfig.check_backend)
    if problem:
        raise ConfigError(f"rollout.ref_logps: 'engine': {problem}; valid here: 'trainer'")


def _engine_ref_logps(result: Any, input_ids: Any, logits_to_keep: int) -> Any:
    """The workers' reference logprobs laid out as TRL's ``[batch, logits_to_keep]`` tensor, or None when
    ``input_ids`` are not the completions of ``result`` (then the trainer computes them itself)."""
    import torch

    scores = None if result is None else result.scores.get("ref")
    if scores is None or len(scores) != input_ids.size(0):
        return None
    tail = input_ids[:, input_ids.size(1) - logits_to_keep :].tolist()
    out = torch.zeros((input_ids.size(0), logits_to_keep), dtype=torch.float32)
    for i, (ids, lps) in enumerate(zip(result.completion_ids, scores, strict=True)):
        n = len(ids)
        if n > logits_to_keep or tail[i][:n] != ids:
            return None
        out[i, :n] = torch.tensor(lps, dtype=torch.float32)
    return out.to(input_ids.device)


def _use_engine_ref_logps(trainer: Any, state: State, gen: Any) -> None:
    """Answer TRL's reference forward pass with the rollout workers' scores of the same completions.

    The workers score every completion they generate with their copy of the (frozen) reference model,
    ``log_softmax(logits / temperature)`` as TRL's fused head computes it; batches the workers did not
    produce (the trainer's own warm-up generation) or that do not match are computed by TRL as before
    (``mrl/rollout/ref_logps_trainer``).
    """
    orig = trainer._get_per_token_logps_and_entropies
    metrics = state.ctx.metrics

    def per_token_logps(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, *a: Any, **kw: Any):
        if model is trainer.ref_model and not kw.get("compute_entropy") and not kw.get("compute_aux_loss"):
            ref = _engine_ref_logps(gen.last_result, input_ids, int(logits_to_keep))
            metrics.add("rollout/ref_logps_engine" if ref is not None else "rollout/ref_logps_trainer", 1)
            if ref is not None:
                return ref, None, None
        return orig(model, input_ids, attention_mask, logits_to_keep, *a, **kw)

    state.patch(trainer, "_get_per_token_logps_and_entropies", per_token_logps)


def _time_upstream_generation(trainer: Any, state: State) -> None:
    """Measure TRL's own generation (``mrl/time/generate_s``) without changing what it does."""
    orig = trainer._generate_single_turn
    metrics = state.ctx.metrics

    def timed(*args: Any, **kwargs: Any) -> Any:
        with metrics.timer("time/generate_s"):
            return orig(*args, **kwargs)

    state.patch(trainer, "_generate_single_turn", timed)


def _install_metrics(trainer: Any, state: State) -> None:
    if not state.ctx.config.log_metrics:
        return
    orig_log = trainer.log
    metrics = state.ctx.metrics

    def log_with_mrl(logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs or "reward" in logs:  # training logs only, not the final summary
            logs.update(metrics.flush())
        return orig_log(logs, start_time)

    state.patch(trainer, "log", log_with_mrl)


def summary_line(trainer: Any, state: State, device: Any, plan: tuple | None = None) -> str:
    """The one line ``enable()`` prints: what each stage is replaced by and where it runs."""
    pm, cfg = state.pm, state.ctx.config
    parts = []
    rc = cfg.rollout
    if pm.is_upstream("rollout"):
        parts.append("rollout=upstream (TRL generates with the training model)")
    else:
        name = pm.selected["rollout"] + (f"/{rc.engine}" if rc.engine != "transformers" else "")
        places = plan[0] if plan else None
        if rc.workers == 0 and rc.remote_workers == 0:
            where = f"in-process engine on {device.torch_device}"
        else:
            n = rc.workers
            where = f"{n} worker{'s' if n != 1 else ''}"
            if places:
                cores = sorted({c for p in places for c in (p.get("cores") or [])})
                devices = [p.get("env") for p in places if p.get("env")]
                if cores:
                    where += f", cores {cores}"
                elif devices:
                    where += f", {device.type} " + ",".join(v for env in devices for v in env.values())
                else:
                    where += f", {device.torch_device}"
            if rc.remote_workers:
                where += f" + {rc.remote_workers} remote" + (" on Ray" if rc.launch == "ray" else "")
            if state.budget is not None:
                where += f"; trainer cores {state.budget[0]}"
            fixed = state.fixed_by
            if fixed is None:
                where += "; placement auto: this split or taking turns on all cores, from measured stage times"
            else:
                if rc.placement == "auto":  # nothing to choose in this deployment: say why
                    where += f"; placement: this split ({fixed})"
                if rc.warmup:
                    where += "; until ready: the trainer's own model generates"
                else:
                    where += f"; until ready: the first generation waits (at most {rc.start_timeout_s:g} s)"
        parts.append(f"rollout={name} ({where})")
    ws = pm.selected["weight_sync"]
    if ws == "mrl":
        ws = cfg.weight_sync.transport
    parts.append(f"weight_sync={ws}")
    comm = pm.selected["comm"]
    if comm == "mrl":
        from mrl_plugins.comm.codec import resolve_codec

        comm = f"{cfg.comm.transport}/{resolve_codec(cfg.comm.codec, cfg.comm.transport)}"
    parts.append(f"comm={comm}")
    acc = getattr(trainer, "accelerator", None)
    world = getattr(acc, "num_processes", 1) or 1
    rank = f" [rank {acc.process_index}/{world}]" if world > 1 else ""
    return "mrl-plugins: " + ", ".join(parts) + rank


def disable(trainer: Any) -> None:
    """Release the plugins' resources (worker processes, shared memory) and put the trainer's own methods back."""
    state = getattr(trainer, "_mrl_state", None)
    if state is not None:
        try:
            state.shutdown("normal")
        finally:
            state.restore_patches()
            trainer.__dict__.pop("_mrl_state", None)
