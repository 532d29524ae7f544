"""The TRL 1.15 CPU stand-in (tests/fakes/trl_cpu_kernel, used by ``tox -e trl115``) computes what TRL's fused
log-probability kernel computes: checked against TRL 1.16's own kernel, which folds the same tiles in torch on CPU."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from tests.marks import require_trl

FAKE = "tests/fakes/trl_cpu_kernel/sitecustomize.py"


def _fake():
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / FAKE
    spec = importlib.util.spec_from_file_location("mrl_trl_cpu_kernel_fake", path)
    module = importlib.util.module_from_spec(spec)
    finders = list(sys.meta_path)
    spec.loader.exec_module(module)
    sys.meta_path[:] = finders  # only the function is wanted here, not the import hook
    return module.TorchChunkedLogProb


@require_trl
@pytest.mark.parametrize("softcap,scale,bias", [(None, 1.0, False), (30.0, 0.5, True)])
def test_stand_in_equals_trls_own_cpu_kernel_in_values_and_gradients(softcap, scale, bias):
    kernels = pytest.importorskip("trl.kernels")
    real = getattr(kernels, "ChunkedLogProbFunction", None)
    if real is None:
        pytest.skip("this TRL has no torch fold of the fused kernel (TRL 1.15 without Triton)")
    torch.manual_seed(0)
    n, h, v = 11, 16, 37
    hidden = torch.randn(n, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    b = torch.randn(v, requires_grad=True) if bias else None
    targets = torch.randint(0, v, (n,))
    outputs = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    got = _fake().apply(hidden, weight, b, targets, 0.7, 8, softcap, scale, outputs)
    want = real.apply(hidden, weight, b, targets, 0.7, 8, softcap, scale, outputs)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g.float(), w.float(), atol=1e-5), (g, w)
    params = [hidden, weight] + ([b] if bias else [])
    grads = [torch.autograd.grad((out[0].sum() + out[1].sum()), params) for out in (got, want)]
    for g, w in zip(*grads, strict=True):
        assert torch.allclose(g, w, atol=1e-5)
