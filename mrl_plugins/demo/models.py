"""Tiny models, tokenizer, prompt dataset and a learnable reward, built in code (no hub access).

Presets: ``tiny`` (unit tests, a GRPO step well under 0.1 s), ``small`` (comparison runs,
about 0.5-2 s per GRPO step on 2 CPU cores), ``tiny-tools`` (the tool task of :mod:`mrl_plugins.demo.tool_task`:
arithmetic a calculator tool answers; briefly trained by SFT in code on first use and cached,
:func:`tool_preset_folder`), and the GPU job's two (``qwen2-360m``, ``qwen2-tiny``, below).
``build_model(path)`` loads a local Hugging Face checkpoint folder instead; :func:`save_preset` writes a preset
as one (it reloads with ``AutoModelForCausalLM``/``AutoTokenizer`` and decodes, hence scores, the same).

The CPU preset models are Llama-architecture decoders (no bias). Not Qwen2 for them: ``AutoTokenizer`` maps the model
type ``qwen2`` to ``Qwen2Tokenizer`` whatever tokenizer a folder holds, which rebuilds the vocabulary as a
byte-level BPE and decodes ``a b a c`` as ``abac`` (every reward 0); for ``llama`` folders it loads the
saved word-level tokenizer as it is.

The count task (``tiny``, ``small``): prompts are short random word sequences; the reward counts the
target token ``a`` in the completion (its share of the completion's words). A random policy scores about 1/16; the tiny
preset learns it within about 60 GRPO steps.

The GPU job's presets (``qwen2-360m``, ``qwen2-tiny``; shapes in ``benchmarks/gpu/README.md``) generate 8 x 128 tokens
per prompt, so that generation dominates a step as it does for GRPO users. Their vocabulary puts the EOS token last
and the output layer stops one short of it (:func:`_vocab_size`): the model never samples EOS, every completion runs
to ``max_completion_length`` and every step does the same work, which a speed comparison needs (with EOS, a run whose
policy learns to stop early gets faster, not the plugin). They are never saved and reloaded by ``AutoTokenizer``
(see above), only built in code.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import asdict, dataclass, replace
from typing import Any

from mrl_plugins.demo import tool_task
from mrl_plugins.demo.tool_task import SPECIAL, build_tool_tokenizer, word_level_tokenizer
from mrl_plugins.errors import ConfigError, StageTimeoutError, choices

#: words the tokenizer knows besides the special tokens
WORDS: tuple[str, ...] = tuple("abcdefghijklmnop")


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
    arch: str = "llama"  # 'llama' or 'qwen2'
    dtype: str = "float32"  # the parameters' dtype: 'float32' or 'bfloat16'
    eos_sampled: bool = True  # False: the output layer stops before the EOS id (completions run to full length)


_TINY = Preset(
    64, 128, 2, 2, 1, max_completion_length=8, num_generations=4, per_device_train_batch_size=8, prompt_words=4
)
#: the GPU job's presets (module doc): Qwen2, bf16, the EOS never sampled
_QWEN2 = {"arch": "qwen2", "dtype": "bfloat16", "eos_sampled": False}
PRESETS: dict[str, Preset] = {
    "tiny": _TINY,
    "small": Preset(
        256, 704, 4, 8, 2, max_completion_length=48, num_generations=8, per_device_train_batch_size=16, prompt_words=6
    ),
    # the tool task: head_dim 32 (vLLM's CPU attention serves it); a solved rollout is 15 completion tokens of the
    # policy (13 in the call turn, 2 in the answer) plus 3 of the tool result, 24 leave room for one more call
    "tiny-tools": Preset(
        128, 256, 2, 4, 1, max_completion_length=24, num_generations=8, per_device_train_batch_size=32, prompt_words=0
    ),
    # the GPU job (benchmarks/gpu): Qwen2-0.5B's shape without its vocabulary, bf16, long completions
    "qwen2-360m": Preset(
        896,
        4864,
        24,
        14,
        2,
        max_completion_length=128,
        num_generations=8,
        per_device_train_batch_size=64,
        prompt_words=8,
        **_QWEN2,
    ),
    # the same code path at a CPU size (benchmarks/gpu/run.sh --cpu); head_dim 32
    "qwen2-tiny": replace(_TINY, max_completion_length=16, **_QWEN2),
}
#: presets of the tool task (:mod:`mrl_plugins.demo.tool_task`): built by :func:`tool_preset_folder`, not at random
TOOL_PRESETS = ("tiny-tools",)


def build_tokenizer(*, eos_last: bool = False) -> Any:
    """A WordLevel tokenizer over :data:`WORDS`, wrapped as a left-padding fast tokenizer.

    ``eos_last``: the EOS token takes the last id (presets whose model never samples it: ``eos_sampled=False``).
    """
    order = (*(s for s in SPECIAL if s != "<eos>"), *WORDS, "<eos>") if eos_last else SPECIAL + WORDS
    return word_level_tokenizer(order)


def _is_local_checkpoint(spec: str) -> bool:
    return os.path.isdir(spec) and os.path.isfile(os.path.join(spec, "config.json"))


def check_model(spec: str, key: str = "model") -> None:
    """``spec`` names a preset or a local checkpoint folder (with config.json); ConfigError naming ``key`` and the
    presets otherwise (``train.model``, :func:`build_model`)."""
    if spec not in PRESETS and not _is_local_checkpoint(spec):
        raise ConfigError(
            f"{key}: {spec!r} is neither a preset nor a local checkpoint folder (with config.json); "
            f"valid presets: {choices(PRESETS)}"
        )


def build_model(spec: str = "tiny", *, seed: int = 0) -> tuple[Any, Any]:
    """Return ``(model, tokenizer)`` for a preset name or a local HF checkpoint folder.

    :raise mrl_plugins.errors.ConfigError: unknown preset and not a checkpoint folder.
    """
    check_model(spec)
    if spec not in PRESETS:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(spec, padding_side="left")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        return AutoModelForCausalLM.from_pretrained(spec), tokenizer
    if spec in TOOL_PRESETS:
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(tool_preset_folder(spec, seed=seed))
        return model, build_tool_tokenizer()
    p = PRESETS[spec]
    tokenizer = build_tokenizer(eos_last=not p.eos_sampled)
    return _llama(p, tokenizer, seed), tokenizer


def _vocab_size(p: Preset, tokenizer: Any) -> int:
    """The output layer's size: the whole vocabulary, or all but the last id (the EOS) when it is never sampled."""
    if p.eos_sampled:
        return len(tokenizer)
    if tokenizer.eos_token_id != len(tokenizer) - 1:
        raise ValueError("eos_sampled=False needs the EOS token last (build_tokenizer(eos_last=True))")
    return len(tokenizer) - 1


