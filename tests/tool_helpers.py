"""GRPO trainers on the tool task (:mod:`mrl_plugins.demo.tool_task`) for the tests: vanilla TRL, with or without the
plugin enabled afterwards."""

from __future__ import annotations

from typing import Any


def tool_trainer(
    tmp_path: Any,
    *,
    steps: int,
    task: str = "tools",
    variant: str = "sync",
    seed: int = 0,
    model: Any = None,
    inputs: dict[str, Any] | None = None,
    **args: Any,
) -> Any:
    """A vanilla TRL ``GRPOTrainer`` on the tool task with the ``tiny-tools`` preset's settings (``model``: a
    ``(model, tokenizer)`` pair, default the preset; ``inputs``: replaces :func:`~mrl_plugins.demo.tool_task.
    trainer_inputs`' dataset / rewards / tools / environment_factory keys it names)."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from mrl_plugins.demo.models import PRESETS, build_model
    from mrl_plugins.demo.tool_task import GRPO_SETTINGS, trainer_inputs
    from mrl_plugins.run import checkpointing_arg

    torch.set_num_threads(1)
    policy, tok = model if model is not None else build_model("tiny-tools", seed=seed)
    p = PRESETS["tiny-tools"]
    config = {
        "output_dir": str(tmp_path),
        "max_steps": steps,
        "per_device_train_batch_size": p.per_device_train_batch_size,
        "num_generations": p.num_generations,
        "max_completion_length": p.max_completion_length,
        "logging_steps": 1,
        "report_to": [],
        "save_strategy": "no",
        "seed": seed,
        "use_cpu": True,
        "bf16": False,
        "disable_tqdm": True,
        checkpointing_arg(): False,
        **GRPO_SETTINGS,
        **args,
    }
    kwargs = {**trainer_inputs(task, n=256, seed=seed, variant=variant), **(inputs or {})}
    return GRPOTrainer(model=policy, processing_class=tok, args=GRPOConfig(**config), **kwargs)


def logged(trainer: Any, key: str) -> list[Any]:
    """Every training log's value of ``key`` (the final summary excluded)."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


__all__ = ["logged", "tool_trainer"]
