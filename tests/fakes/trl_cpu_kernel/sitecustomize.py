"""Test fake for TRL 1.15.x on a machine without a GPU (put this folder on ``PYTHONPATH``; ``tox -e trl115``).

TRL 1.15.0 computes every per-token log-probability through its fused LM head, whose kernel
(``trl.kernels.ChunkedLogProbFunction``) is written in Triton only: without Triton, or on CPU tensors, vanilla TRL 1.15
cannot train at all (``'NoneType' object has no attribute 'apply'``). TRL 1.16 folds the same tiles in torch on CPU.
Where hardware is absent, this stands in for that kernel with plain torch (same arguments, same five outputs,
differentiated by autograd), in every Python process of the environment: the trainers the tests build and the ones
they start as scripts. Nothing of mrl-plugins is replaced; TRL 1.14 and 1.16 do not need it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

TARGET = "trl.trainer.utils"


class TorchChunkedLogProb:
    """``ChunkedLogProbFunction.apply`` of TRL 1.15 in plain torch."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0, outputs=()):
        import torch

        logits = hidden @ weight.t()
        if bias is not None:
            logits = logits + bias
        logits = logits.float() * logit_scale
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits / temperature
        logp = torch.log_softmax(logits, dim=-1)
        picked = logp.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
        probs = logp.exp()
        entropy = -(probs * logp).sum(-1) if "entropy" in outputs else None
        sq = torch.logsumexp(2 * logp, dim=-1).detach() if "log_sum_sq_probs" in outputs else None
        mean = logits.mean(-1).detach() if "mean_logits" in outputs else None
        top1 = (logits.argmax(-1) == targets).detach() if "is_top1" in outputs else None
        return picked, entropy, sq, mean, top1


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            if getattr(module, "_ChunkedLogProbFunction", "absent") is None:  # TRL 1.15 without Triton
                module._ChunkedLogProbFunction = TorchChunkedLogProb

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _Patch())