def _seeded(config: Any, cls: Any, p: Preset, tokenizer: Any, seed: int) -> Any:
    """``cls(config)`` initialised with ``seed`` (the global RNG untouched), in the preset's dtype, with the
    tokenizer's pad/EOS in its generation config."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    if p.dtype != "float32":
        model = model.to(getattr(torch, p.dtype))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def _llama(p: Preset, tokenizer: Any, seed: int) -> Any:
    """A randomly initialised decoder of shape ``p`` over ``tokenizer``'s vocabulary (seeded): Llama (no bias), or
    with ``p.arch == 'qwen2'`` Qwen2 (q/k/v biases, as Qwen2-0.5B); tied embeddings either way."""
    import transformers

    common = {
        "vocab_size": _vocab_size(p, tokenizer),
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": True,
    }
    if p.arch == "qwen2":
        eos = tokenizer.eos_token_id if p.eos_sampled else None  # outside the output layer otherwise
        config = transformers.Qwen2Config(**common, max_position_embeddings=512, eos_token_id=eos, dtype=p.dtype)
        return _seeded(config, transformers.Qwen2ForCausalLM, p, tokenizer, seed)
    eos = tokenizer.eos_token_id
    config = transformers.LlamaConfig(
        **common, max_position_embeddings=256, eos_token_id=eos, attention_bias=False, mlp_bias=False
    )
    return _seeded(config, transformers.LlamaForCausalLM, p, tokenizer, seed)


#: file in a :func:`save_preset` folder naming what it holds (weights, config and vocabulary digest)
FINGERPRINT_FILE = "mrl_preset.json"


def _fingerprint(model: Any, tokenizer: Any) -> str:
    import hashlib

    import torch

    config = {k: v for k, v in model.config.to_dict().items() if not k.startswith("_") and k != "transformers_version"}
    h = hashlib.sha256()
    h.update(type(model).__name__.encode())
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    for name, tensor in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _holds(folder: str, digest: str) -> bool:
    try:
        with open(os.path.join(folder, FINGERPRINT_FILE), encoding="utf-8") as f:
            return json.load(f).get("sha256") == digest and _is_local_checkpoint(folder)
    except (OSError, ValueError, AttributeError):
        return False


def save_preset(model: Any, tokenizer: Any, folder: str | os.PathLike[str]) -> str:
    """Write ``model`` and ``tokenizer`` to ``folder`` as a checkpoint and name the model after it.

    A folder that already holds this very model (same weights, config and vocabulary: :data:`FINGERPRINT_FILE`)
    is reused; anything else there (an older preset, another seed's weights) is replaced, atomically, so a
    reference model built from the folder is always the policy's start. Both ``model.config._name_or_path`` and
    ``model.name_or_path`` become the folder: TRL reads the latter (vLLM's model path, the reference model),
    transformers the former. The folder reloads with ``AutoModelForCausalLM.from_pretrained`` /
    ``AutoTokenizer.from_pretrained`` (or ``build_model(folder)``) to the same weights and the same tokenization.
    Returns the folder as a string.
    """
    import shutil
    import tempfile

    folder = os.path.abspath(os.fspath(folder))
    digest = _fingerprint(model, tokenizer)
    if not _holds(folder, digest):
        parent = os.path.dirname(folder)
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=parent)
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, FINGERPRINT_FILE), "w", encoding="utf-8") as f:
                json.dump({"sha256": digest}, f)
            old = None
            if os.path.lexists(folder):
                old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old.", dir=parent)
                os.rename(folder, os.path.join(old, "x"))
            try:
                os.rename(tmp, folder)
            except OSError:
                if not _holds(folder, digest):  # another process put something else there meanwhile
                    raise
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    model.config._name_or_path = folder
    model.name_or_path = folder
    return folder


#: environment variable naming the cache folder of trained presets (default: :func:`cache_dir`)
CACHE_ENV = "MRL_CACHE_DIR"
#: the longest wait for another process that is training the same preset (its SFT takes about a minute)
CACHE_LOCK_TIMEOUT_S = 900.0


def cache_dir() -> str:
    """``$MRL_CACHE_DIR``, else ``$XDG_CACHE_HOME/mrl_plugins`` or ``~/.cache/mrl_plugins``; where that cannot be
    created (a read-only home), ``<tmp>/mrl_plugins-cache-<uid>``."""
    import tempfile

    explicit = os.environ.get(CACHE_ENV)
    if explicit:
        return os.path.abspath(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    folder = os.path.join(base, "mrl_plugins")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError:
        folder = os.path.join(tempfile.gettempdir(), f"mrl_plugins-cache-{os.getuid()}")
    return folder


def _tool_preset_key(name: str, seed: int, recipe: dict[str, Any]) -> str:
    """What the trained preset depends on: shape, seed, SFT recipe, vocabulary, templates, torch and transformers."""
    import hashlib

    import torch
    import transformers

    spec = {
        "preset": asdict(PRESETS[name]),
        "seed": seed,
        "recipe": recipe,
        "vocab": tool_task.vocabulary(),
        "chat_template": tool_task.CHAT_TEMPLATE,
        "response_template": tool_task.RESPONSE_TEMPLATE,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def _complete(folder: str) -> bool:
    # save_preset renames a finished folder into place: with its fingerprint there, it is whole
    return os.path.isfile(os.path.join(folder, FINGERPRINT_FILE)) and _is_local_checkpoint(folder)


def _locked(path: str, timeout_s: float) -> Any:
    """An exclusive ``flock`` on ``path`` (a context manager), waited for at most ``timeout_s``."""
    import contextlib
    import fcntl
    import time

    @contextlib.contextmanager
    def hold() -> Any:
        with open(path, "a+", encoding="utf-8") as fh:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise StageTimeoutError(
                            f"waited {timeout_s:.0f} s for {path} (another process training the same preset); "
                            f"remove it if no such process runs, or set {CACHE_ENV} to another folder"
                        ) from None
                    time.sleep(0.2)
            try:
                yield
            finally:
                fcntl.flock(fh.fileno(), fcntl.LOCK_UN)

    return hold()


def tool_preset_folder(
    name: str = "tiny-tools", *, seed: int = 0, cache: str | None = None, recipe: dict[str, Any] | None = None
) -> str:
    """The checkpoint folder of a tool-task preset: the Llama of ``PRESETS[name]`` initialised with ``seed`` and
    trained with :func:`mrl_plugins.demo.tool_task.sft` (``recipe`` overrides
    :data:`~mrl_plugins.demo.tool_task.SFT_RECIPE`).

    Trained once, then read from ``<cache>/presets/<name>-seed<seed>-<key>`` (``cache`` defaults to
    :func:`cache_dir`; ``key`` hashes everything the result depends on, so a changed recipe, template or library
    version trains anew). The folder is written by :func:`save_preset` (a temporary folder renamed into place) under
    an exclusive lock, so concurrent processes train it once and never see half a folder.
    """
    if name not in TOOL_PRESETS:
        raise ConfigError(f"tool preset: {name!r} is not one; valid: {choices(TOOL_PRESETS)}")
    unknown = set(recipe or {}) - set(tool_task.SFT_RECIPE)
    if unknown:
        raise ConfigError(f"recipe: unknown keys {sorted(unknown)}; valid: {choices(tool_task.SFT_RECIPE)}")
    full = {**tool_task.SFT_RECIPE, **(recipe or {})}
    root = os.path.join(cache or cache_dir(), "presets")
    folder = os.path.join(root, f"{name}-seed{seed}-{_tool_preset_key(name, seed, full)}")
    if _complete(folder):
        return folder
    os.makedirs(root, exist_ok=True)
    with _locked(folder + ".lock", CACHE_LOCK_TIMEOUT_S):
        if not _complete(folder):  # not trained by another process while this one waited
            tokenizer = build_tool_tokenizer()
            model = _llama(PRESETS[name], tokenizer, seed)
            tool_task.sft(model, tokenizer, seed=seed, recipe=full)
            save_preset(model, tokenizer, folder)
    return folder


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
