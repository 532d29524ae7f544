"""GRPO trainers on the tool task (:mod:`mrl_plugins.demo.tool_task`) for the tests: vanilla TRL, with or without the
plugin enabled afterwards; the calculator's test variants (async, raising, hanging) and the task's test measures."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mrl_plugins.demo.tool_task import _calls, add, subtract
from mrl_plugins.errors import ConfigError, choices

#: the GRPO settings the ``tiny-tools`` preset learns with besides its preset's batch shape; 5e-4: on the version-2
#: preset 1e-3 made the policy call on every rollout while its calls grew less accurate (reward 0.51 -> 0.56 in 60
#: steps), 3e-4 and 5e-4 raised it to 0.68-0.69 (2026-12-04); 3e-3 (the embedded job's default) collapses it
GRPO_SETTINGS: dict[str, Any] = {"learning_rate": 5e-4, "max_tool_calling_iterations": 2}
TOOL_VARIANTS = ("sync", "async", "raises", "hangs", "hangs_async")


def tool_call_rate(completions: list[Any]) -> float:
    """Share of completions with at least one parsed tool call."""
    return sum(bool(_calls(c)) for c in completions if not isinstance(c, str)) / max(1, len(completions))


def _named(fn: Callable[..., Any], like: Callable[..., Any]) -> Callable[..., Any]:
    # TRL and transformers' get_json_schema name a tool after __name__ and describe it from the docstring
    fn.__name__ = fn.__qualname__ = like.__name__
    fn.__doc__ = like.__doc__
    return fn


def _variant(base: Callable[[int, int], int], variant: str, hang_s: float) -> Callable[..., Any]:
    if variant == "sync":
        return base
    import asyncio
    import time

    if variant == "async":

        async def tool(a: int, b: int) -> int:
            await asyncio.sleep(0)
            return base(a, b)

    elif variant == "raises":

        def tool(a: int, b: int) -> int:
            raise RuntimeError(f"{base.__name__} is out of order")

    elif variant == "hangs":

        def tool(a: int, b: int) -> int:
            time.sleep(hang_s)
            return base(a, b)

    else:  # hangs_async

        async def tool(a: int, b: int) -> int:
            await asyncio.sleep(hang_s)
            return base(a, b)

    return _named(tool, base)


def calculator_tools(variant: str = "sync", *, hang_s: float = 3600.0) -> list[Callable[..., Any]]:
    """``[add, subtract]`` as TRL's ``tools=`` takes them, named ``add`` and ``subtract`` whatever the variant.

    ``sync``: plain functions (:func:`mrl_plugins.demo.tool_task.calculator_tools`). ``async``: coroutine functions
    (TRL runs them on its event loop). ``raises``: every call raises ``RuntimeError("add is out of order")`` (TRL puts
    ``{'error': ...}`` in the conversation and goes on). ``hangs`` / ``hangs_async``: every call sleeps ``hang_s``
    seconds (``time.sleep`` / ``asyncio.sleep``) before answering -- bound it with a timeout.
    """
    if variant not in TOOL_VARIANTS:
        raise ConfigError(f"variant: {variant!r} is not a calculator variant; valid: {choices(TOOL_VARIANTS)}")
    if not hang_s > 0:
        raise ConfigError(f"hang_s: must be > 0, got {hang_s}")
    return [_variant(add, variant, hang_s), _variant(subtract, variant, hang_s)]


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
    from mrl_plugins.demo.tool_task import trainer_inputs
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
    kwargs = trainer_inputs(task, n=256, seed=seed)
    if task == "tools":
        kwargs["tools"] = calculator_tools(variant)
    kwargs.update(inputs or {})
    return GRPOTrainer(model=policy, processing_class=tok, args=GRPOConfig(**config), **kwargs)


def logged(trainer: Any, key: str) -> list[Any]:
    """Every training log's value of ``key`` (the final summary excluded)."""
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


__all__ = ["GRPO_SETTINGS", "calculator_tools", "logged", "tool_call_rate", "tool_trainer"]
