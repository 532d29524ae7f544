"""Generation engines that return per-token sampling logprobs.

Two backends, both registered by :func:`mrl_plugins.rollout.plugin.engine_registrations`:

* :class:`TransformersEngine` -- a KV-cache decode loop over any Hugging Face causal LM. It samples from the
  *processed* distribution (repetition penalty -> temperature -> top-k -> top-p -> min-p, the order and the
  semantics of Hugging Face ``generate``, which TRL's transformers path uses).
  The loop is our own rather than ``model.generate``: it takes a private ``torch.Generator`` (``seed`` makes runs
  reproducible without touching the global RNG) and skips ``generate``'s per-step bookkeeping. Measured on 2 shared
  vCPUs, 1 thread, medians of 7: ``tiny`` 4 sequences x 16 tokens 32 ms vs 51 ms for ``generate`` with
  ``output_scores``; ``small`` 16 x 48 tokens 665 ms vs 721 ms (there the matmuls dominate).
* :class:`~mrl_plugins.rollout.vllm_engine.VLLMEngine` (module ``vllm_engine``) -- a ``vllm.LLM`` built from
  the policy it is handed, weights applied through vLLM's layerwise reload.

**Logprobs contract (both engines).** For every sampled token the engines report the log-probability TRL's
trainer computes for it, ``log_softmax(logits / temperature)`` (temperature only, no filters), also when a
sampling filter is active (top-k, top-p, min-p, or a repetition penalty, which counts as a filter: see
:meth:`SamplingParams.filters`). TRL's importance-sampling correction (``vllm_importance_sampling_mode``, default
``sequence_mask``, ratios above ``vllm_importance_sampling_clip_max`` = 3 masked) compares these with the
trainer's own recomputation, so it corrects for staleness (the sampling version against the trainer's) only.
The filtered distribution's logprobs would make every ratio ``exp(sum(trainer - filtered))`` an artefact of the
filter: renormalising over the kept tokens lowers the ratios (measured on the tiny preset, first step, weights not
yet changed: 0.009 to 0.7 instead of 1), a repetition penalty raises them (a penalised token sampled anyway) up
to masking, whatever the staleness. Without filters the two definitions are the same number.
This matches TRL's transformers generate path (filters applied, no IS correction: the loss treats the samples as
on-policy); TRL's own vLLM path asks vLLM for ``processed_logprobs`` (trl/generation/vllm_generation.py), i.e. it
weighs the filter itself away, as this plugin did before (the ratios above).

Outputs are ordered prompt-major (prompt 0 generation 0..N-1, prompt 1 ...), completions are cut after the first
EOS (the EOS is kept, as TRL does).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.errors import ConfigError

#: keys of a host's ``generation_kwargs`` that map onto :class:`SamplingParams` fields (the TRL adapter reads them)
GEN_KWARGS = {
    **{k: k for k in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")},
    "eos_token_id": "eos_token_ids",
    "pad_token_id": "pad_token_id",
}
#: keys accepted and without effect on sampling here
GEN_KWARGS_IGNORED = ("do_sample", "bos_token_id", "cache_implementation", "disable_compile", "use_cache")


@dataclass
class SamplingParams:
    """How completions are sampled (TRL ``GRPOConfig``/``RLOOConfig`` semantics)."""

    max_new_tokens: int = 16  # max tokens generated per completion
    temperature: float = 1.0  # softmax temperature (> 0)
    top_p: float = 1.0  # nucleus sampling mass in (0, 1]; 1.0 = off
    top_k: int | None = 0  # keep the k most likely tokens; 0 or None = off
    min_p: float | None = None  # drop tokens below min_p x top probability; None = off
    repetition_penalty: float = 1.0  # HF repetition penalty over prompt+generated tokens (pads excluded); 1.0 = off
    eos_token_ids: list[int] = field(default_factory=list)  # token ids that end a completion
    pad_token_id: int | None = None  # id used to left-pad prompts (None: first EOS or 0)

    def filters(self) -> list[str]:
        """Names of the active sampling filters (top_k, top_p, min_p, repetition_penalty); empty when sampling is
        temperature-only. With any of them on, the sampling distribution is not the trainer's
        ``log_softmax(logits / temperature)``; the engines still report the latter (see the module docstring)."""
        active = {
            "top_k": bool(self.top_k),
            "top_p": self.top_p != 1.0,
            "min_p": bool(self.min_p),
            "repetition_penalty": self.repetition_penalty != 1.0,
        }
        return [name for name, on in active.items() if on]

    def validate(self) -> None:
        """Raise ConfigError naming the first invalid field and its allowed range."""
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ConfigError(f"sampling.max_new_tokens: must be an int >= 1, got {self.max_new_tokens!r}")
        if not (
            isinstance(self.temperature, (int, float)) and self.temperature > 0 and math.isfinite(self.temperature)
        ):
            raise ConfigError(f"sampling.temperature: must be a finite number > 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"sampling.top_p: must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 0):
            raise ConfigError(f"sampling.top_k: must be an int >= 0 (0 or None = off), got {self.top_k!r}")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ConfigError(f"sampling.min_p: must be in [0, 1] or None, got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"sampling.repetition_penalty: must be > 0, got {self.repetition_penalty!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.eos_token_ids):
            raise ConfigError(f"sampling.eos_token_ids: must be non-negative ints, got {self.eos_token_ids!r}")

    def fill_from_tokenizer(self, tokenizer: Any) -> None:
        """EOS and pad ids from ``tokenizer`` where unset, then :meth:`validate` (engines call it when built)."""
        if tokenizer is not None:
            if not self.eos_token_ids and getattr(tokenizer, "eos_token_id", None) is not None:
                self.eos_token_ids = [int(tokenizer.eos_token_id)]
            if self.pad_token_id is None and getattr(tokenizer, "pad_token_id", None) is not None:
                self.pad_token_id = int(tokenizer.pad_token_id)
        self.validate()

    def resolved_pad(self) -> int:
        """Pad id used for left padding: ``pad_token_id``, else the first EOS, else 0."""
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.eos_token_ids[0] if self.eos_token_ids else 0


@dataclass
class EngineOutput:
    """Completions of one ``generate`` call, prompt-major, one logprob per completion token."""

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]


def process_logits(scores: Any, params: SamplingParams, seen: Any = None) -> Any:
    """Apply repetition penalty, temperature, top-k, top-p and min-p to ``scores`` [B, V] (float).

    Same order and semantics as Hugging Face ``generate`` (its ``RepetitionPenaltyLogitsProcessor``,
    ``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``, ``MinPLogitsWarper``, keeping at least
    one token). ``seen`` is a bool [B, V] mask of tokens present in prompt (pads excluded) + completion, used only
    by the repetition penalty. Removed tokens get ``-inf``.
    """
    import torch

    neg_inf = float("-inf")
    if params.repetition_penalty != 1.0 and seen is not None:
        penalised = torch.where(scores < 0, scores * params.repetition_penalty, scores / params.repetition_penalty)
        scores = torch.where(seen, penalised, scores)
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k:
        k = min(int(params.top_k), scores.size(-1))
        kth = torch.topk(scores, k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, neg_inf)
    if params.top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - params.top_p)
        remove_sorted[..., -1:] = False
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, neg_inf)
    if params.min_p is not None:
        probs = torch.softmax(scores, dim=-1)
        remove = probs < params.min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, neg_inf)
    return scores


@contextmanager
def inference_mode(model: Any) -> Iterator[None]:
    """Eval mode and ``torch.inference_mode`` for one call; a model shared with a trainer (which may have put it
    back in train mode) gets its mode back afterwards."""
    import torch

    was_training = model.training
    if was_training:
        model.eval()
    try:
        with torch.inference_mode():
            yield
    finally:
        if was_training:
            model.train()


#: fp32 logits one teacher-forced chunk may hold (rows x kept positions x vocab): 1 GiB
_SCORE_CHUNK_FLOATS = 1 << 28


def _left_padded(seqs: Sequence[Sequence[int]], pad_id: int, dev: Any) -> tuple[Any, Any, Any]:
    """``(input_ids, attention_mask, position_ids)`` of ``seqs`` left-padded with ``pad_id`` to one width."""
    import torch

    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), int(pad_id), dtype=torch.long, device=dev)
    mask = torch.zeros((len(seqs), width), dtype=torch.long, device=dev)
    for r, s in enumerate(seqs):
        ids[r, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[r, width - len(s) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def teacher_forced_logps(
    model: Any,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    temperature: float,
    pad_id: int,
) -> list[list[float]]:
    """``log_softmax(logits / temperature)`` of ``completions[i]`` after ``prompts[i]`` under ``model``, per token.

    What TRL's trainer computes for its old/reference log-probabilities: temperature only, no top-p/top-k/min-p
    or repetition penalty. Sequences are left-padded to one width with explicit position ids (as the sampling
    loop feeds them) and only the last ``max(len(completion)) + 1`` positions' logits are computed, in row chunks
    of at most ``_SCORE_CHUNK_FLOATS`` fp32 logits. Runs under :func:`inference_mode`; the model's device is its
    parameters'.
    """
    import torch

    if len(prompts) != len(completions):
        raise ConfigError(f"score: {len(prompts)} prompts for {len(completions)} completions")
    out: list[list[float]] = [[] for _ in completions]
    todo = [i for i, c in enumerate(completions) if len(c)]
    if not todo:
        return out
    dev = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    rows = max(1, _SCORE_CHUNK_FLOATS // ((max(len(completions[i]) for i in todo) + 1) * vocab))
    with inference_mode(model):
        for start in range(0, len(todo), rows):
            chunk = todo[start : start + rows]
            seqs = [list(prompts[i]) + list(completions[i]) for i in chunk]
            keep = max(len(completions[i]) for i in chunk) + 1  # <= width: every prompt has a token
            ids, mask, position_ids = _left_padded(seqs, pad_id, dev)
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=False, logits_to_keep=keep
            ).logits  # [rows, keep, V]: position width - keep + j predicts token width - keep + j + 1
            for r, i in enumerate(chunk):
                n = len(completions[i])
                picked = logits[r, keep - 1 - n : keep - 1].float()
                target = torch.tensor(list(completions[i]), dtype=torch.long, device=dev).unsqueeze(1)
                out[i] = torch.log_softmax(picked / temperature, dim=-1).gather(1, target).squeeze(1).tolist()
    return out


def cut_after_eos(tokens: Sequence[int], eos: Iterable[int]) -> int:
    """Length of ``tokens`` up to and including the first EOS (the whole length when there is none)."""
    eos_set = set(eos)
    for i, t in enumerate(tokens):
        if t in eos_set:
            return i + 1
    return len(tokens)


def trim_after_eos(
    samples: Iterable[tuple[list[int], list[float]]], eos: Iterable[int]
) -> tuple[list[list[int]], list[list[float]]]:
    """``(completions, logprobs)``: each sample's tokens and logprobs up to and including its first EOS."""
    completions, logprobs = [], []
    for toks, lps in samples:
        n = cut_after_eos(toks, eos)
        completions.append(toks[:n])
        logprobs.append(lps[:n])
    return completions, logprobs


