"""Ascend NPU device through torch_npu. Unverified on hardware here: tested against a fake torch_npu module.

Every call goes to ``torch_npu.npu`` (the namespace torch_npu also registers as ``torch.npu``); torch_npu is
imported inside the methods, never at module import.

**Stream priority is not a hardware priority on NPU.** torch_npu's ``Stream(priority=...)`` only picks one of
two stream pools; every pool stream is created with ``aclrtCreateStreamWithConfig(&stream, 0, ...)``
(priority 0) in ``torch_npu/csrc/core/npu/NPUStream.cpp`` of every release to date. So
``DeviceStream.priority_honoured`` is always False here; use core limits (:mod:`mrl_plugins.device.budget`,
``set_stream_limit``) to protect a latency-critical stream instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType

from mrl_plugins.device import probe
from mrl_plugins.device.base import Device, DeviceStream, check_fraction, check_priority

#: torch_npu stream pool per priority name (pool 1 = "high" pool; no scheduling effect, see module doc).
NPU_POOL_PRIORITY: dict[str, int] = {"high": -1, "normal": 0, "low": 0}


def npu_namespace() -> ModuleType:
    """``torch_npu.npu`` (imports torch_npu; only call when an NPU device was selected)."""
    return probe._import_torch_npu().npu


@dataclass(eq=True)
class NpuDevice(Device):
    """One Ascend NPU; collectives use ``hccl``; ``ASCEND_RT_VISIBLE_DEVICES`` selects NPUs."""

    type: str = field(default="npu", init=False)  # NpuDevice(1) is npu:1
    index: int | None = 0

    def new_stream(self, priority: str = "normal") -> DeviceStream:
        """``torch_npu.npu.Stream(device=index, priority=...)``; ``priority_honoured`` is False (module doc)."""
        check_priority(priority)
        number = NPU_POOL_PRIORITY[priority]
        raw = npu_namespace().Stream(device=self.index, priority=number)
        return DeviceStream(self.type, priority, raw=raw, hw_priority=None, priority_honoured=False)

    @contextmanager
    def stream_context(self, stream: DeviceStream | None) -> Iterator[DeviceStream | None]:
        """``torch_npu.npu.stream(stream.raw)``."""
        with npu_namespace().stream(None if stream is None else stream.raw):
            yield stream

    def synchronize(self) -> None:
        """``torch_npu.npu.synchronize(index)``."""
        npu_namespace().synchronize(self.index)

    def set_memory_fraction(self, fraction: float) -> None:
        """``torch_npu.npu.set_per_process_memory_fraction(fraction, index)`` (it requires a float)."""
        value = check_fraction(fraction)
        npu_namespace().set_per_process_memory_fraction(value, self.index)
        self.memory_fraction = value

    def memory_stats(self) -> dict[str, int]:
        """Allocator peak/current bytes and the NPU's total memory (``mem_get_info``)."""
        npu = npu_namespace()
        if hasattr(npu, "mem_get_info"):
            total = int(npu.mem_get_info(self.index)[1])
        else:
            total = int(npu.get_device_properties(self.index).total_memory)
        return {
            "peak_bytes": int(npu.max_memory_allocated(self.index)),
            "allocated_bytes": int(npu.memory_allocated(self.index)),
            "total_bytes": total,
        }

    def reset_peak_memory(self) -> bool:
        """``torch_npu.npu.reset_peak_memory_stats(index)``."""
        npu_namespace().reset_peak_memory_stats(self.index)
        return True
