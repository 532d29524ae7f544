"""Training-side sources: the trainer's weights as a stream of ``(name, tensor)`` pairs.

* plain module: ``named_parameters()``;
* DDP (or any wrapper with ``.module``): unwrapped; every rank holds the full weights (each rank
  publishes to its own inference copy);
* DeepSpeed ZeRO-3: parameters are gathered a bucket at a time inside
  ``deepspeed.zero.GatheredParameters(bucket, modifier_rank=None)``; peak extra memory is about one
  bucket. Gathering is a collective, so **every rank must iterate** the generator (non-publishing
  ranks just drain it);
* PEFT/LoRA: the adapters are merged, the base weights yielded under the base model's names
  (``base_model.model.`` and ``.base_layer`` stripped, adapter tensors and ``original_module`` copies
  skipped, ``modules_to_save.default.`` removed, like TRL's vLLM sync) and the adapters unmerged
  afterwards (also when the consumer stops early). With ZeRO-3 the whole model is gathered for the
  merge (sharded merging is not supported by PEFT), as TRL does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

import torch

DEFAULT_GATHER_BUCKET = 64 << 20


def unwrap(model: Any, accelerator: Any = None) -> torch.nn.Module:
    """Strip DDP/DeepSpeed/compile wrappers."""
    if accelerator is not None and hasattr(accelerator, "unwrap_model"):
        try:
            model = accelerator.unwrap_model(model)
        except Exception:  # noqa: BLE001 - fall back to attribute unwrapping
            pass
    seen = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and seen < 8:
        model = model.module
        seen += 1
    return getattr(model, "_orig_mod", model)


def is_zero3(model: torch.nn.Module) -> bool:
    """True when parameters are partitioned by DeepSpeed ZeRO-3 (they carry ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def is_peft(model: Any) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "merge_adapter") and hasattr(model, "unmerge_adapter")


def inference_copy(model: Any) -> Any:
    """A deep copy of ``model`` to generate with, in eval mode and without gradients.

    PEFT: the copy is the merged base model (``merge_and_unload``), whose parameter names are the ones
    ``iter_trainer_weights`` publishes, so every later version lands by name.

    Forward methods patched onto module instances are dropped, so every module of the copy runs its class's
    forward: such patches close over the *original* module (TRL 1.16's fused LM head keeps the original
    ``model.forward`` in a closure, its fp32 LM-head cast likewise), which a deep copy does not rebind, so the copy
    would silently run the trainer's model (in train mode under gradient checkpointing: no KV cache, wrong logprobs).
    """
    out = copy.deepcopy(model)
    for module in out.modules():
        module.__dict__.pop("forward", None)
    if is_peft(out):
        out = out.merge_and_unload()
    out.eval()
    for p in out.parameters():
        p.requires_grad_(False)
    return out


def strip_wrappers(name: str) -> str:
    """A parameter's name without activation-checkpointing wrappers' ``_checkpoint_wrapped_module.`` parts (the
    served model has none), on every path of :func:`iter_trainer_weights`."""
    return name.replace("_checkpoint_wrapped_module.", "")


def peft_base_name(name: str, prefix: str = "lora_") -> str | None:
    """TRL's name fixing for merged PEFT models: the base model's name, or ``None`` to skip the tensor."""
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    if prefix and prefix in name:
        return None
    if "original_module" in name:
        return None
    return strip_wrappers(name.replace("modules_to_save.default.", ""))


def _numel_bytes(p: torch.nn.Parameter) -> int:
    n = getattr(p, "ds_numel", None)
    return (p.numel() if n is None else int(n)) * p.element_size()


def _zero3_buckets(params: list[tuple[str, torch.nn.Parameter]], bucket_bytes: int) -> Iterator[list]:
    cur: list = []
    size = 0
    for item in params:
        nb = _numel_bytes(item[1])
        if cur and size + nb > bucket_bytes:
            yield cur
            cur, size = [], 0
        cur.append(item)
        size += nb
    if cur:
        yield cur


def iter_trainer_weights(
    model: Any,
    accelerator: Any = None,
    *,
    bucket_bytes: int | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the trainer's current weights, one tensor at a time (see the module docstring).

    :param bucket_bytes: ZeRO-3 gather unit (default 64 MiB); the tensors yielded inside a bucket are
        valid until the generator is resumed past that bucket.
    """
    model = unwrap(model, accelerator)
    zero3 = is_zero3(model)

    if is_peft(model):
        prefix = getattr(model, "prefix", "lora_")
        with _gather_all(model) if zero3 else nullcontext():
            model.merge_adapter()
            try:
                for n, p in model.named_parameters():
                    base = peft_base_name(n, prefix)
                    if base is not None:
                        yield base, p.detach()
            finally:
                model.unmerge_adapter()
        return

    items = [(strip_wrappers(n), p) for n, p in model.named_parameters()]
    if zero3:
        for group in _zero3_buckets(items, bucket_bytes or DEFAULT_GATHER_BUCKET):
            yield from _gathered(group)
        return
    for n, p in items:
        yield n, p.detach()


def _gathered(group: list[tuple[str, torch.nn.Parameter]]) -> Iterator:
    import deepspeed

    with deepspeed.zero.GatheredParameters([p for _, p in group], modifier_rank=None):
        for n, p in group:
            yield n, p.data.detach()


def _gather_all(model: torch.nn.Module) -> Any:
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


__all__ = [
    "inference_copy",
    "is_peft",
    "is_zero3",
    "iter_trainer_weights",
    "peft_base_name",
    "unwrap",
]
