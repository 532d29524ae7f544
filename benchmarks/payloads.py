"""Payloads of the benchmarks: GRPO experience batches (``python -m benchmarks comm``) and weight shape lists
(``python -m benchmarks weights``), shared by the loopback and the link (:mod:`benchmarks.link`) variants."""

from __future__ import annotations

import torch

SIZES = {"64x1024": (64, 1024), "8x128": (8, 128)}
Shapes = list[tuple[str, tuple[int, ...], torch.dtype]]


def make_batch(b: int, t: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GRPO-like experience batch of ``b`` sequences with ``t`` completion tokens (``t // 4`` prompt tokens)."""
    g = torch.Generator().manual_seed(seed)
    p = max(1, t // 4)
    prompt_mask = torch.ones(b, p, dtype=torch.int64)
    prompt_mask[:, : p // 8] = 0
    lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
    completion_mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.int64)
    logps = -torch.rand(b, t, generator=g) * 12.0
    logps.view(-1)[:: max(1, (b * t) // 8)] = float("-inf")
    rewards = torch.randn(b, generator=g)
    return {
        "prompt_ids": torch.randint(0, 151_000, (b, p), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, 151_000, (b, t), generator=g),
        "completion_mask": completion_mask,
        "old_per_token_logps": logps,
        "advantages": (rewards - rewards.mean()) / (rewards.std() + 1e-4),
        "rewards": rewards,
    }


def qwen_shapes(
    vocab: int = 151936, hidden: int = 896, inter: int = 4864, layers: int = 24, kv: int = 128, dtype=torch.bfloat16
) -> Shapes:
    """Qwen2-style parameter shapes (tied embeddings: no lm_head)."""
    out: Shapes = [("model.embed_tokens.weight", (vocab, hidden), dtype)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), dtype),
            (p + "self_attn.q_proj.bias", (hidden,), dtype),
            (p + "self_attn.k_proj.weight", (kv, hidden), dtype),
            (p + "self_attn.k_proj.bias", (kv,), dtype),
            (p + "self_attn.v_proj.weight", (kv, hidden), dtype),
            (p + "self_attn.v_proj.bias", (kv,), dtype),
            (p + "self_attn.o_proj.weight", (hidden, hidden), dtype),
            (p + "mlp.gate_proj.weight", (inter, hidden), dtype),
            (p + "mlp.up_proj.weight", (inter, hidden), dtype),
            (p + "mlp.down_proj.weight", (hidden, inter), dtype),
            (p + "input_layernorm.weight", (hidden,), dtype),
            (p + "post_attention_layernorm.weight", (hidden,), dtype),
        ]
    out.append(("model.norm.weight", (hidden,), dtype))
    return out


def make_tensors(shapes: Shapes) -> list[tuple[str, torch.Tensor]]:
    out = []
    for i, (n, s, dt) in enumerate(shapes):
        t = torch.empty(s, dtype=dt)
        t.fill_(i % 7) if dt not in (torch.float32, torch.bfloat16, torch.float16) else t.fill_(0.001 * i)
        out.append((n, t))
    return out


__all__ = ["SIZES", "Shapes", "make_batch", "make_tensors", "qwen_shapes"]
