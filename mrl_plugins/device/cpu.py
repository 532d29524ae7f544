"""CPU device: no-op streams and events, memory from the kernel (peak RSS, cgroup/physical total).

``set_memory_fraction`` on CPU is **recorded only, not enforced**: there is no allocator cap for host memory in
torch. The value is kept in ``Device.memory_fraction`` so reports can show the reservation.
"""

from __future__ import annotations

import os
import re
import resource
from dataclasses import dataclass, field

from mrl_plugins.device.base import Device

_STATUS_FIELD = re.compile(r"^(VmHWM|VmRSS):\s+(\d+)\s*kB", re.MULTILINE)


def _proc_status() -> dict[str, int]:
    """VmHWM (peak RSS) and VmRSS (current RSS) of this process in bytes, from ``/proc/self/status``."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return {}
    return {k: int(v) * 1024 for k, v in _STATUS_FIELD.findall(text)}


def _cgroup_memory_limit() -> int | None:
    """The cgroup memory limit in bytes (v2 ``memory.max`` or v1 ``memory.limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as fh:
                raw = fh.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):
            return int(raw)
    return None


def physical_memory_bytes() -> int:
    """Total memory usable by this process: physical RAM, lowered to the cgroup limit when there is one."""
    total = 0
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        total = int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_memory_limit()
    return min(total, limit) if limit else total


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    rss = _proc_status().get("VmRSS")
    if rss is not None:
        return rss
    import psutil

    return int(psutil.Process().memory_info().rss)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (since start or the last :func:`reset_peak_rss`)."""
    hwm = _proc_status().get("VmHWM")
    if hwm is not None:
        return hwm
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


@dataclass(eq=True)
class CpuDevice(Device):
    """The host CPU. Streams/events are no-ops (events still time host work); collectives use ``gloo``."""

    type: str = field(default="cpu", init=False)
    index: int | None = None

    def memory_stats(self) -> dict[str, int]:
        """Peak and current RSS of this process and the memory available to it (cgroup or physical)."""
        return {
            "peak_bytes": peak_rss_bytes(),
            "allocated_bytes": current_rss_bytes(),
            "total_bytes": physical_memory_bytes(),
        }

    def reset_peak_memory(self) -> bool:
        """Reset peak RSS to current RSS; False where the kernel does not allow it (peak stays process-wide)."""
        return reset_peak_rss()
