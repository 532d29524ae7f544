"""The ``mrl.rollout`` plugin (selected as ``plugins.rollout: mrl``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from mrl_plugins.errors import PluginError
from mrl_plugins.hookspecs import RolloutEngine, RolloutResult, StageContext, hookimpl


def engine_registrations() -> Iterator[Any]:
    """Registration objects for ``rollout.engine``: ``transformers`` and ``vllm``.

    Factories take ``factory(model, tokenizer, *, params: SamplingParams, device="cpu", seed=None)``.
    """
    from .engine import _transformers_factory
    from .vllm_engine import vllm_factory

    yield RolloutEngine(
        name="transformers",
        factory=_transformers_factory,
        description="Hugging Face model, KV-cache sampling loop with the trainer's per-token logprobs",
    )
    yield RolloutEngine(
        name="vllm",
        factory=vllm_factory,
        description="vLLM in the worker process (vllm.LLM, in-process engine core), weights synced by reload",
    )


class RolloutPlugin:
    """Engines (``transformers``, ``vllm``), the in-process/worker-pool runtime and the async pipeline.

    Keys in ``ctx.resources``: ``rollout.runtime`` -- a :class:`~mrl_plugins.rollout.runtime.LocalEngineRuntime`
    or :class:`~mrl_plugins.rollout.runtime.PoolRuntime`, built by the adapter.
    """

    @hookimpl
    def mrl_rollout_register_engines(self) -> Iterable[RolloutEngine]:
        return list(engine_registrations())

    @hookimpl
    def mrl_rollout_generate(
        self, ctx: StageContext, prompts: list[list[int]], num_generations: int, model_id: str
    ) -> RolloutResult | None:
        runtime = ctx.resources.get("rollout.runtime")
        if runtime is None:
            raise PluginError("rollout 'mrl': no runtime in ctx.resources['rollout.runtime'] (enable() builds it)")
        return runtime.generate(prompts, num_generations, model_id)

    @hookimpl
    def mrl_shutdown(self, ctx: StageContext, reason: str) -> None:
        runtime: Any = ctx.resources.pop("rollout.runtime", None)
        if runtime is not None:
            runtime.close()
