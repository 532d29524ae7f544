"""Memory reservation sized from a profiling pass: measured peak + headroom (20% by default).

``reservation_fraction(peak_bytes=8 << 30, total_bytes=64 << 30)`` (8 GiB peak on a 64 GiB card) is
8 * 1.2 / 64 = 0.15; a peak whose reservation would exceed the device is an error, never clamped.

On NPU/CUDA the fraction goes to ``Device.set_memory_fraction`` (the allocator then refuses more); on CPU it is
recorded and reported, not enforced.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mrl_plugins.device.base import Device
from mrl_plugins.errors import ConfigError

T = TypeVar("T")

DEFAULT_HEADROOM = 0.2


def reservation_fraction(peak_bytes: int, total_bytes: int, headroom: float = DEFAULT_HEADROOM) -> float:
    """``peak_bytes * (1 + headroom) / total_bytes``; ConfigError naming the numbers when it exceeds 1 (no clamp)."""
    if peak_bytes < 0 or total_bytes <= 0:
        raise ConfigError(f"need peak_bytes >= 0 and total_bytes > 0, got peak={peak_bytes} total={total_bytes}")
    if headroom < 0:
        raise ConfigError(f"headroom must be >= 0, got {headroom}")
    need = peak_bytes * (1.0 + headroom)
    fraction = need / total_bytes
    if fraction > 1.0:
        raise ConfigError(
            f"memory reservation does not fit: peak {peak_bytes} B x (1 + headroom {headroom:g}) = {need:.0f} B "
            f"is {fraction:.3f} of the device's {total_bytes} B; lower the batch/model size or use a larger device"
        )
    return fraction


@dataclass(frozen=True)
class MemoryProfile:
    """Memory seen while a callable ran on a device: ``peak_bytes``, the highest held while it ran (absolute: what
    was held before included), and ``total_bytes``, the device's capacity."""

    peak_bytes: int
    total_bytes: int


def measure_peak(fn: Callable[[], T], device: Device) -> tuple[T, MemoryProfile]:
    """Run ``fn()`` once on ``device`` and return its result and a profile.

    The device is synchronised before and after, and its peak reset first. On CPU, when the kernel does not let
    the peak be reset, ``peak_bytes`` is the process peak so far.
    """
    device.synchronize()
    device.reset_peak_memory()
    result = fn()
    device.synchronize()
    after = device.memory_stats()
    peak = int(max(after["peak_bytes"], after["allocated_bytes"]))
    return result, MemoryProfile(peak_bytes=peak, total_bytes=int(after["total_bytes"]))


def reserve_memory(
    device: Device, peak_bytes: int, headroom: float = DEFAULT_HEADROOM, total_bytes: int | None = None
) -> float:
    """Cap this process on ``device`` at ``peak_bytes * (1 + headroom)`` and return the fraction set.

    ``total_bytes`` defaults to the device's capacity (``memory_stats()["total_bytes"]``). NPU/CUDA: the caching
    allocator then refuses more (an engine OOM instead of starving the trainer next to it); CPU: recorded in
    ``device.memory_fraction`` only. A reservation over the whole device is a ConfigError; nothing is set then.
    """
    total = device.memory_stats()["total_bytes"] if total_bytes is None else total_bytes
    fraction = reservation_fraction(peak_bytes, total, headroom)
    if fraction == 0.0:
        raise ConfigError(f"peak_bytes={peak_bytes} gives an empty reservation on {device.spec}; profile real work")
    device.set_memory_fraction(fraction)
    return fraction
