"""Device discovery and selection: ``get_device("auto" | "cpu" | "cuda[:N]" | "npu[:N]")``.

``auto`` prefers NPU, then CUDA, then CPU. When torch_npu is installed but unusable (import fails, no CANN, no
card visible) ``auto`` continues on CUDA/CPU with one :class:`DeviceFallbackWarning` per process naming the
reason; an explicit ``npu`` request raises :class:`~mrl_plugins.errors.DeviceError` instead.
"""

from __future__ import annotations

import re
from typing import Any

from mrl_plugins.device import probe
from mrl_plugins.device.base import (
    COLLECTIVE_BACKENDS,
    DEVICE_TYPES,
    VISIBLE_DEVICES_ENV,
    Device,
    DeviceFallbackWarning,
    warn_once,
)
from mrl_plugins.device.cpu import CpuDevice
from mrl_plugins.device.cuda import CudaDevice
from mrl_plugins.device.npu import NpuDevice
from mrl_plugins.errors import ConfigError, DeviceError, choices

SPEC_FORMS: tuple[str, ...] = ("auto", "cpu", "cuda", "cuda:N", "npu", "npu:N")
_SPEC = re.compile(r"^(auto|cpu|cuda|npu)(?::(\d+))?$")


def parse_device_spec(spec: Any, key: str = "device") -> tuple[str, int | None]:
    """Split a device spec into ``(type, index)``: the one rule of a spec (``train.device``, ``mrl doctor --device``,
    :func:`get_device`), case and surrounding blanks aside; ConfigError naming ``key`` and the valid forms otherwise.

    ``"auto"`` -> ``("auto", None)``, ``"NPU"`` -> ``("npu", None)``, ``"cuda:1"`` -> ``("cuda", 1)``.
    """
    m = _SPEC.match(spec.strip().lower()) if isinstance(spec, str) else None
    if m is None or (m.group(2) is not None and m.group(1) in ("auto", "cpu")):
        raise ConfigError(f"{key}: {spec!r} is not a device; valid forms: {choices(SPEC_FORMS)}")
    return m.group(1), None if m.group(2) is None else int(m.group(2))


def canonical_device_spec(spec: Any, key: str = "device") -> str:
    """``spec`` in the one spelling the code compares (``" CUDA:1"`` -> ``"cuda:1"``); errors: parse_device_spec."""
    kind, index = parse_device_spec(spec, key)
    return kind if index is None else f"{kind}:{index}"


def _choices_text(counts: dict[str, int]) -> str:
    specs = ["auto", "cpu"]
    for kind in ("cuda", "npu"):
        specs += [kind] + [f"{kind}:{i}" for i in range(counts[kind])] if counts[kind] else []
    return choices(specs)


def available_device_types() -> list[str]:
    """Device types usable in this process, CPU first: ``["cpu"]``, ``["cpu", "cuda"]``, ``["cpu", "npu"]``..."""
    types = ["cpu"]
    if probe.is_cuda_available():
        types.append("cuda")
    if probe.is_torch_npu_available():
        types.append("npu")
    return types


def get_device(spec: str = "auto") -> Device:
    """The :class:`Device` for ``spec`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``npu``, ``npu:N``).

    Raises ConfigError for a malformed spec and DeviceError, naming the available choices, for a device that
    is not present. ``auto`` never raises: NPU, else CUDA, else CPU (see module doc for the fallback warning).
    """
    kind, index = parse_device_spec(spec)
    if kind == "cpu":
        return CpuDevice()
    if kind == "auto":
        npu = probe.npu_status()
        if npu.usable:
            return NpuDevice(index=0)
        cuda = probe.is_cuda_available()
        if npu.installed:
            nxt = "CUDA" if cuda else "CPU"
            warn_once(f"torch_npu is installed but unusable, continuing on {nxt}: {npu.reason}", DeviceFallbackWarning)
        return CudaDevice(index=0) if cuda else CpuDevice()
    index = 0 if index is None else index
    # Probe only the requested backend on the success path; the other one only to list choices in an error.
    if kind == "cuda":
        if index < probe.cuda_device_count():
            return CudaDevice(index=index)
        npu = probe.npu_status()
    else:
        npu = probe.npu_status()
        if npu.usable and index < npu.device_count:
            return NpuDevice(index=index)
    counts = {"cpu": 1, "cuda": probe.cuda_device_count(), "npu": npu.device_count if npu.usable else 0}
    if counts[kind]:
        why = f"{counts[kind]} {kind.upper()} visible"
    elif kind == "npu":
        why = npu.reason if npu.installed else "torch_npu is not installed"
    else:
        why = "torch.cuda.is_available() is False"
    raise DeviceError(f"device {spec!r} is not present ({why}); available: {_choices_text(counts)}")


def _check_type(device_type: str) -> str:
    if device_type not in DEVICE_TYPES:
        raise ConfigError(f"device type {device_type!r} is not valid; choose {choices(DEVICE_TYPES)}")
    return device_type


def collective_backend(device_type: str | None = None) -> str:
    """torch.distributed backend for ``device_type`` (``hccl``/``nccl``/``gloo``); ``None``: the ``auto`` device's."""
    if device_type is None:
        device_type = get_device("auto").type
    return COLLECTIVE_BACKENDS[_check_type(device_type)]


def visible_devices_env(device_type: str) -> str | None:
    """``ASCEND_RT_VISIBLE_DEVICES`` (npu), ``CUDA_VISIBLE_DEVICES`` (cuda) or ``None`` (cpu)."""
    return VISIBLE_DEVICES_ENV[_check_type(device_type)]
