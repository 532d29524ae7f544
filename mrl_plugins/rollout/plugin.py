"""The ``mrl.rollout`` plugin (selected as ``plugins.rollout: mrl``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from mrl_plugins.hookspecs import RolloutEngine, RolloutSetup, StageContext, StagePlugin, hookimpl


def engine_registrations() -> Iterator[Any]:
    """Registration objects for ``rollout.engine``: ``transformers`` and ``vllm``."""
    from mrl_plugins.optional import check_vllm_installed

    from .engine import TransformersEngine
    from .vllm_engine import VLLM_START_S, VLLMEngine, check_vllm_servable

    yield RolloutEngine(
        name="transformers",
        factory=TransformersEngine,
        description="Hugging Face model, KV-cache sampling loop with the trainer's per-token logprobs",
        scores=True,
        fork_safe=True,
        warmup=True,
    )
    yield RolloutEngine(
        name="vllm",
        factory=VLLMEngine,
        description="vLLM in the worker process (vllm.LLM, in-process engine core), weights synced by reload",
        options=True,
        fork_safe=True,
        own_weights=True,
        start_s=VLLM_START_S,
        requires=check_vllm_installed,
        check=check_vllm_servable,
    )


class RolloutPlugin:
    """The rollout stage ``mrl`` (a :class:`~mrl_plugins.hookspecs.channels.RolloutStage`) and its engines
    (``transformers``, ``vllm``): the runtime is an in-process engine or a pool of worker processes
    (:mod:`mrl_plugins.rollout.build`), which opens the weight-sync and comm stages' ends through the manager."""

    @hookimpl
    def mrl_rollout_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("mrl", lambda: self, "engines on their own cores / streams, in-process or in workers")]

    @hookimpl
    def mrl_rollout_register_engines(self) -> Iterable[RolloutEngine]:
        return list(engine_registrations())

    def open_runtime(self, ctx: StageContext, setup: RolloutSetup) -> Any:
        from .build import open_runtime

        return open_runtime(ctx, setup)
