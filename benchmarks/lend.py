"""``python -m benchmarks rollout`` part (c): what lending the idle worker's cores to the trainer
(``rollout.lend_cores``) costs the generation requests and gains in steps/s.

The same bundled config (``compare_kl`` by default: balanced stages, the split is where lending happens) runs with
``rollout.lend_cores`` true and false, same seed and steps, each setting a separate process (``mrl compare``'s
runner), repetitions interleaved (the order alternates per repetition). Per setting:

* steps/s: median, min, max over the repetitions;
* the worker's per-request generation seconds (every request each worker answered, from the worker's own
  ``generate`` intervals -- the ``generate_s`` it reports per batch --, each worker's first request excluded:
  start-up), pooled over the repetitions: p50, p99, max and n;
* oversubscription: every ``SAMPLE_S`` the bench reads ``/proc/<pid>/task/*/stat`` of the trainer and its worker
  processes (its descendants but multiprocessing's resource tracker); a sample counts as oversubscribed when a
  trainer thread and a worker thread are both runnable (state R) with the same last CPU (field 39), i.e. both
  want that core at once (``oversubscribed_share``); plus each core's busy share over the run from ``/proc/stat``
  and the cores the two sides were allowed (``sched_getaffinity``) at the samples;
* the host load before and during each run (``mrl compare``'s sampler) and the lends the run counted.

Ratios: ``lend_p99_generate_on_vs_off`` (> 1: lending delays generation requests) and
``lend_steps_per_s_on_vs_off``.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

#: seconds between two looks at the trainer's and the workers' threads
SAMPLE_S = 0.05
SETTINGS = {"lend_on": True, "lend_off": False}


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"median": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def _core_jiffies() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) jiffies from /proc/stat (busy = total - idle - iowait)."""
    out: dict[int, tuple[int, int]] = {}
    with open("/proc/stat", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("cpu") and line[3].isdigit():
                name, *vals = line.split()
                nums = [int(v) for v in vals]
                total = sum(nums[:8])  # user nice system idle iowait irq softirq steal
                out[int(name[3:])] = (total - nums[3] - nums[4], total)
    return out


def _runnable_cores(pid: int) -> set[int]:
    """Last CPU of each runnable (state R) thread of ``pid``."""
    cores: set[int] = set()
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return cores
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields and fields[0] == "R" and len(fields) > 36:
            cores.add(int(fields[36]))
    return cores


class CoreWatch:
    """Samples the trainer (the bench's child running ``mrl_plugins.run``) and its descendants (the workers) in a
    background thread while one run lasts."""

    def __init__(self) -> None:
        self.samples = 0
        self.oversubscribed = 0
        self.trainer_cores: set[int] = set()
        self.worker_cores: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="mrl-bench-corewatch", daemon=True)
        self._first: dict[int, tuple[int, int]] = {}
        self.busy_share: dict[str, float] = {}

    def __enter__(self) -> CoreWatch:
        self._first = _core_jiffies()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        last = _core_jiffies()
        for core, (busy, total) in sorted(last.items()):
            b0, t0 = self._first.get(core, (0, 0))
            self.busy_share[str(core)] = (busy - b0) / (total - t0) if total > t0 else 0.0

    def _loop(self) -> None:
        import psutil

        me = psutil.Process()
        while not self._stop.wait(SAMPLE_S):
            try:
                runs = [p for p in me.children() if "mrl_plugins.run" in " ".join(p.cmdline())]
                if not runs:
                    continue
                trainer = runs[0]
                workers = [
                    w for w in trainer.children(recursive=True) if "resource_tracker" not in " ".join(w.cmdline())
                ]
                self.trainer_cores |= set(os.sched_getaffinity(trainer.pid))
                for w in workers:
                    self.worker_cores |= set(os.sched_getaffinity(w.pid))
            except (psutil.Error, OSError):
                continue
            mine = _runnable_cores(trainer.pid)
            theirs: set[int] = set()
            for w in workers:
                theirs |= _runnable_cores(w.pid)
            self.samples += 1
            self.oversubscribed += bool(mine & theirs)

    def as_dict(self) -> dict[str, Any]:
        return {
            "samples": self.samples,
            "oversubscribed_samples": self.oversubscribed,
            "oversubscribed_share": self.oversubscribed / self.samples if self.samples else float("nan"),
            "core_busy_share": self.busy_share,
            "trainer_cores_allowed": sorted(self.trainer_cores),
            "worker_cores_allowed": sorted(self.worker_cores),
        }


