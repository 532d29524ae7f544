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

from dataclasses import dataclass, field
from types import ModuleType

from mrl_plugins.device import probe
from mrl_plugins.device.base import AcceleratorDevice, DeviceStream, check_priority

#: torch_npu stream pool per priority name (pool 1 = "high" pool; no scheduling effect, see module doc).
NPU_POOL_PRIORITY: dict[str, int] = {"high": -1, "normal": 0, "low": 0}


def npu_namespace() -> ModuleType:
    """``torch_npu.npu`` (imports torch_npu; only call when an NPU device was selected)."""
    return probe._import_torch_npu().npu


@dataclass(eq=True)
class NpuDevice(AcceleratorDevice):
    """One Ascend NPU; collectives use ``hccl``; ``ASCEND_RT_VISIBLE_DEVICES`` selects NPUs."""

    type: str = field(default="npu", init=False)  # NpuDevice(1) is npu:1

    def _ns(self) -> ModuleType:
        return npu_namespace()

    def new_stream(self, priority: str = "normal") -> DeviceStream:
        """``torch_npu.npu.Stream(device=index, priority=...)``; ``priority_honoured`` is False (module doc)."""
        check_priority(priority)
        raw = npu_namespace().Stream(device=self.index, priority=NPU_POOL_PRIORITY[priority])
        return DeviceStream(self.type, priority, raw=raw, priority_honoured=False)

    def _total_bytes(self, npu: ModuleType) -> int:
        """``mem_get_info``'s total where torch_npu has it, else the device properties'."""
        if hasattr(npu, "mem_get_info"):
            return int(npu.mem_get_info(self.index)[1])
        return super()._total_bytes(npu)
