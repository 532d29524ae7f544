"""TRL's agentic rollouts under the ``mrl`` rollout: ``tools=``, ``environment_factory=`` and ``rollout_func=``.

With the plugin every generation of TRL's ``_generate`` (a batch's first turn through ``_generate_single_turn``,
each follow-up turn of its tool loop ``_tool_call_loop``, or a ``rollout_func``'s calls) goes to
``trainer.vllm_generation``, the plugin's rollout (:class:`~mrl_plugins.adapters.trl_generation.MrlGeneration`). The
first turn is the one the async lookahead prepares (with ``environment_factory``, whose prompts depend on
``reset()``, the batch ahead is rolled out by :mod:`mrl_plugins.adapters.trl_shadow` instead); follow-up turns and
``rollout_func`` calls are generated at once with the current weight version (``generate_turn``), TRL's own loop
deciding what is asked. Tool calls are bounded by
``rollout.tool_timeout_s`` (:mod:`mrl_plugins.adapters.trl_tools`). What runs where: docs/agentic.md.
"""

from __future__ import annotations

import logging
from typing import Any

from mrl_plugins.adapters.trl_tools import bound_tool_dicts

log = logging.getLogger("mrl_plugins.adapters.trl")


def agentic_kinds(trainer: Any) -> list[str]:
    """Which of TRL's agentic features this trainer uses: ``tools``, ``environments``, ``rollout_func``."""
    kinds = []
    if getattr(trainer, "environment_factories", None):
        kinds.append("environments")
    elif getattr(trainer, "tools", None):
        kinds.append("tools")
    if getattr(trainer, "rollout_func", None) is not None:
        kinds.append("rollout_func")
    return kinds


def install_agentic(trainer: Any, state: Any, gen: Any) -> None:
    """Route TRL's agentic rollouts through ``gen`` (see the module docstring), for each of :func:`agentic_kinds`."""
    kinds = agentic_kinds(trainer)
    if not kinds:
        return
    rc = state.ctx.config.rollout
    timeout = rc.tool_timeout_s
    shadow = None
    gen.multi_turn = True  # the wrapped _generate below marks where each batch's rollout begins
    if "rollout_func" in kinds:
        gen.direct, gen.lookahead = True, False
    elif "environments" in kinds:
        gen.lookahead = False  # a batch's prompts come from its environments' reset(): nothing to read ahead
    if ahead_possible(trainer, state, gen, kinds):
        from mrl_plugins.adapters.trl_shadow import ShadowLookahead

        shadow = state.shadow = ShadowLookahead(trainer, state, gen, rc.timeout_s)
        gen.lookahead = False  # the whole rollout runs ahead instead of its first turn
        _take_rollouts_ahead(trainer, state, gen, shadow)
    orig_generate = trainer._generate
    warned = []

    def generate(prompts: Any) -> Any:
        gen.begin_rollout()
        out = shadow.answer(prompts) if shadow is not None else None
        if out is None:
            out = orig_generate(prompts)
        if shadow is not None and trainer.model.training:
            shadow.schedule(shadow.next_inputs())
        if "rollout_func" in kinds and gen.calls == 0 and not warned:
            warned.append(True)
            log.warning(
                "mrl-plugins: the rollout_func generated without trainer.vllm_generation, so the plugin's rollout "
                "workers served none of it; call trainer.vllm_generation.generate(prompts=..., images=None, "
                "num_generations=...) in it, or set plugins.rollout: upstream"
            )
        return out

    state.patch(trainer, "_generate", generate)
    if "tools" in kinds or "environments" in kinds:
        orig_loop = trainer._tool_call_loop

        def tool_call_loop(*args: Any, **kwargs: Any) -> Any:
            bound_tool_dicts(trainer, timeout)
            return orig_loop(*args, **kwargs)

        state.patch(trainer, "_tool_call_loop", tool_call_loop)


def ahead_possible(trainer: Any, state: Any, gen: Any, kinds: list[str]) -> bool:
    """Whether the next batch's whole rollout can run ahead (:mod:`mrl_plugins.adapters.trl_shadow`): tools or
    environments, GRPO, one training process, rollout workers (a pool), the async pipeline, and
    ``rollout.tool_rollouts_ahead`` on."""
    return (
        ("tools" in kinds or "environments" in kinds)
        and "rollout_func" not in kinds
        and state.kind == "grpo"
        and trainer.accelerator.num_processes == 1
        and state.has_workers
        and state.ctx.config.rollout.pipeline == "async"
        and state.ctx.config.rollout.tool_rollouts_ahead
        and hasattr(state.runtime, "take_ahead")
    )


def _take_rollouts_ahead(trainer: Any, state: Any, gen: Any, shadow: Any) -> None:
    """Wrap ``_generate_and_score_completions``: a batch rolled out ahead is taken (see trl_shadow), else TRL's own
    rollout runs (its follow-up turns on the workers)."""
    import time

    from mrl_plugins.rollout.runtime import too_stale

    orig = trainer._generate_and_score_completions
    rc = state.ctx.config.rollout
    metrics = state.ctx.metrics

    def generate_and_score(inputs: Any) -> Any:
        if not trainer.model.training:
            return orig(inputs)
        t0 = time.perf_counter()
        rollout = shadow.take(inputs)
        waited = time.perf_counter() - t0
        shadow.note_current(inputs)
        if rollout is None:
            return orig(inputs)
        gen.sync_weights_once()  # TRL syncs in _generate_single_turn, which it does not call now
        stale = gen.version - rollout.oldest_version()
        metrics.gauge("rollout/staleness", max(0, stale))
        if too_stale(metrics, rc, stale, len(inputs)):
            return orig(inputs)  # rolled out again, now, by TRL
        state.runtime.take_ahead(t0, waited, rollout.engine_s())
        metrics.add("rollout/ahead_thread_cpu_s", rollout.cpu_s)  # tools, parsing, tokenising: the trainer's CPU
        gen.last_result = None  # no worker scores for a multi-turn batch: TRL computes its reference pass
        with shadow.consuming(rollout):
            return orig(inputs)

    state.patch(trainer, "_generate_and_score_completions", generate_and_score)


__all__ = ["agentic_kinds", "ahead_possible", "install_agentic"]
