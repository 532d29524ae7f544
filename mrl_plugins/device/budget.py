"""Compute budgets: give one side of a colocated job (e.g. the rollout engine) its own execution resources.

* CPU (any device type, host side): core affinity (``os.sched_setaffinity``) and ``torch.set_num_threads``.
* NPU: cube/vector core limits through torch_npu's ``set_device_limit(device, cube_num, vector_num)`` (whole
  process) or ``set_stream_limit(stream, cube_num, vector_num)`` (one stream), present from Ascend Extension for
  PyTorch 7.2.0 (torch_npu 2.6.0.post3 / 2.7.1). Feature-detected with ``hasattr``; absent -> one
  :class:`CoreLimitWarning`, nothing else changes. torch_npu accepts ``set_device_limit`` once per process.
  Unverified on hardware here (tested against a fake torch_npu).
* CUDA: a high-priority stream (``stream_priority="high"``). Unverified on hardware here.

:func:`apply_compute_budget` checks everything before changing anything and undoes what it applied if a later
step fails; the returned :class:`AppliedBudget` says what was applied and can :meth:`~AppliedBudget.restore` it.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.config_fields import check_fields, section_from_dict
from mrl_plugins.device.base import STREAM_PRIORITIES, CoreLimitWarning, Device, DeviceStream, warn_once
from mrl_plugins.device.probe import CORE_LIMIT_RELEASES
from mrl_plugins.errors import ConfigError, DeviceError


def _parse_cpu_list(text: str) -> set[int]:
    """Parse a kernel CPU list such as ``0-3,8,10-11``."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def allowed_cores() -> list[int]:
    """Cores this process may be pinned to: the cgroup's effective cpuset if readable, else ``0..cpu_count-1``."""
    count = os.cpu_count() or 1
    every = set(range(count))
    for path in ("/sys/fs/cgroup/cpuset.cpus.effective", "/sys/fs/cgroup/cpuset/cpuset.effective_cpus"):
        try:
            with open(path, encoding="ascii") as fh:
                parsed = _parse_cpu_list(fh.read())
        except (OSError, ValueError):
            continue
        if parsed:
            return sorted(parsed & every or parsed)
    return sorted(every)


def split_cores(n_parts: int, cores: list[int] | None = None) -> list[list[int]]:
    """Split ``cores`` (default: this process's affinity) into ``n_parts`` contiguous groups, sizes differing by
    at most one (larger groups first). ``split_cores(2, [0, 1]) == [[0], [1]]``. ConfigError if more parts than
    cores."""
    pool = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    if isinstance(n_parts, bool) or not isinstance(n_parts, int) or n_parts < 1:
        raise ConfigError(f"n_parts must be a positive integer, got {n_parts!r}")
    if len(set(pool)) != len(pool):
        raise ConfigError(f"cores {pool} contain duplicates")
    if n_parts > len(pool):
        raise ConfigError(f"cannot split {len(pool)} cores {pool} into {n_parts} parts (at most {len(pool)})")
    size, extra = divmod(len(pool), n_parts)
    out: list[list[int]] = []
    start = 0
    for part in range(n_parts):
        end = start + size + (1 if part < extra else 0)
        out.append(pool[start:end])
        start = end
    return out


@dataclass
class ComputeBudget:
    """Execution resources for one side of a job. ``None`` leaves a resource as it is."""

    cores: list[int] | None = field(
        default=None, metadata={"help": "CPU core ids this side runs on (os.sched_setaffinity); null: unchanged"}
    )
    threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (torch.set_num_threads); null: unchanged", "ge": 1}
    )
    npu_cube_cores: int | None = field(
        default=None,
        metadata={"help": "NPU cube (AI) cores for this side (torch_npu set_*_limit); null: unlimited", "ge": 1},
    )
    npu_vector_cores: int | None = field(
        default=None,
        metadata={"help": "NPU vector cores for this side (torch_npu set_*_limit); null: unlimited", "ge": 1},
    )
    stream_priority: str = field(
        default="normal",
        metadata={
            "help": "priority of this side's stream (hardware priority on CUDA only)",
            "choices": STREAM_PRIORITIES,
        },
    )

    def validate(self, path: str = "budget") -> None:
        """ConfigError naming the key under ``path`` and the allowed values for anything malformed
        (machine-independent)."""
        check_fields(self, path)
        cores = self.cores
        if cores is not None and (not cores or min(cores) < 0 or len(set(cores)) < len(cores)):
            raise ConfigError(f"{path}.cores: {cores!r} invalid; a non-empty list of distinct core ids >= 0 or null")

    @classmethod
    def from_dict(cls, d: dict[str, Any], path: str = "budget") -> ComputeBudget:
        """Build and validate from a mapping (:func:`mrl_plugins.config_fields.section_from_dict`, the one parser);
        errors name the keys under ``path`` (``rollout.engine_budget.stream_priority``)."""
        d = {k: (list(v) if k == "cores" and isinstance(v, tuple) else v) for k, v in dict(d).items()}
        budget = section_from_dict(cls, d, path, validate=False)
        budget.validate(path)
        return budget


