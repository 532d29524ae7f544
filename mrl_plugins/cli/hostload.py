"""How busy the host is while ``mrl compare`` measures: load average and the CPU share of *other* processes.

The other processes' share is the host's busy CPU time (``/proc/stat``) minus the CPU time of this process and
its process tree (the run being measured, its rollout workers, vLLM's engine processes), over the host's capacity
(wall time x CPUs): 0.0 = nobody else ran, 0.5 = others kept half of the CPUs busy.
"""

from __future__ import annotations

import os
import time
from typing import Any


def _host_jiffies() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole host since boot."""
    with open("/proc/stat", encoding="ascii") as fh:
        fields = [float(x) for x in fh.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
    return (total - idle) / tick, total / tick


class HostSampler:
    """Samples the host around one process tree (this process and its descendants)."""

    def __init__(self) -> None:
        self._seen: dict[int, float] = {}  # pid -> its last CPU seconds (a process that exits keeps its share)
        self._last: tuple[float, float, float] = (0.0, 0.0, 0.0)  # set by mark()
        self.samples: list[dict[str, float]] = []

    def _ours(self) -> float:
        import psutil

        me = psutil.Process()
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system + t.children_user + t.children_system
                self._seen[p.pid] = max(self._seen.get(p.pid, 0.0), cpu)
            except psutil.Error:
                continue
        return sum(self._seen.values())

    def mark(self) -> None:
        """Start a window (no sample)."""
        self._last = (*_host_jiffies(), self._ours())

    def sample(self) -> dict[str, float] | None:
        """One sample over the window since the last :meth:`mark` / sample; None if the window is empty."""
        busy, total, ours = *_host_jiffies(), self._ours()
        b0, t0, o0 = self._last
        if total - t0 <= 0:
            return None
        self._last = (busy, total, ours)
        others = max(0.0, (busy - b0) - (ours - o0)) / (total - t0)
        s = {"t": time.monotonic(), "load1": os.getloadavg()[0], "others_cpu_share": min(1.0, others)}
        self.samples.append(s)
        return s


def measure_before(seconds: float = 1.0) -> dict[str, float]:
    """The host just before a run: load average and other processes' CPU share over ``seconds``."""
    sampler = HostSampler()
    sampler.mark()
    time.sleep(seconds)
    s = sampler.sample() or {"others_cpu_share": 0.0}
    return {"load1": os.getloadavg()[0], "others_cpu_share": s["others_cpu_share"]}


def summarize_during(samples: list[dict[str, float]]) -> dict[str, Any]:
    loads = [s["load1"] for s in samples] or [os.getloadavg()[0]]
    shares = [s["others_cpu_share"] for s in samples] or [0.0]
    return {
        "load1_mean": sum(loads) / len(loads),
        "load1_max": max(loads),
        "others_cpu_share_mean": sum(shares) / len(shares),
        "others_cpu_share_max": max(shares),
        "samples": len(samples),
    }


class GpuSampler:
    """NVIDIA GPUs during one run, from ``nvidia-smi`` in loop mode (a background process, every 500 ms): the GPUs'
    utilization (the share of each sample period in which a kernel ran) and memory in use, and each compute
    process's memory. ``None`` from :meth:`start` where there is no ``nvidia-smi``."""

    PERIOD_MS = 500

    def __init__(self, folder: Any) -> None:
        from pathlib import Path

        self.folder = Path(folder)
        self._procs: list[Any] = []

    @classmethod
    def start(cls, folder: Any) -> GpuSampler | None:
        import shutil
        import subprocess

        if shutil.which("nvidia-smi") is None:
            return None
        self = cls(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        queries = {
            "gpu": ["--query-gpu=index,utilization.gpu,memory.used"],
            "apps": ["--query-compute-apps=pid,used_memory"],
        }
        for name, query in queries.items():
            with open(self.folder / f"{name}.csv", "w", encoding="ascii") as out:
                self._procs.append(
                    subprocess.Popen(
                        ["nvidia-smi", *query, "--format=csv,noheader,nounits", f"-lms={cls.PERIOD_MS}"],
                        stdout=out,
                        stderr=subprocess.DEVNULL,
                    )
                )
        return self

    def stop(self, root_pid: int | None = None) -> dict[str, Any]:
        """Stop sampling; the run's summary: ``util_mean`` / ``util_max`` (%, GPU 0 over the run), ``busy_share``
        (samples in which a kernel ran), ``memory_used_max_mb`` (GPU 0, every process), ``process_max_mb`` (pid -> its
        highest memory; in a sandbox whose pids differ from the host's they are the host's), ``root_max_mb`` (the run's
        own process, when its pid was seen)."""
        for p in self._procs:
            p.terminate()
        for p in self._procs:
            try:
                p.wait(timeout=5)
            except Exception:  # noqa: BLE001 - a hung nvidia-smi is killed, never waited for
                p.kill()
        return gpu_summary(self.folder, root_pid)


def gpu_summary(folder: Any, root_pid: int | None = None) -> dict[str, Any]:
    """What a :class:`GpuSampler` left in ``folder`` (see :meth:`GpuSampler.stop`)."""
    from pathlib import Path

    def lines(name: str) -> list[str]:
        try:
            return [ln for ln in (Path(folder) / f"{name}.csv").read_text(encoding="ascii").splitlines() if ln.strip()]
        except (OSError, UnicodeDecodeError):
            return []

    utils, mems = [], []
    for line in lines("gpu"):
        fields = [x.strip() for x in line.split(",")]
        if len(fields) >= 3 and fields[0] == "0" and fields[1].replace(".", "").isdigit():
            utils.append(float(fields[1]))
            mems.append(float(fields[2]))
    per_pid: dict[int, float] = {}
    for line in lines("apps"):
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].replace(".", "").isdigit():
            per_pid[int(parts[0])] = max(per_pid.get(int(parts[0]), 0.0), float(parts[1]))
    return {
        "samples": len(utils),
        "period_ms": GpuSampler.PERIOD_MS,
        "util_mean": sum(utils) / len(utils) if utils else None,
        "util_max": max(utils) if utils else None,
        "busy_share": sum(u > 0 for u in utils) / len(utils) if utils else None,
        "memory_used_max_mb": max(mems) if mems else None,
        "process_max_mb": {str(k): v for k, v in sorted(per_pid.items())},
        "root_max_mb": per_pid.get(root_pid) if root_pid is not None else None,
    }
