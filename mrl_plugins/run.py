"""Build and run the embedded GRPO/RLOO job of a config (``mrl run``; one run of ``mrl compare``)."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.config import MrlConfig, load_config, load_yaml, parse_plugin_selection
from mrl_plugins.errors import ConfigError, choices

#: :attr:`RunResult.time_split`, the one definition of its keys -> the part each counts as in ``mrl doctor
#: --report`` (generate | weight_sync | transfer | train | wait, or "flag"): ``run_training`` writes exactly these,
#: ``mrl compare`` copies them into ``report.json`` and ``mrl doctor --report`` (:mod:`mrl_plugins.cli.triage`) reads
#: them.
TIME_SPLIT: dict[str, str] = {
    # s generating: the trainer's own generate() time, or with rollout workers their busy time (overlaps train)
    "generate": "generate",
    "weight_sync": "weight_sync",  # s the trainer spent publishing weights to the inference copy
    "transfer_wait": "wait",  # s the trainer was blocked waiting for the workers' experience (idle)
    "train": "train",  # s of the training loop outside generate() and weight publishing
    # 1.0 when generate ran in rollout workers, in parallel with train (2 busy lanes); 0.0 otherwise
    "generate_overlapped": "flag",
}


@dataclass
class RunResult:
    """What one training run measured (``report.json`` entry of ``mrl compare``)."""

    name: str
    plugins: dict[str, str]
    steps: int
    wall_s: float
    train_s: float
    steps_per_s: float
    tokens_per_s: float
    peak_rss_bytes: int
    final_reward: float
    peak_child_rss_bytes: int = 0
    #: the trainer process's peak of CUDA memory reserved by torch's allocator (0 without CUDA); its rollout
    #: workers' first-generation peaks are in ``mrl_metrics`` (``mrl/rollout/budget_memory_peak_bytes/<w>``)
    gpu_peak_bytes: int = 0
    rewards: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    time_split: dict[str, float] = field(default_factory=dict)  # keys: TIME_SPLIT
    mrl_metrics: dict[str, float] = field(default_factory=dict)
    threads: int = 0
    #: the run's own timestamps, seconds from the run's start (``mrl compare``'s time and reward plots):
    #: ``train`` [start, end] of ``trainer.train()``; ``steps`` [[begin, end], ...] of each optimizer step;
    #: ``reward_t`` the time of each logged reward; ``trainer`` [[kind, start, end], ...] of the trainer's
    #: generate / wait / weight_sync sections; ``worker`` [[worker, kind, start, end], ...] of the rollout workers
    timeline: dict[str, Any] = field(default_factory=dict)


def _trl_args(cfg: MrlConfig, output_dir: str) -> dict[str, Any]:
    from mrl_plugins.demo.models import PRESETS, preset

    p = preset(cfg.train.model)
    args = {
        **{arg: getattr(cfg.train, key) for arg, key in cfg.train.OWNED_TRL_ARGS.items()},  # steps, seed, ...
        "output_dir": output_dir,
        "per_device_train_batch_size": p.per_device_train_batch_size,
        "num_generations": p.num_generations,
        "max_completion_length": p.max_completion_length,
        "report_to": [],
        "save_strategy": "no",
        "temperature": 1.0,
        "disable_tqdm": True,
    }
    if cfg.train.device in ("auto", "cpu"):
        from mrl_plugins.device import get_device

        if get_device(cfg.train.device).type == "cpu":
            args["use_cpu"] = True
            args["bf16"] = False  # TRL defaults to bf16 autocast; on CPU the embedded job trains in fp32
    if cfg.train.model in PRESETS and not {"activation_checkpointing", "gradient_checkpointing"} & set(
        cfg.train.trl_args
    ):
        # TRL turns activation checkpointing on by default; a preset of a few MB gains nothing from it and vanilla
        # TRL ran 1.11-1.21x faster without it (benchmarks/README.md), so every run of the embedded job goes without
        args[checkpointing_arg()] = False
    args.update(cfg.train.trl_args)
    return args


def checkpointing_arg() -> str:
    """The name of the training arguments' activation-checkpointing switch in the installed transformers."""
    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def preflight(cfg: MrlConfig | Any, *, enable_plugins: bool = True) -> MrlConfig:
    """Check everything a run needs before its model and trainer are built; returns the loaded config.

    The config itself, the TRL version, ``train.model`` (a preset or a checkpoint folder), ``train.device``
    (:class:`~mrl_plugins.errors.DeviceError` when absent), and with the plugins on the plugin and backend
    names (the manager :func:`mrl_plugins.enable` builds; names in ``disable`` / ``MRL_DISABLED_PLUGINS`` must
    name a plugin), the stage combination, the rollout worker count against the cores / devices
    (:meth:`RolloutConfig.check_placement`) and ``train.threads``, which the placement sets with CPU workers.
    Each raises one :class:`~mrl_plugins.errors.MrlError` naming the problem and the valid choices.
    """
    from mrl_plugins.adapters.trl import check_old_logps_trainer, check_trl_version
    from mrl_plugins.demo.models import check_model
    from mrl_plugins.device import get_device

    cfg = load_config(cfg)
    check_trl_version()
    check_model(cfg.train.model, "train.model")
    _check_task_model(cfg.train.task, cfg.train.model)
    device = get_device(cfg.train.device)  # where build_trainer puts the model
    if not enable_plugins:
        _check_trl_args(cfg.train)
        return cfg
    from mrl_plugins.manager import get_plugin_manager

    pm = get_plugin_manager(cfg)  # plugin, backend and disable names, the stage combination
    if not pm.is_upstream("rollout"):
        cfg.rollout.check_placement_on(cfg.mode, device)
        if cfg.train.threads and device.type == "cpu" and _trainer_budget(cfg):
            raise ConfigError(
                f"train.threads: {cfg.train.threads} would be overridden: with rollout workers on this CPU the "
                f"placement sets the trainer's torch threads (one per core of rollout.trainer_cores in the split, "
                f"every core when taking turns); set train.threads: 0, and rollout.trainer_cores to choose its cores"
            )
        from mrl_plugins.rollout.config import configured_engine

        engine = configured_engine(pm, cfg)
        if engine.requires is not None:  # e.g. vLLM installed (found, not imported)
            engine.requires()
        if cfg.rollout.old_logps == "engine":
            check_old_logps_trainer(cfg.train.trainer)
    _check_trl_args(cfg.train)
    return cfg


