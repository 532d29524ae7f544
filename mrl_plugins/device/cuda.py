"""CUDA device. Unverified on hardware in this project (no GPU where it was written); see docs/architecture.md.

Stream priority is a real hardware priority on CUDA: ``high`` maps to the greatest priority of
``torch.cuda.Stream.priority_range()``, ``normal`` and ``low`` to the least (the default, 0 — CUDA has nothing
below the default, so ``low`` equals ``normal`` there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from mrl_plugins.device.base import Device, DeviceStream, check_fraction, check_priority


def cuda_priority_number(priority: str, priority_range: tuple[int, int]) -> int:
    """Map ``high``/``normal``/``low`` onto CUDA's range (lower number = higher priority)."""
    check_priority(priority)
    least, greatest = max(priority_range), min(priority_range)
    return greatest if priority == "high" else least


@dataclass(eq=True)
class CudaDevice(Device):
    """One CUDA GPU (``torch.cuda``); collectives use ``nccl``; ``CUDA_VISIBLE_DEVICES`` selects GPUs."""

    type: str = field(default="cuda", init=False)  # CudaDevice(1) is cuda:1
    index: int | None = 0

    def new_stream(self, priority: str = "normal") -> DeviceStream:
        """``torch.cuda.Stream(priority=...)`` from ``torch.cuda.Stream.priority_range()`` (hardware priority)."""
        import torch

        number = cuda_priority_number(priority, tuple(torch.cuda.Stream.priority_range()))
        raw = torch.cuda.Stream(device=self.index, priority=number)
        return DeviceStream(self.type, priority, raw=raw, hw_priority=number, priority_honoured=True)

    @contextmanager
    def stream_context(self, stream: DeviceStream | None) -> Iterator[DeviceStream | None]:
        """``torch.cuda.stream(stream.raw)``."""
        import torch

        with torch.cuda.stream(None if stream is None else stream.raw):
            yield stream

    def synchronize(self) -> None:
        """``torch.cuda.synchronize(index)``."""
        import torch

        torch.cuda.synchronize(self.index)

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction, index)``: the caching allocator refuses more."""
        import torch

        value = check_fraction(fraction)
        torch.cuda.set_per_process_memory_fraction(value, self.index)
        self.memory_fraction = value

    def memory_stats(self) -> dict[str, int]:
        """Allocator peak/current bytes and the GPU's total memory."""
        import torch

        return {
            "peak_bytes": int(torch.cuda.max_memory_allocated(self.index)),
            "allocated_bytes": int(torch.cuda.memory_allocated(self.index)),
            "total_bytes": int(torch.cuda.get_device_properties(self.index).total_memory),
        }

    def reset_peak_memory(self) -> bool:
        """``torch.cuda.reset_peak_memory_stats(index)``."""
        import torch

        torch.cuda.reset_peak_memory_stats(self.index)
        return True
