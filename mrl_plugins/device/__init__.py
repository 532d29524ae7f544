"""One device interface over Ascend NPU (torch_npu), CUDA and CPU.

Example::

    from mrl_plugins.device import get_device
    dev = get_device("auto")            # NPU, else CUDA, else CPU
    dev.collective_backend              # 'hccl' / 'nccl' / 'gloo'
    s = dev.new_stream("high")          # hardware priority on CUDA only (s.priority_honoured)
    with dev.stream_context(s):
        ...

Importing this package is cheap: it imports neither torch nor torch_npu. torch is imported inside the calls
that need it; torch_npu only when probing or using an NPU, always guarded (an install without CANN makes the
import fail — see :func:`torch_npu_without_cann`). NPU and CUDA paths are unverified on hardware in this
project: NPU is tested against a fake torch_npu that follows the documented API.
"""

from __future__ import annotations

from mrl_plugins.device.base import (
    COLLECTIVE_BACKENDS,
    DEVICE_TYPES,
    STREAM_PRIORITIES,
    VISIBLE_DEVICES_ENV,
    CoreLimitWarning,
    Device,
    DeviceFallbackWarning,
    DeviceStream,
)
from mrl_plugins.device.budget import (
    AppliedBudget,
    ComputeBudget,
    allowed_cores,
    apply_compute_budget,
    split_cores,
)
from mrl_plugins.device.cpu import CpuDevice
from mrl_plugins.device.cuda import CudaDevice
from mrl_plugins.device.memory import (
    MemoryProfile,
    measure_peak,
    reservation_fraction,
    reserve_memory,
)
from mrl_plugins.device.npu import NpuDevice
from mrl_plugins.device.probe import (
    CORE_LIMIT_APIS,
    NpuStatus,
    cann_home,
    cann_version,
    core_limit_apis,
    is_cuda_available,
    is_torch_npu_available,
    npu_status,
    torch_npu_installed,
    torch_npu_without_cann,
    versions,
)
from mrl_plugins.device.select import (
    available_device_types,
    collective_backend,
    get_device,
    parse_device_spec,
    visible_devices_env,
)

__all__ = [
    "AppliedBudget",
    "COLLECTIVE_BACKENDS",
    "CORE_LIMIT_APIS",
    "ComputeBudget",
    "CoreLimitWarning",
    "CpuDevice",
    "CudaDevice",
    "DEVICE_TYPES",
    "Device",
    "DeviceFallbackWarning",
    "DeviceStream",
    "MemoryProfile",
    "NpuDevice",
    "NpuStatus",
    "STREAM_PRIORITIES",
    "VISIBLE_DEVICES_ENV",
    "allowed_cores",
    "apply_compute_budget",
    "available_device_types",
    "cann_home",
    "cann_version",
    "collective_backend",
    "core_limit_apis",
    "get_device",
    "is_cuda_available",
    "is_torch_npu_available",
    "measure_peak",
    "npu_status",
    "parse_device_spec",
    "reservation_fraction",
    "reserve_memory",
    "split_cores",
    "torch_npu_installed",
    "torch_npu_without_cann",
    "versions",
    "visible_devices_env",
]