def _trainer_budget(cfg: MrlConfig) -> bool:
    """Whether the placement sets the trainer's cores and torch threads on this CPU (rollout workers, local or remote,
    and cores to split: :func:`~mrl_plugins.device.placement.cpu_split`)."""
    from mrl_plugins.device.placement import cpu_split

    rc = cfg.rollout
    return bool(rc.workers or rc.remote_workers) and cpu_split(rc, sorted(os.sched_getaffinity(0)))[0] is not None


def _check_trl_args(train: Any) -> None:
    """``train.trl_args``: keyword arguments of the installed TRL's GRPOConfig / RLOOConfig (imports TRL: the last
    check, after those that refuse without importing it)."""
    import difflib

    if not train.trl_args:
        return
    import trl

    cls = getattr(trl, f"{train.trainer.upper()}Config")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(train.trl_args) - names)
    if unknown:
        close = difflib.get_close_matches(unknown[0], names, n=3)
        hint = f"; did you mean {choices(close)}?" if close else f"; see {cls.__module__}.{cls.__name__}"
        raise ConfigError(
            f"train.trl_args: {unknown[0]!r} is not a {cls.__name__} argument (TRL {trl.__version__}){hint}"
        )


def _check_task_model(task: str, model: str) -> None:
    """The count task runs on the count presets, the tool tasks on ``tiny-tools`` or a folder with a chat template."""
    from mrl_plugins.demo.models import PRESETS, TOOL_PRESETS

    if task == "count" and model in TOOL_PRESETS:
        count = [p for p in PRESETS if p not in TOOL_PRESETS]
        raise ConfigError(
            f"train.model: {model!r} is a tool-task preset; train.task 'count' needs {choices(count)}, "
            f"or set train.task to 'tools', 'environment' or 'environments'"
        )
    if task == "count":
        return
    if model in PRESETS and model not in TOOL_PRESETS:
        raise ConfigError(
            f"train.task: {task!r} needs a model whose chat template calls tools: {choices(TOOL_PRESETS)} or a "
            f"checkpoint folder saved from it; train.model {model!r} is a count-task preset"
        )
    if model not in PRESETS and not _has_chat_template(model):
        raise ConfigError(
            f"train.task: {task!r} needs a model whose chat template calls tools; the checkpoint folder {model!r} "
            f"has no chat template (use {choices(TOOL_PRESETS)} or a folder saved from it)"
        )


def _has_chat_template(folder: str) -> bool:
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as fh:
            return bool(json.load(fh).get("chat_template"))
    except (OSError, ValueError):
        return False


def _task_inputs(cfg: MrlConfig) -> dict[str, Any]:
    """The trainer's ``train_dataset``, ``reward_funcs`` and (tool tasks) ``tools`` / ``environment_factory``."""
    from mrl_plugins.demo import models, tool_task

    n, seed = cfg.train.num_prompts, cfg.train.seed
    if cfg.train.task != "count":
        return tool_task.trainer_inputs(cfg.train.task, n=n, seed=seed)
    words = models.preset(cfg.train.model).prompt_words
    return {"train_dataset": models.build_dataset(n, words=words, seed=seed), "reward_funcs": models.count_reward}


