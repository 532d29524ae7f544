"""Tiny models, tokenizer, prompt dataset and a learnable reward, built in code (no hub access).

Two presets: ``tiny`` (unit tests, a GRPO step well under 0.1 s) and ``small`` (comparison runs,
about 0.5-2 s per GRPO step on 2 CPU cores). ``build_model(path)`` loads a local Hugging Face
checkpoint folder instead.

The task: prompts are short random word sequences; the reward counts the target token ``a`` in the
completion (its share of the completion's words). A random policy scores about 1/16; the tiny
preset learns it within about 60 GRPO steps.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

#: words the tokenizer knows besides the special tokens
WORDS: tuple[str, ...] = tuple("abcdefghijklmnop")
SPECIAL = ("<pad>", "<eos>", "<unk>")


@dataclass(frozen=True)
class Preset:
    """Model shape plus the GRPO settings that go with it."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_completion_length: int
    num_generations: int
    per_device_train_batch_size: int
    prompt_words: int


PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        64, 128, 2, 4, 2, max_completion_length=8, num_generations=4, per_device_train_batch_size=8, prompt_words=4
    ),
    "small": Preset(
        256, 704, 4, 8, 2, max_completion_length=48, num_generations=8, per_device_train_batch_size=16, prompt_words=6
    ),
}


def build_tokenizer() -> Any:
    """A WordLevel tokenizer over :data:`WORDS`, wrapped as a left-padding fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    return fast


def _is_local_checkpoint(spec: str) -> bool:
    return os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json"))


def build_model(spec: str = "tiny", *, seed: int = 0) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` for a preset name or a local HF checkpoint folder.

    :raise mrl_plugins.errors.ConfigError: unknown preset and not a checkpoint folder.
    """
    from mrl_plugins.errors import ConfigError, choices

    if spec not in PRESETS:
        if _is_local_checkpoint(spec):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(spec, padding_side="left")
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            return AutoModelForCausalLM.from_pretrained(spec), tokenizer
        raise ConfigError(
            f"model: {spec!r} is neither a preset nor a local checkpoint folder (with config.json); "
            f"valid presets: {choices(PRESETS)}"
        )
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    p = PRESETS[spec]
    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=p.hidden_size,
        intermediate_size=p.intermediate_size,
        num_hidden_layers=p.num_hidden_layers,
        num_attention_heads=p.num_attention_heads,
        num_key_value_heads=p.num_key_value_heads,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model, tokenizer


def preset(spec: str) -> Preset:
    """The preset of that name, or the ``small`` settings for a checkpoint folder."""
    return PRESETS.get(spec, PRESETS["small"])


def build_dataset(n: int = 256, *, words: int = 4, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` with a ``prompt`` column of ``words`` random words each."""
    from datasets import Dataset

    rng = random.Random(seed)
    prompts = [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]
    return Dataset.from_dict({"prompt": prompts})


TARGET = "a"


def count_reward(completions: list[str], **kwargs: Any) -> list[float]:
    """Share of completion words equal to :data:`TARGET` (0 for an empty completion)."""
    out = []
    for completion in completions:
        toks = completion.split()
        out.append(sum(t == TARGET for t in toks) / len(toks) if toks else 0.0)
    return out


__all__ = [
    "PRESETS",
    "TARGET",
    "WORDS",
    "Preset",
    "build_dataset",
    "build_model",
    "build_tokenizer",
    "count_reward",
    "preset",
]