@dataclass
class AppliedBudget:
    """What :func:`apply_compute_budget` changed. :meth:`restore` undoes it (idempotent).

    ``stream`` is the stream created for this side (``None`` when none was created or given); ``notes`` lists
    what was requested but not applied, and why.
    """

    device: str
    cores: list[int] | None = None
    threads: int | None = None
    stream: DeviceStream | None = None
    priority_honoured: bool = False
    npu_device_limit: tuple[int, int] | None = None
    npu_stream_limit: tuple[int, int] | None = None
    notes: list[str] = field(default_factory=list)
    _previous_affinity: dict[int, set[int]] = field(default_factory=dict, repr=False)
    _previous_threads: int | None = field(default=None, repr=False)
    _npu_stream_raw: Any = field(default=None, repr=False)
    _restored: bool = field(default=False, repr=False)

    def restore(self) -> None:
        """Put back the previous affinity and thread count and reset a stream core limit we set.

        A device-wide NPU core limit cannot be undone from Python (torch_npu has no reset for it); that is
        added to ``notes``.
        """
        if self._restored:
            return
        self._restored = True
        if self._previous_affinity:
            # every thread now, threads started since then get the main thread's old affinity
            main = self._previous_affinity.get(os.getpid())
            for tid in _thread_ids():
                prev = self._previous_affinity.get(tid, main)
                if prev:
                    try:
                        os.sched_setaffinity(tid, prev)
                    except (ProcessLookupError, PermissionError):
                        pass  # thread exited meanwhile
        if self._previous_threads is not None:
            import torch

            torch.set_num_threads(self._previous_threads)
        if self._npu_stream_raw is not None:
            from mrl_plugins.device.npu import npu_namespace

            npu = npu_namespace()
            if hasattr(npu, "reset_stream_limit"):
                npu.reset_stream_limit(self._npu_stream_raw)
            self._npu_stream_raw = None
        if self.npu_device_limit is not None:
            self.notes.append("the device-wide NPU core limit stays in force (torch_npu cannot reset it)")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict for reports and logs."""
        return {
            "device": self.device,
            "cores": self.cores,
            "threads": self.threads,
            "stream_priority": None if self.stream is None else self.stream.priority,
            "priority_honoured": self.priority_honoured,
            "npu_device_limit": self.npu_device_limit,
            "npu_stream_limit": self.npu_stream_limit,
            "notes": list(self.notes),
        }


def _thread_ids() -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir("/proc/self/task"))
    except OSError:
        return [threading.get_native_id()]


def _set_affinity(applied: AppliedBudget, cores: list[int]) -> None:
    for tid in _thread_ids():
        try:
            prev = os.sched_getaffinity(tid)
        except (ProcessLookupError, PermissionError):
            continue
        applied._previous_affinity[tid] = prev
        try:
            os.sched_setaffinity(tid, cores)
        except (ProcessLookupError, PermissionError):
            applied._previous_affinity.pop(tid, None)
        except OSError as exc:
            raise DeviceError(
                f"os.sched_setaffinity({cores}) failed: {exc}; allowed cores: {allowed_cores()}"
            ) from exc
    applied.cores = list(cores)


def npu_limit_args(cube: int | None, vector: int | None) -> tuple[int, int]:
    """``(cube, vector)`` core counts as torch_npu takes them: -1 means 'do not limit'."""
    return (-1 if cube is None else int(cube)), (-1 if vector is None else int(vector))


def _apply_npu_limits(
    applied: AppliedBudget, budget: ComputeBudget, device: Device, stream: DeviceStream | None
) -> None:
    from mrl_plugins.device.npu import npu_namespace

    npu = npu_namespace()
    cube, vector = npu_limit_args(budget.npu_cube_cores, budget.npu_vector_cores)
    scope = "device" if stream is None else "stream"
    if not hasattr(npu, f"set_{scope}_limit"):
        why = f"torch_npu has no set_{scope}_limit (needs {CORE_LIMIT_RELEASES})"
        warn_once(f"{why}: NPU {scope} core budget not applied", CoreLimitWarning)
        applied.notes.append(f"set_{scope}_limit absent in this torch_npu: {scope} core limit not applied")
        return
    if stream is not None:
        npu.set_stream_limit(stream.raw, cube, vector)
        applied.npu_stream_limit = (cube, vector)
        applied._npu_stream_raw = stream.raw
        return
    index = 0 if device.index is None else device.index
    if getattr(npu.set_device_limit, "called", False):
        # torch_npu wraps set_device_limit so that a second call raises; accept an identical repeat.
        current = npu.get_device_limit(index) if hasattr(npu, "get_device_limit") else {}
        want = {"cube_core_num": budget.npu_cube_cores, "vector_core_num": budget.npu_vector_cores}
        if all(v is None or current.get(k) == v for k, v in want.items()):
            applied.notes.append(f"NPU device limit already {current}; not set again")
            return
        raise DeviceError(
            f"torch_npu allows set_device_limit once per process and it was already called "
            f"(npu:{index} limit now {current}); cannot set cube={cube}, vector={vector}. "
            "Give this side its own stream (budget.stream_priority high or low) to use set_stream_limit instead"
        )
    # CANN's aclrtSetDeviceResLimit must follow aclrtSetDevice: make the device current first.
    npu.set_device(index)
    npu.set_device_limit(index, cube, vector)
    applied.npu_device_limit = (cube, vector)
    applied.notes.append(f"npu:{index} made the current device (set_device_limit requires it)")


def apply_compute_budget(budget: ComputeBudget, device: Device) -> AppliedBudget:
    """Apply ``budget`` for ``device`` in this process and return what was applied.

    * ``cores`` -> ``os.sched_setaffinity`` of every thread of the process (threads started later inherit it).
      ConfigError naming the allowed cores if one is not on this machine.
    * ``threads`` -> ``torch.set_num_threads`` (process-wide in torch). ConfigError if it exceeds the cores
      given (oversubscribed, a 2-thread forward ran 15x slower: doctor_checks.check_threads).
    * ``stream_priority`` other than ``normal`` -> a new stream of that priority on ``device`` (returned in
      ``AppliedBudget.stream``).
    * NPU cube/vector cores -> ``set_stream_limit`` on that stream, else ``set_device_limit``.
      On other devices they are skipped with one :class:`CoreLimitWarning`.
    """
    budget.validate()
    # --- checks, before anything changes --------------------------------------------------------------------
    if budget.cores is not None:
        allowed = allowed_cores()
        bad = [c for c in budget.cores if c not in allowed]
        if bad:
            raise ConfigError(f"budget.cores {bad} not on this machine; valid cores: {allowed}")
    if budget.threads is not None:
        n_cores = len(budget.cores) if budget.cores is not None else len(os.sched_getaffinity(0))
        if budget.threads > n_cores:
            raise ConfigError(
                f"budget.threads={budget.threads} exceeds the {n_cores} cores it may run on; use at most {n_cores}"
            )
    wants_npu_limit = budget.npu_cube_cores is not None or budget.npu_vector_cores is not None

    applied = AppliedBudget(device=device.spec)
    try:
        if budget.cores is not None:
            _set_affinity(applied, list(budget.cores))
        if budget.threads is not None:
            import torch

            applied._previous_threads = torch.get_num_threads()
            torch.set_num_threads(budget.threads)
            applied.threads = budget.threads
        if budget.stream_priority != "normal":
            stream = applied.stream = device.new_stream(budget.stream_priority)
            applied.priority_honoured = stream.priority_honoured
            if not stream.priority_honoured and stream.priority != "normal":
                applied.notes.append(
                    f"stream priority {stream.priority!r} is not a hardware priority on {device.type}"
                )
        if wants_npu_limit:
            if device.type == "npu":
                _apply_npu_limits(applied, budget, device, applied.stream)
            else:
                warn_once(
                    f"NPU core limits requested but the device is {device.type}: skipped",
                    CoreLimitWarning,
                    stacklevel=4,
                )
                applied.notes.append(f"npu_cube_cores/npu_vector_cores skipped on {device.type}")
    except BaseException:
        applied.restore()
        raise
    return applied