def build_trainer(cfg: MrlConfig, *, enable_plugins: bool = True, output_dir: str | None = None) -> Any:
    """The configured TRL trainer on the embedded model/task, enabled with ``cfg`` unless told otherwise."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from mrl_plugins.demo.models import PRESETS, build_model, save_preset

    _check_task_model(cfg.train.task, cfg.train.model)
    model, tokenizer = build_model(cfg.train.model, seed=cfg.train.seed)
    if cfg.train.model in PRESETS:
        # TRL builds a reference model (KL term) and vLLM its engine from model.name_or_path: give the preset a folder
        ref_dir = os.path.join(output_dir or cfg.train.output_dir, f"preset-{cfg.train.model}-seed{cfg.train.seed}")
        save_preset(model, tokenizer, ref_dir)
    task_inputs = _task_inputs(cfg)
    args = _trl_args(cfg, output_dir or cfg.train.output_dir)
    import trl

    from mrl_plugins._autoenable import suppressed

    name = {"grpo": "GRPO", "rloo": "RLOO"}[cfg.train.trainer]
    config_cls, trainer_cls = getattr(trl, f"{name}Config"), getattr(trl, f"{name}Trainer")
    with suppressed():  # this run's config decides, not $MRL_PLUGINS (the switch for a user's own scripts)
        trainer = trainer_cls(model=model, processing_class=tokenizer, args=config_cls(**args), **task_inputs)
    if enable_plugins:
        import mrl_plugins

        mrl_plugins.enable(trainer, cfg)
    return trainer


def _timeline_callback(t0: float, max_steps: int, progress: str | None) -> Any:
    """A TRL callback that records each step's [begin, end] and each logged reward's time (``time.monotonic()``
    from ``t0``) and, with ``progress``, appends one JSON line per finished step there (``mrl compare`` reads it)."""
    from transformers import TrainerCallback

    class _Timeline(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[list[float]] = []
            self.reward_t: list[float] = []
            self._begin = 0.0

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self._begin = time.monotonic() - t0

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            now = time.monotonic() - t0
            self.steps.append([self._begin, now])
            if progress:
                with open(progress, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"step": int(state.global_step), "max_steps": max_steps, "t": now}) + "\n")

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs:
                self.reward_t.append(time.monotonic() - t0)

    return _Timeline()


def _worker_spans(folder: str, t0: float) -> list[list[Any]]:
    spans = []
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    e = json.loads(line)
                    spans.append([int(e["worker"]), e["kind"], e["t0"] - t0, e["t1"] - t0])
    return sorted(spans, key=lambda s: s[2])


def run_training(
    cfg: MrlConfig | Any, *, name: str = "run", enable_plugins: bool = True, progress: str | None = None
) -> RunResult:
    """Train and measure. ``train.threads`` (0 = every core this process may use) sets the torch thread budget.

    ``progress``: a file that gets one JSON line per finished step (``{"step", "max_steps", "t"}``).
    """
    import tempfile

    import torch

    from mrl_plugins.device.cpu import peak_rss_bytes

    cfg = preflight(cfg, enable_plugins=enable_plugins)  # before anything expensive is built
    threads = cfg.train.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    mono0 = time.monotonic()
    spans_dir = tempfile.mkdtemp(prefix="mrl-timeline-")
    old_env = os.environ.get("MRL_TIMELINE_DIR")
    os.environ["MRL_TIMELINE_DIR"] = spans_dir  # rollout workers (started by train()) write their generate spans
    try:
        trainer = build_trainer(cfg, enable_plugins=enable_plugins)
        state = getattr(trainer, "_mrl_state", None)
        if state is not None:
            state.ctx.metrics.spans = []
        timeline = _timeline_callback(mono0, cfg.train.steps, progress)
        trainer.add_callback(timeline)
        t_train = time.perf_counter()
        train_begin = time.monotonic() - mono0
        trainer.train()
        train_end = time.monotonic() - mono0
        train_s = time.perf_counter() - t_train
        wall_s = time.perf_counter() - t0
        worker_spans = _worker_spans(spans_dir, mono0)
    finally:
        if old_env is None:
            os.environ.pop("MRL_TIMELINE_DIR", None)
        else:
            os.environ["MRL_TIMELINE_DIR"] = old_env
        import shutil

        shutil.rmtree(spans_dir, ignore_errors=True)
    trainer_spans = [[k, a - mono0, b - mono0] for k, a, b in (state.ctx.metrics.spans or [])] if state else []
    history = [h for h in trainer.state.log_history if "reward" in h]
    rewards = [float(h["reward"]) for h in history]
    kl = [float(h.get("kl", 0.0)) for h in history]
    losses = [float(h.get("loss", 0.0)) for h in history]
    step_times = [float(h.get("step_time", 0.0)) for h in history]
    tokens = float(trainer.state.log_history[-2].get("num_tokens", 0.0)) if len(trainer.state.log_history) > 1 else 0.0
    mrl = state.ctx.metrics.snapshot() if state is not None else {}
    # Trainer-side view: time blocked in generate() (TRL's own generation, or waiting for the workers' batch),
    # in weight publishing, and the rest (training). With rollout workers, "generate" is the workers' busy time,
    # which overlaps training; "transfer_wait" is the time the trainer was blocked waiting for experience.
    blocked = mrl.get("mrl/time/generate_s", 0.0)
    workers = "mrl/rollout/generate_s" in mrl
    split = {
        "generate": mrl.get("mrl/rollout/generate_s", 0.0) if workers else blocked,
        "weight_sync": mrl.get("mrl/time/weight_sync_s", 0.0),
        "transfer_wait": mrl.get("mrl/time/wait_s", 0.0) if workers else 0.0,
    }
    split["train"] = max(0.0, train_s - blocked - split["weight_sync"])
    split["generate_overlapped"] = float(workers)
    last = rewards[-10:] or [0.0]
    return RunResult(
        name=name,
        plugins=dict(state.pm.selected) if state is not None else {"rollout": "vanilla"},
        steps=int(trainer.state.global_step),
        wall_s=wall_s,
        train_s=train_s,
        steps_per_s=trainer.state.global_step / train_s if train_s else 0.0,
        tokens_per_s=tokens / train_s if train_s else 0.0,
        peak_rss_bytes=peak_rss_bytes(),
        peak_child_rss_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        gpu_peak_bytes=int(torch.cuda.max_memory_reserved()) if torch.cuda.is_initialized() else 0,
        final_reward=sum(last) / len(last),
        rewards=rewards,
        kl=kl,
        losses=losses,
        step_times=step_times,
        time_split=split,
        mrl_metrics=mrl,
        threads=threads,
        timeline={
            "wall": [0.0, wall_s],
            "train": [train_begin, train_end],
            "steps": timeline.steps,
            "reward_t": timeline.reward_t,
            "trainer": trainer_spans,
            "worker": worker_spans,
        },
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m mrl_plugins.run CONFIG [--vanilla] [--json PATH] [--steps N] [--model M]`` (one isolated run)."""
    import argparse

    parser = argparse.ArgumentParser(prog="mrl run")
    parser.add_argument("config", nargs="?", metavar="CONFIG", help="same as --config (kept for `mrl run colocate`)")
    parser.add_argument(
        "--config", dest="config_opt", metavar="CONFIG", help="YAML path or bundled name (default: colocate)"
    )
    parser.add_argument("--vanilla", action="store_true", help="plain TRL, mrl_plugins.enable not called")
    parser.add_argument("--steps", type=int, help="override train.steps")
    parser.add_argument("--model", help="override train.model (preset or checkpoint folder)")
    parser.add_argument("--trainer", choices=["grpo", "rloo"], help="override train.trainer")
    parser.add_argument("--threads", type=int, help="override train.threads")
    parser.add_argument("--plugins", help="per-stage override, e.g. rollout=mrl,comm=upstream")
    parser.add_argument("--name", default="run")
    parser.add_argument("--json", help="write the RunResult here")
    parser.add_argument("--quiet", action="store_true", help="no version-switch / worker log lines")
    parser.add_argument("--progress", help="append one JSON line per finished step to this file (mrl compare)")
    ns = parser.parse_args(argv)
    if ns.config and ns.config_opt and ns.config != ns.config_opt:
        parser.error(f"two configs given: {ns.config!r} and --config {ns.config_opt!r}")
    config = ns.config_opt or ns.config or "colocate"
    import logging

    if not ns.quiet:  # one line per weight-version switch (source's advice: keep version logs on)
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("mrl_plugins").setLevel(logging.INFO)

    data = load_yaml(config)
    train = dict(data.get("train") or {})
    for key in ("steps", "model", "trainer", "threads"):
        if getattr(ns, key) is not None:
            train[key] = getattr(ns, key)
    data["train"] = train
    if ns.plugins:
        data["plugins"] = {**(data.get("plugins") or {}), **parse_plugin_selection(ns.plugins)}
    result = run_training(data, name=ns.name, enable_plugins=not ns.vanilla, progress=ns.progress)
    print(
        f"{result.name}: {result.steps} steps in {result.train_s:.1f} s ({result.steps_per_s:.2f} steps/s), "
        f"final reward {result.final_reward:.3f}, plugins {result.plugins}"
    )
    if ns.json:
        with open(ns.json, "w", encoding="utf-8") as fh:
            json.dump(dataclasses.asdict(result), fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