def request_seconds(result: dict[str, Any]) -> list[float]:
    """Every generation interval the run's workers reported (``timeline.worker``), each worker's first one left
    out (start-up: memory measurement, first kernels)."""
    seen: set[int] = set()
    out = []
    for worker, kind, t0, t1 in (result.get("timeline") or {}).get("worker") or []:
        if kind != "generate":
            continue
        if worker not in seen:
            seen.add(worker)
            continue
        out.append(float(t1) - float(t0))
    return out


def run_lend_part(*, config: str, steps: int, model: str, reps: int, out: Path, placement_start: str) -> dict:
    """The lend on/off pair (module doc)."""
    from mrl_plugins.cli.compare import RunKind, kind_config
    from mrl_plugins.config import load_yaml

    from .job import run_job

    kind = RunKind({"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"})  # every stage of the plugins
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETTINGS}
    for rep in range(reps):
        order = list(SETTINGS) if rep % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            data = kind_config(load_yaml(config), kind, steps=steps, model=model)
            rollout = dict(data.get("rollout") or {})
            rollout["lend_cores"] = SETTINGS[name]
            if placement_start:
                rollout["placement_start"] = placement_start
            data["rollout"] = rollout
            with CoreWatch() as watch:
                result, load = run_job(data, out, f"{name}-{rep}", kind, steps)
            mrl = result.get("mrl_metrics") or {}
            runs[name].append(
                {
                    "steps_per_s": result["steps_per_s"],
                    "requests_s": request_seconds(result),
                    "lends": mrl.get("mrl/rollout/lends", 0.0),
                    "lent_s": mrl.get("mrl/rollout/lent_s", 0.0),
                    "cores": watch.as_dict(),
                    "host_load": load,
                    "final_reward": result["final_reward"],
                }
            )
    settings: dict[str, Any] = {}
    for name, rs in runs.items():
        pooled = [s for r in rs for s in r["requests_s"]]
        settings[name] = {
            "steps_per_s": _stats([r["steps_per_s"] for r in rs]),
            "generate_s": {
                "p50": percentile(pooled, 50),
                "p99": percentile(pooled, 99),
                "max": max(pooled) if pooled else float("nan"),
                "n": len(pooled),
            },
            "oversubscribed_share": _stats([r["cores"]["oversubscribed_share"] for r in rs]),
            "lends": _stats([r["lends"] for r in rs]),
            "final_reward": _stats([r["final_reward"] for r in rs]),
            "runs": rs,
        }
        g, s = settings[name]["generate_s"], settings[name]["steps_per_s"]
        print(
            f"  {name:<9} {s['median']:.3f} steps/s (min {s['min']:.3f}, max {s['max']:.3f}); generation request "
            f"p50 {g['p50']:.3f} s, p99 {g['p99']:.3f} s (n={g['n']}); oversubscribed samples "
            f"{settings[name]['oversubscribed_share']['median']:.3f}; lends {settings[name]['lends']['median']:.0f}",
            flush=True,
        )
    on, off = settings["lend_on"], settings["lend_off"]
    ratios = {
        "lend_p99_generate_on_vs_off": on["generate_s"]["p99"] / off["generate_s"]["p99"]
        if off["generate_s"]["n"]
        else float("nan"),
        "lend_steps_per_s_on_vs_off": on["steps_per_s"]["median"] / off["steps_per_s"]["median"],
    }
    return {
        "settings": settings,
        "config": config,
        "steps": steps,
        "model": model,
        "placement_start": placement_start,
        "sample_s": SAMPLE_S,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ratios": ratios,
    }