def build_engine(
    factory: Any, model: Any, params: SamplingParams, *, device: str, seed: int, options: dict | None = None
) -> Any:
    """An engine for ``model`` from its registration's ``factory`` (no tokenizer: ``params`` carries the EOS and pad
    ids); ``options`` (``rollout.engine_options`` and what the weight transport needs) are passed only when there
    are some: only engines registered with ``options=True`` take them."""
    return factory(model, None, params=params, device=device, seed=seed, **({"options": options} if options else {}))


def _check_prompts(prompts: Any, num_generations: int) -> None:
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ConfigError(f"num_generations: must be an int >= 1, got {num_generations!r}")
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ConfigError("prompts: must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) or not p:
            raise ConfigError(f"prompts[{i}]: must be a non-empty list of token ids, got {p!r}")


class TransformersEngine:
    """KV-cache sampling loop over a Hugging Face causal LM; samples from the processed (filtered) distribution and
    returns, per sampled token, the trainer's temperature-only ``log_softmax(logits / temperature)`` (computed in
    the same loop from the raw logits; see the module docstring).

    :param model: a ``transformers`` causal LM (``model(input_ids, attention_mask, position_ids,
        past_key_values, use_cache=True)``); put in eval mode and moved to ``device``.
    :param tokenizer: optional; fills ``params.eos_token_ids``/``pad_token_id`` when they are unset.
    :param seed: seeds the engine's private ``torch.Generator``; ``None`` uses torch's global RNG.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str = "cpu",
        params: SamplingParams,
        seed: int | None = None,
    ) -> None:
        import torch

        params.fill_from_tokenizer(tokenizer)
        self.params = params
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.generator: torch.Generator | None = None
        if seed is not None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(int(seed))
        # transformers >= 5.2x renamed ``past_key_values`` to ``cache`` (the old name warns)
        import inspect

        fwd = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in fwd else "past_key_values"

    # ------------------------------------------------------------------------------------------------ generate
    def generate(self, prompts: list[list[int]], num_generations: int = 1) -> EngineOutput:
        """Sample ``num_generations`` completions per prompt; prompt-major order, EOS kept, logprob per token."""
        _check_prompts(prompts, num_generations)
        repeated = [list(p) for p in prompts for _ in range(num_generations)]
        with inference_mode(self.model):
            completions, logprobs = self._sample(repeated)
        return EngineOutput(repeated, completions, logprobs)

    def score(self, prompts: list[list[int]], completions: list[list[int]]) -> list[list[float]]:
        """Teacher-forced log-probabilities of ``completions[i]`` after ``prompts[i]`` under this engine's model.

        ``log_softmax(logits / temperature)`` at every completion token, as TRL computes its reference
        log-probabilities (temperature only: no top-p/top-k/min-p shaping); :func:`teacher_forced_logps`.
        """
        return teacher_forced_logps(
            self.model, prompts, completions, temperature=self.params.temperature, pad_id=self.params.resolved_pad()
        )

    def _sample(self, seqs: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
        import torch

        p = self.params
        dev = self.device
        batch = len(seqs)
        pad = p.resolved_pad()
        input_ids, mask, position_ids = _left_padded(seqs, pad, dev)
        seen = None
        if p.repetition_penalty != 1.0:
            vocab = int(self.model.get_output_embeddings().weight.shape[0])
            seen = torch.zeros((batch, vocab), dtype=torch.bool, device=dev)
            seen.scatter_(1, input_ids, mask.bool())
        filtered = bool(p.filters())  # report the trainer's temperature-only logprob, not the filtered one
        eos = torch.tensor(p.eos_token_ids or [-1], dtype=torch.long, device=dev)
        finished = torch.zeros(batch, dtype=torch.bool, device=dev)
        tokens = torch.empty((batch, p.max_new_tokens), dtype=torch.long, device=dev)
        logps = torch.empty((batch, p.max_new_tokens), dtype=torch.float32, device=dev)
        past = None
        step_ids = input_ids
        steps = 0
        for t in range(p.max_new_tokens):
            out = self.model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kw: past},
            )
            past = getattr(out, self._cache_kw)
            raw = out.logits[:, -1, :].float()
            logprob_all = torch.log_softmax(process_logits(raw, p, seen), dim=-1)
            nxt = torch.multinomial(logprob_all.exp(), 1, generator=self.generator).squeeze(1)
            nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
            tokens[:, t] = nxt
            reported = torch.log_softmax(raw / p.temperature, dim=-1) if filtered else logprob_all
            logps[:, t] = reported.gather(1, nxt.unsqueeze(1)).squeeze(1)
            steps = t + 1
            if seen is not None:
                seen.scatter_(1, nxt.unsqueeze(1), ~finished.unsqueeze(1))
            finished |= torch.isin(nxt, eos)
            if bool(finished.all()):
                break
            step_ids = nxt.unsqueeze(1)
            mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=dev)], dim=1)
            position_ids = position_ids[:, -1:] + 1
        return trim_after_eos(zip(tokens[:, :steps].tolist(), logps[:, :steps].tolist(), strict=True), p.eos_token_ids)
