"""CUDA device. Unverified on hardware in this project (no GPU where it was written); see docs/architecture.md.

Stream priority is a real hardware priority on CUDA: ``high`` maps to the greatest priority of
``torch.cuda.Stream.priority_range()``, ``normal`` and ``low`` to the least (the default, 0 — CUDA has nothing
below the default, so ``low`` equals ``normal`` there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.device.base import AcceleratorDevice, DeviceStream, check_priority


def cuda_priority_number(priority: str, priority_range: tuple[int, int]) -> int:
    """Map ``high``/``normal``/``low`` onto CUDA's range (lower number = higher priority)."""
    check_priority(priority)
    least, greatest = max(priority_range), min(priority_range)
    return greatest if priority == "high" else least


@dataclass(eq=True)
class CudaDevice(AcceleratorDevice):
    """One CUDA GPU (``torch.cuda``); collectives use ``nccl``; ``CUDA_VISIBLE_DEVICES`` selects GPUs."""

    type: str = field(default="cuda", init=False)  # CudaDevice(1) is cuda:1

    def _ns(self) -> Any:
        import torch

        return torch.cuda

    def new_stream(self, priority: str = "normal") -> DeviceStream:
        """``torch.cuda.Stream(priority=...)`` from ``torch.cuda.Stream.priority_range()`` (hardware priority)."""
        import torch

        number = cuda_priority_number(priority, tuple(torch.cuda.Stream.priority_range()))
        raw = torch.cuda.Stream(device=self.index, priority=number)
        return DeviceStream(self.type, priority, raw=raw, priority_honoured=True)
