"""``python -m benchmarks checkpoint OUT``: a Qwen2-shaped checkpoint folder built in code (no hub), for jobs where
training dominates a step: ``mrl compare --model OUT`` runs ``compare_small``'s task on it (a checkpoint folder takes
the ``small`` preset's task: prompts, 48 completion tokens, 8 generations, batch 16).

The default shape is SmolLM-135M's decoder (hidden 576, MLP 1536, 9 heads, 3 KV heads, tied embeddings) with 38
layers instead of 30, so that with the ``small`` preset's ~100-word vocabulary in place of 49k tokens it keeps about
135M parameters; fp32, seeded.
"""

from __future__ import annotations

import argparse
import os


def build(out: str, *, layers: int = 38, hidden: int = 576, intermediate: int = 1536, seed: int = 0) -> int:
    """Write the checkpoint (model + tokenizer) to ``out``; returns its parameter count."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from mrl_plugins.demo.models import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return sum(p.numel() for p in model.parameters())


def cli(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks checkpoint", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="folder to write (config.json, model.safetensors, the tokenizer)")
    ap.add_argument("--layers", type=int, default=38, help="decoder layers (default 38: ~135M parameters)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    n = build(ns.out, layers=ns.layers, seed=ns.seed)
    print(f"wrote {ns.out}: Qwen2, {n / 1e6:.1f}M parameters, fp32")
    return 0


if __name__ == "__main__":
    raise SystemExit(cli())
