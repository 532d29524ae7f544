"""A worker pool's requests and their results: a :class:`Ticket` per submitted request, its answers assembled
into one :class:`~mrl_plugins.hookspecs.RolloutResult`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.hookspecs import RolloutResult


@dataclass
class Ticket:
    """One submitted request: its chunks (one per active worker) and the answers that arrived."""

    req_id: int
    num_generations: int
    model_id: str
    min_version: int
    chunks: dict[int, tuple[int, list[list[int]]]]  # chunk -> (worker or -1 while queued, prompts)
    results: dict[int, Any] = field(default_factory=dict)


def assemble(ticket: Ticket) -> RolloutResult:
    """One :class:`RolloutResult` from the chunks the workers answered, in chunk order (prompts repeated per
    generation, flat fields split by ``lengths``, the oldest chunk's version)."""
    prompt_ids, completion_ids, logprobs, versions, gen_us, apply_us = [], [], [], [], 0, 0
    scores: dict[str, list[list[float]]] = {}

    for c in sorted(ticket.chunks):
        meta, batch = ticket.results[c]
        versions.append(meta.version)  # a wire.BatchMeta
        gen_us = max(gen_us, meta.gen_us)
        apply_us = max(apply_us, meta.apply_us)
        lengths = batch["lengths"].tolist()
        ids, lps = batch["completion_ids"].tolist(), batch["logprobs"].tolist()
        scored = {k[len("score_") :]: v.tolist() for k, v in batch.items() if k.startswith("score_")}
        off = 0
        for n in lengths:
            completion_ids.append(ids[off : off + n])
            logprobs.append(lps[off : off + n])
            for mid, flat in scored.items():
                scores.setdefault(mid, []).append(flat[off : off + n])
            off += n
        prompt_ids.extend(p for p in ticket.chunks[c][1] for _ in range(ticket.num_generations))
    return RolloutResult(
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
        logprobs=logprobs,
        weight_version=min(versions),
        model_id=ticket.model_id,
        metrics={
            "generate_s": gen_us / 1e6,
            "version_spread": max(versions) - min(versions),
            "engine_apply_ms": apply_us / 1e3,  # the workers' last weight apply (vLLM reload); 0: none
        },
        scores=scores,
    )


def own(value: Any) -> Any:
    """A received field as a tensor that outlives the transport's buffer (released right after): one copy at
    most, and none for fields the decoder built itself (fp16 -> fp32 casts); see
    :func:`mrl_plugins.comm.base.owned`."""
    import numpy as np
    import torch

    from mrl_plugins.comm.base import owned

    value = owned(value)
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value)
    return value if isinstance(value, torch.Tensor) else torch.as_tensor(value).clone()
