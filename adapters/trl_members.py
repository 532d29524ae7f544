"""Every member of a TRL trainer that mrl-plugins touches (TRL 1.14, 1.15, 1.16), in one table.

:func:`check_members` runs with ``enable()``'s other checks (:mod:`mrl_plugins.adapters.trl`): a TRL release that
renamed or dropped one of these members is one error naming it, not an ``AttributeError`` in the middle of training.
A test scans the adapter and the rollout runtime for the members they use and fails on any that is missing here.

Uses:

* ``read`` -- read (an attribute or a method called as TRL defines it); must exist;
* ``wrap`` -- replaced by a wrapper that calls TRL's own (restored by ``disable()`` / at the end); must exist;
* ``set`` -- set by the adapter (the seams TRL reads: its vLLM generation object, its flags; restored by
  ``disable()``); need not exist before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mrl_plugins.errors import UnsupportedVersionError

BOTH = ("grpo", "rloo")


@dataclass(frozen=True)
class Member:
    name: str
    use: str  # read | wrap | set
    why: str
    kinds: tuple[str, ...] = BOTH
    optional: bool = False  # read with a default where TRL may not have it (getattr(trainer, name, default))


MEMBERS: tuple[Member, ...] = (
    Member("accelerator", "read", "process index/count, device, unwrap_model for the policy and reference"),
    Member("args", "read", "seed, sampling settings, gradient accumulation, steps_per_generation"),
    Member("model", "read", "the policy the engine copies and the weight-sync stage publishes"),
    Member("model_wrapped", "read", "the wrapped policy (DeepSpeed / FSDP) whose parameters are gathered"),
    Member("ref_model", "read", "the frozen reference model (ref_logps: engine scores with a copy of it)"),
    Member("state", "read", "global_step, max_steps and log_history (metrics, staleness, steps left)"),
    Member("processing_class", "read", "the tokenizer (EOS / pad ids of the engine's sampling)", optional=True),
    Member("eos_token_ids", "read", "EOS ids TRL stops on", optional=True),
    Member("num_iterations", "read", "GRPO's iterations per generation (lookahead timing)", optional=True),
    Member("beta", "read", "KL weight: whether TRL computes reference logprobs at all", optional=True),
    Member("tools", "read", "TRL tool calls (their follow-up turns go to the rollout workers)", optional=True),
    Member("environment_factories", "read", "environment_factory: batch prompts come from reset()", optional=True),
    Member("rollout_func", "read", "a user's rollout function (served through vllm_generation)", optional=True),
    Member("_generate", "wrap", "marks where TRL's multi-turn rollout of a batch begins (first vs follow-up turns)"),
    Member("_tool_call_loop", "wrap", "bounds every tool call (rollout.tool_timeout_s)", ("grpo",)),
    Member("_sync_tool_dicts", "set", "the batch's tools, replaced by time-bounded ones", ("grpo",)),
    Member("_async_tool_dicts", "set", "the batch's async tools, replaced by time-bounded ones", ("grpo",)),
    Member("_environment_pool", "set", "for a batch rolled out ahead: its own environment instances", ("grpo",)),
    Member("_env_tools", "read", "each environment's tools (rendered as JSON schemas ahead)", optional=True),
    Member("_multi_environment", "read", "a dict of environment factories (rows name theirs)", optional=True),
    Member("_metrics", "read", "TRL's rollout metrics of a batch rolled out ahead are added to these"),
    Member("_tokenize_prompts", "read", "the next batch's prompt ids, tokenised as TRL does (lookahead)"),
    Member("add_callback", "read", "the step-end callback of the rollout runtime"),
    Member("remove_callback", "read", "removing that callback at the end"),
    Member("train", "wrap", "start/stop of the worker pool and process state around TRL's train()"),
    Member("get_train_dataloader", "wrap", "a dataloader the lookahead can peek at (next step's prompts)"),
    Member("log", "wrap", "mrl/* metrics merged into TRL's logs"),
    Member("_generate_single_turn", "wrap", "timing TRL's own generation (rollout: upstream)"),
    Member("_generate_and_score_completions", "wrap", "old_logps: engine (GRPO's loss takes engine logprobs)"),
    Member("_get_per_token_logps_and_entropies", "wrap", "ref_logps: engine (the workers' reference logprobs)"),
    Member("vllm_generation", "set", "the seam: TRL generates through this object when use_vllm is set"),
    Member("use_vllm", "set", "makes TRL call vllm_generation"),
    Member("vllm_mode", "set", "'mrl' (TRL only compares it with its own modes)"),
    Member("_last_loaded_step", "set", "TRL's weight-sync bookkeeping for vllm_generation (-1: sync now)"),
    Member("vllm_importance_sampling_correction", "set", "TRL's IS correction of vLLM samples", ("grpo",)),
)

#: what differs between the tested TRL releases (1.14.x, 1.15.x, 1.16.x) in the members above, read from TRL's
#: own sources, and how the adapter copes; tests/test_trl_members.py checks the installed TRL against it
VERSION_NOTES: dict[str, str] = {
    "_generate_single_turn": "GRPO 1.14.0/1.14.1: (prompt_ids, images, multimodal_fields, has_tool_images), so "
    "the tool loop's follow-up turns asked vllm_generation for num_generations completions per prompt; 1.14.2+: "
    "num_generations before has_tool_images (1 for a follow-up turn). RLOO never takes it. The adapter only wraps "
    "it (*args) and the upstream runtime retries without it",
    "eos_token_ids": "1.14.2+: every EOS id of the model's generation config; 1.14.0/1.14.1: none (TRL stops on the "
    "tokenizer's EOS only). Read as optional: the engines stop where that TRL stops",
    "_get_per_token_logps_and_entropies": "1.14: full logits (or Liger's chunked path with use_liger_kernel); "
    "1.15+: the fused LM head patched onto the model (1.15.0: a Triton-only kernel, so vanilla TRL 1.15 cannot "
    "train on CPU; 1.16 folds it in torch there). The same positional signature everywhere (model, input_ids, "
    "attention_mask, logits_to_keep, ...), which is all the ref_logps wrapper relies on",
    "vllm_generation": "the interface the adapter replaces is the same in 1.14.2-1.16: generate(prompts, images, "
    "num_generations, profiler) -> (prompt_ids, completion_ids, logprobs, logprob_token_ids) and sync_weights(); "
    "1.16 only changed how TRL's own copy gathers FSDP2 weights",
    "tools": "the tool loop (_tool_call_loop, calling _generate_single_turn per turn) is in all three; 1.16 parses "
    "each completion with the tools of its prompt's environment (environment_factory dicts)",
}

#: attributes of our own that the adapter sets on a trainer (not TRL's)
OWN = ("_mrl_state",)


def missing_members(trainer: Any, kind: str) -> list[str]:
    """The ``read`` / ``wrap`` members of :data:`MEMBERS` that ``trainer`` (a TRL trainer of ``kind``) lacks."""
    return [
        m.name
        for m in MEMBERS
        if kind in m.kinds and m.use in ("read", "wrap") and not m.optional and not hasattr(trainer, m.name)
    ]


def check_members(trainer: Any, kind: str, trl_version: str = "?") -> None:
    """One error naming every member mrl-plugins needs that this trainer does not have (before any change)."""
    missing = missing_members(trainer, kind)
    if missing:
        raise UnsupportedVersionError(
            f"mrl_plugins.enable: {type(trainer).__name__} (TRL {trl_version}) has no {', '.join(missing)}, which "
            "mrl-plugins uses (see mrl_plugins.adapters.trl_members); tested: TRL 1.14.x, 1.15.x, 1.16.x"
        )


__all__ = ["MEMBERS", "OWN", "VERSION_NOTES", "Member", "check_members", "missing_members"]
