"""The :class:`Device` interface shared by the CPU, CUDA and NPU implementations, plus streams.

Streams are wrapped in :class:`DeviceStream` so that code written once runs on every backend: on CPU they are
no-ops, on CUDA/NPU they hold the backend's own object in ``.raw`` (pass that to torch functions such as
``Tensor.record_stream``).
"""

from __future__ import annotations

import threading
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mrl_plugins.errors import ConfigError, choices

if TYPE_CHECKING:
    import torch

DEVICE_TYPES: tuple[str, ...] = ("cpu", "cuda", "npu")
STREAM_PRIORITIES: tuple[str, ...] = ("high", "normal", "low")
COLLECTIVE_BACKENDS: dict[str, str] = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}
VISIBLE_DEVICES_ENV: dict[str, str | None] = {
    "cpu": None,
    "cuda": "CUDA_VISIBLE_DEVICES",
    # The runtime variable read by torch_npu/CANN. (ASCEND_VISIBLE_DEVICES is the container-level one that the
    # Ascend docker runtime uses to mount cards; inside a process ASCEND_RT_VISIBLE_DEVICES picks among them.)
    "npu": "ASCEND_RT_VISIBLE_DEVICES",
}


class DeviceFallbackWarning(UserWarning):
    """An accelerator was found but cannot be used; work continues on the next device type (NPU→CUDA→CPU)."""


class CoreLimitWarning(DeviceFallbackWarning):
    """A requested compute limit cannot be applied here (API absent in this torch_npu, or not an NPU)."""


_warned: set[tuple[type[Warning], str]] = set()
_warned_lock = threading.Lock()


def warn_once(message: str, category: type[Warning] = DeviceFallbackWarning, stacklevel: int = 3) -> bool:
    """Emit ``message`` once per process (per category and text). Returns True when it was emitted now."""
    key = (category, message)
    with _warned_lock:
        if key in _warned:
            return False
        _warned.add(key)
    warnings.warn(message, category, stacklevel=stacklevel)
    return True


def check_priority(priority: str) -> str:
    """Validate a stream priority name; ConfigError naming the valid ones otherwise."""
    if priority not in STREAM_PRIORITIES:
        raise ConfigError(f"stream priority {priority!r} is not valid; choose {choices(STREAM_PRIORITIES)}")
    return priority


def check_fraction(fraction: float) -> float:
    """Validate a memory fraction (0 < fraction <= 1); never clamps."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise ConfigError(f"memory fraction must be a number in (0, 1], got {type(fraction).__name__}")
    value = float(fraction)
    if not (0.0 < value <= 1.0):
        raise ConfigError(f"memory fraction {value!r} is outside (0, 1]")
    return value


@dataclass
class DeviceStream:
    """A stream of one device. ``raw`` is the backend stream (``None`` on CPU).

    ``priority`` is what was asked for; ``priority_honoured`` says whether the hardware schedules by it (True only
    on CUDA, and only for ``high`` vs the others).
    """

    device_type: str
    priority: str
    raw: Any = None
    priority_honoured: bool = False

    def synchronize(self) -> None:
        """Wait until all work queued on this stream has finished (no-op on CPU)."""
        if self.raw is not None:
            self.raw.synchronize()


@dataclass(eq=True)
class Device(ABC):
    """One device: ``type`` (``cpu``/``cuda``/``npu``) and ``index`` (``None`` for CPU).

    Subclasses implement the backend calls; obtain instances through :func:`mrl_plugins.device.get_device`.
    ``memory_fraction`` records the last :meth:`set_memory_fraction` (on CPU that is all it does).
    """

    type: str
    index: int | None = None
    memory_fraction: float | None = field(default=None, compare=False)

    # --- facts -------------------------------------------------------------------------------------------------
    @property
    def spec(self) -> str:
        """The spec string that selects this device (``cpu``, ``cuda:0``, ``npu:1``)."""
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @property
    def torch_device(self) -> torch.device:
        """The matching :class:`torch.device`."""
        import torch

        return torch.device(self.type) if self.index is None else torch.device(self.type, self.index)

    def __str__(self) -> str:
        return self.spec

    # --- streams and events --------------------------------------------------------------------------------------
    def new_stream(self, priority: str = "normal") -> DeviceStream:
        """A new stream with ``priority`` in ``high``/``normal``/``low`` (see ``DeviceStream.priority_honoured``)."""
        check_priority(priority)
        return DeviceStream(self.type, priority)

    @contextmanager
    def stream_context(self, stream: DeviceStream | None) -> Iterator[DeviceStream | None]:
        """Context in which work is queued on ``stream`` (``None``: leave the current stream)."""
        yield stream

    def synchronize(self) -> None:  # noqa: B027 - a no-op is the right default (CPU); accelerators override it
        """Wait for all queued work on this device."""

    # --- memory --------------------------------------------------------------------------------------------------
    def set_memory_fraction(self, fraction: float) -> None:
        """Cap this process at ``fraction`` of the device's memory (0 < fraction <= 1, never clamped)."""
        self.memory_fraction = check_fraction(fraction)

    @abstractmethod
    def memory_stats(self) -> dict[str, int]:
        """``peak_bytes``, ``allocated_bytes`` and ``total_bytes`` of this device for this process."""

    @abstractmethod
    def reset_peak_memory(self) -> bool:
        """Reset the peak so the next :meth:`memory_stats` measures from now. Returns whether it could."""


@dataclass(eq=True)
class AcceleratorDevice(Device):
    """A CUDA GPU or an Ascend NPU: the same calls, on ``torch.cuda`` or ``torch_npu.npu`` (:meth:`_ns`)."""

    index: int | None = 0

    @abstractmethod
    def _ns(self) -> Any:
        """The backend's namespace, imported when called (never at module import)."""

    @contextmanager
    def stream_context(self, stream: DeviceStream | None) -> Iterator[DeviceStream | None]:
        """``<ns>.stream(stream.raw)``."""
        with self._ns().stream(None if stream is None else stream.raw):
            yield stream

    def synchronize(self) -> None:
        """``<ns>.synchronize(index)``."""
        self._ns().synchronize(self.index)

    def set_memory_fraction(self, fraction: float) -> None:
        """``<ns>.set_per_process_memory_fraction(fraction, index)`` (a float, as torch_npu requires): the caching
        allocator refuses more."""
        value = check_fraction(fraction)
        self._ns().set_per_process_memory_fraction(value, self.index)
        self.memory_fraction = value

    def _total_bytes(self, ns: Any) -> int:
        return int(ns.get_device_properties(self.index).total_memory)

    def memory_stats(self) -> dict[str, int]:
        """Allocator peak/current bytes and the device's total memory."""
        ns = self._ns()
        total = self._total_bytes(ns)
        return {
            "peak_bytes": int(ns.max_memory_allocated(self.index)),
            "allocated_bytes": int(ns.memory_allocated(self.index)),
            "total_bytes": total,
        }

    def reset_peak_memory(self) -> bool:
        """``<ns>.reset_peak_memory_stats(index)``."""
        self._ns().reset_peak_memory_stats(self.index)
        return True
