"""The in-process inference copy runs its own weights even when the trainer patched forward methods."""

from __future__ import annotations

import types

import torch

from mrl_plugins.demo.models import build_model
from mrl_plugins.weight_sync.sources import inference_copy


def test_a_forward_patched_onto_the_trainer_model_does_not_run_the_trainer_model_in_the_copy():
    """TRL 1.16's fused LM head replaces ``model.forward`` with a closure over the original bound forward; a plain
    deep copy keeps calling the original model (found as wrong logprobs from the workers: 0 engine)."""
    model, _ = build_model("tiny", seed=0)
    original = model.forward

    def patched(self, *args, **kwargs):
        return original(*args, **kwargs)  # closes over the trainer's model, as TRL's patch does

    model.forward = types.MethodType(patched, model)
    model.lm_head.forward = types.MethodType(lambda self, x, f=model.lm_head.forward: f(x), model.lm_head)
    copy = inference_copy(model)
    with torch.no_grad():
        for p in copy.parameters():
            p.mul_(0.5)
        ids = torch.tensor([[3, 4, 5, 6]])
        mine, theirs = copy(ids).logits, model(ids).logits
    assert not torch.allclose(mine, theirs)  # the copy computed with its own (halved) weights
    assert "forward" in model.__dict__  # the trainer's model keeps its patch
    assert not copy.training and not any(p.requires_grad for p in copy.parameters())
