"""One device interface over Ascend NPU (torch_npu), CUDA and CPU.

Example::

    from mrl_plugins.device import collective_backend, get_device
    dev = get_device("auto")            # NPU, else CUDA, else CPU
    collective_backend(dev.type)        # 'hccl' / 'nccl' / 'gloo'
    s = dev.new_stream("high")          # hardware priority on CUDA only (s.priority_honoured)
    with dev.stream_context(s):
        ...

Importing this package is cheap: it imports neither torch nor torch_npu. torch is imported inside the calls
that need it; torch_npu only when probing or using an NPU, always guarded (an install without CANN makes the
import fail — see :func:`torch_npu_without_cann`). NPU and CUDA paths are unverified on hardware in this
project: NPU is tested against a fake torch_npu that follows the documented API.
"""

from __future__ import annotations

# the package's API: re-exported names
from mrl_plugins.device.base import CoreLimitWarning, Device, DeviceFallbackWarning  # noqa: F401
from mrl_plugins.device.budget import ComputeBudget, allowed_cores, apply_compute_budget, split_cores  # noqa: F401
from mrl_plugins.device.cpu import CpuDevice  # noqa: F401
from mrl_plugins.device.cuda import CudaDevice  # noqa: F401
from mrl_plugins.device.memory import measure_peak, reservation_fraction, reserve_memory  # noqa: F401
from mrl_plugins.device.npu import NpuDevice  # noqa: F401
from mrl_plugins.device.probe import (  # noqa: F401
    core_limit_apis,
    is_cuda_available,
    is_torch_npu_available,
    npu_status,
    torch_npu_installed,
    torch_npu_without_cann,
    versions,
)
from mrl_plugins.device.select import (  # noqa: F401
    available_device_types,
    collective_backend,
    get_device,
    parse_device_spec,
    visible_devices_env,
)
