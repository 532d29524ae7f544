"""Where the rollout workers run: the one placement rule, used by the TRL adapter and by ``mrl doctor``.

* :func:`colocated_count` -- how many workers share the trainer's device in each deployment mode.
* :func:`accelerator_indices` -- NPU/CUDA: the device index of every worker of a training rank (and, last, the
  trainer's own), relative to the parent's visible-devices list.
* :func:`cpu_split` -- CPU: the trainer's cores and the cores its workers split.
* :func:`worker_placements` -- the full placement of every worker (CPU cores and threads, or device and
  visible-devices entry), the cores left to the trainer, and the placement of a worker that shares the
  trainer's device.
"""

from __future__ import annotations

import os
from typing import Any

from mrl_plugins.errors import ConfigError

from .budget import allowed_cores, split_cores
from .select import visible_devices_env


def colocated_count(mode: str, workers: int, colocated_workers: int) -> int:
    """Workers on the trainer's device: all in ``colocate``, none in ``disaggregated``, the configured number
    (``rollout.colocated_workers``) in ``hybrid``."""
    return workers if mode == "colocate" else (0 if mode == "disaggregated" else colocated_workers)


def accelerator_indices(
    mode: str, workers: int, colocated_workers: int, base: int, rank: int = 0, world: int = 1
) -> list[int]:
    """Device index of each of ``workers`` workers of training rank ``rank`` (of ``world``), then the trainer's.

    The first ``world`` devices train (accelerate's local rank -> device; the trainer's own is ``base``);
    colocated workers share the trainer's, rank ``r``'s dedicated workers take the devices after every
    training rank's: ``max(world, base + 1) + r * dedicated + j``."""
    colocated = colocated_count(mode, workers, colocated_workers)
    first_free = max(world, base + 1) + rank * (workers - colocated)
    return [base if i < colocated or i == workers else first_free + (i - colocated) for i in range(workers + 1)]


def cpu_split(rc: Any, cores: list[int]) -> tuple[list[int] | None, list[int]]:
    """CPU: the trainer's cores (None: all of ``cores``) and the cores its workers split: ``rollout.engine_cores``
    when set, else all but the trainer's (``rollout.trainer_cores``, else the first); on one core they share it."""
    trainer_cores, engine_pool = rc.trainer_cores, rc.engine_cores
    if engine_pool is None:
        if len(cores) > 1:
            trainer_cores = trainer_cores or cores[:1]
            engine_pool = [c for c in cores if c not in trainer_cores] or cores
        else:
            engine_pool = cores
    return trainer_cores, engine_pool


def worker_placements(
    cfg: Any, device: Any, rank: int = 0, world: int = 1
) -> tuple[list[dict], list[int] | None, dict]:
    """Where each rollout worker of training rank ``rank`` (of ``world``) runs, the cores left to the trainer
    (CPU), and the placement of a worker that shares the trainer's device (hybrid mode's colocated pool; on
    CPU: the trainer's cores).

    Every rank has a pool of its own. CPU: the process's cores are split into ``world`` groups, one per rank,
    each split between its trainer and its workers as for one rank. NPU/CUDA: the first ``world`` devices
    train (accelerate's local rank -> device), rank ``r``'s dedicated workers take the devices after them:
    ``world + r * dedicated + j``."""
    rc = cfg.rollout
    n = rc.workers
    colocated = colocated_count(cfg.mode, n, rc.colocated_workers)
    if device.type == "cpu":
        cores = sorted(os.sched_getaffinity(0))
        if world > 1 and rc.engine_cores is None and rc.trainer_cores is None:
            cores = split_cores(world, cores)[rank] if len(cores) >= world else cores
        if rc.engine_cores is not None or rc.trainer_cores is not None:
            valid = set(allowed_cores())
            for key in ("engine_cores", "trainer_cores"):
                bad = [c for c in (getattr(rc, key) or []) if c not in valid]
                if bad:
                    raise ConfigError(f"rollout.{key}: cores {bad} are not available; valid: {sorted(valid)}")
        trainer_cores, engine_pool = cpu_split(rc, cores)
        shared = {"cores": trainer_cores or cores, "threads": rc.engine_threads, "device": "cpu"}
        # hybrid: the first `colocated` workers share the trainer's cores; the others split the engine pool
        shared_n = colocated if cfg.mode == "hybrid" else 0
        own = n - shared_n
        groups = split_cores(min(own, len(engine_pool)), engine_pool) if own else []
        places = [dict(shared) for _ in range(shared_n)]
        places += [
            {"cores": groups[i % len(groups)], "threads": rc.engine_threads, "device": "cpu"} for i in range(own)
        ]
        return places, trainer_cores, shared
    env_name = visible_devices_env(device.type)
    visible = [v.strip() for v in os.environ.get(env_name or "", "").split(",") if v.strip()] if env_name else []
    places = []
    indices = accelerator_indices(cfg.mode, n, rc.colocated_workers, device.index or 0, rank, world)
    for i, index in enumerate(indices):  # the last one: the trainer's own device (hybrid's colocated placement)
        if visible and index >= len(visible):
            raise ConfigError(
                f"rollout.workers: worker {i} needs device {index} but {env_name}={','.join(visible)} "
                f"lists only {len(visible)}; lower rollout.workers or use mode: colocate/hybrid"
            )
        physical = visible[index] if visible else str(index)  # indices are relative to the parent's list
        places.append(
            {
                "env": {env_name: physical} if env_name else {},
                "device": f"{device.type}:0",
                "threads": rc.engine_threads,
            }
        )
    return places[:n], None, places[n]
