"""Summarize one GPU check (``benchmarks/gpu/run.sh``): ``summary.json`` and ``summary.md`` in its output folder.

Reads what the parts left in ``<out>/work``: ``parts.jsonl`` (each part's exit code and seconds), ``env.json``,
``cuda_tests.xml`` (pytest's JUnit XML), ``compare/report.json`` (or, when the compare was cut off by the
budget, the finished runs' ``compare/runs/*.json``) and the runs' logs (the workers' version switches). Per run
kind: steps/s (median, min, max) and its ratio to vanilla TRL (``upstream``) from the same invocation, the time
from ``train()``'s start until the logged reward first reached ``--level``, the final reward, the GPU memory of
the trainer (torch's peak reserved) and of its rollout worker (its first generation's peak), the GPU's
utilization and busy share and memory in use (nvidia-smi), and the weight sync per version: what the trainer
was blocked publishing, and what the worker took to fetch and switch.

Exit status: 0 when every part exited 0, no CUDA test failed and the compare gave upstream and at least one other
kind; 1 otherwise (the summary says which).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout: mrl_plugins from the checkout
    sys.path.insert(0, str(ROOT))

SWITCH = re.compile(r"switch model_id=policy (-?\d+) -> (\d+) bytes=(\d+) seconds=([0-9.]+)")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def parts(work: Path) -> dict[str, dict]:
    out = {}
    try:
        lines = (work / "parts.jsonl").read_text(encoding="utf-8").splitlines()
    except OSError:
        return out
    for line in lines:
        if line.strip():
            rec = json.loads(line)
            out[rec["part"]] = {"rc": rec["rc"], "seconds": rec["seconds"]}
    return out


def tests(work: Path) -> dict[str, Any] | None:
    """Each CUDA test's outcome (passed / failed / skipped, with the first line of its message)."""
    path = work / "cuda_tests.xml"
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = (node.get("message") or node.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        cases.append(
            {"test": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0), "message": message}
        )
    counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "skipped")}
    return {"counts": counts, "cases": cases}


def runs(work: Path) -> tuple[dict[str, list[dict]], dict[str, Any] | None]:
    """The compare's results per run kind, and its report (None when it did not finish)."""
    report = _read_json(work / "compare" / "report.json")
    if report is not None:
        return report.get("repeats", {}), report
    reps: dict[str, list[dict]] = {}
    for path in sorted((work / "compare" / "runs").glob("*.json")):
        result = _read_json(path)
        if result is not None:
            reps.setdefault(result.get("name", path.stem.rsplit("-", 1)[0]), []).append(result)
    return reps, None


def time_to(result: dict, level: float) -> float | None:
    """Seconds from ``train()``'s start until the logged reward first reached ``level`` (None: never)."""
    start = (result.get("timeline") or {}).get("train", [0.0])[0]
    for reward, t in zip(result.get("rewards", []), (result.get("timeline") or {}).get("reward_t", [])):
        if reward >= level:
            return round(t - start, 2)
    return None


def worker_switches(work: Path, name: str) -> list[float]:
    """The worker's fetch + switch seconds per version, from the runs' logs of kind ``name``."""
    out = []
    for log in sorted((work / "compare" / "runs").glob(f"{name.replace('+', '_')}-*.log")):
        for m in SWITCH.finditer(log.read_text(encoding="utf-8", errors="replace")):
            if int(m.group(1)) >= 0:  # the first version's fetch includes the worker's start
                out.append(float(m.group(4)))
    return out


def _stats(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def steady_steps_per_s(result: dict, skip: int = 2) -> float | None:
    """1 / the median optimizer step after the first ``skip`` (the device's first-use costs, the workers' start)."""
    steps = [b - a for a, b in (result.get("timeline") or {}).get("steps", [])][skip:]
    return 1.0 / statistics.median(steps) if steps else None


def gpu_loads(work: Path, report: dict | None) -> dict[str, list[dict]]:
    """nvidia-smi's view of each run, per kind: from the report, else from the samples the runs left."""
    from mrl_plugins.cli.hostload import gpu_summary

    loads: dict[str, list[dict]] = {}
    if report is not None:
        for load in report.get("load", []):
            if load.get("gpu"):
                loads.setdefault(load["kind"], []).append(load["gpu"])
        return loads
    for folder in sorted((work / "compare" / "runs").glob("*.gpu")):
        summary = gpu_summary(folder)
        if summary["samples"]:
            loads.setdefault(folder.stem.rsplit("-", 1)[0], []).append(summary)
    return loads


def kinds(work: Path, reps: dict[str, list[dict]], report: dict | None, level: float) -> dict[str, dict]:
    loads = gpu_loads(work, report)
    out = {}
    for name, results in reps.items():
        if not results:
            continue
        steps = [r["steps"] for r in results]
        publish = [
            1e3 * r["time_split"].get("weight_sync", 0.0) / max(1, r["steps"])
            for r in results
            if r.get("time_split", {}).get("weight_sync")
        ]
        prefix = "mrl/rollout/budget_memory_peak_bytes/"
        worker_peak = [sum(v for k, v in r.get("mrl_metrics", {}).items() if k.startswith(prefix)) for r in results]
        gpu = loads.get(name, [])
        out[name] = {
            "repeats": len(results),
            "steps": steps,
            "steps_per_s": _stats([r["steps_per_s"] for r in results]),
            "per_repeat_steps_per_s": [round(r["steps_per_s"], 4) for r in results],
            "steady_steps_per_s": _stats([steady_steps_per_s(r) for r in results]),
            "final_reward": _stats([r["final_reward"] for r in results]),
            "rewards": [[round(x, 3) for x in r.get("rewards", [])] for r in results],
            f"time_to_reward_{level}_s": [time_to(r, level) for r in results],
            "trainer_gpu_peak_mb": _stats([r.get("gpu_peak_bytes", 0) / 2**20 for r in results]),
            "worker_gpu_peak_mb": _stats([w / 2**20 for w in worker_peak]) if any(worker_peak) else None,
            "weight_publish_ms_per_version": _stats(publish),
            "worker_switch_ms_per_version": _stats([1e3 * s for s in worker_switches(work, name)]),
            "time_split_s": results[0].get("time_split"),
            "gpu_util_mean_pct": _stats([g.get("util_mean") for g in gpu]),
            "gpu_busy_share": _stats([g.get("busy_share") for g in gpu]),
            "gpu_memory_used_max_mb": _stats([g.get("memory_used_max_mb") for g in gpu]),
            "gpu_process_max_mb": [g.get("process_max_mb") for g in gpu],
        }
    for key, suffix in (("steps_per_s", ""), ("steady_steps_per_s", "_steady")):
        base = (out.get("upstream") or {}).get(key)
        for k in out.values():
            s = k[key]
            if base and s and base["median"]:
                k[f"x_upstream{suffix}"] = round(s["median"] / base["median"], 3)
                k[f"x_upstream{suffix}_range"] = [round(s["min"] / base["max"], 3), round(s["max"] / base["min"], 3)]
    return out


def markdown(summary: dict) -> str:
    env = summary.get("env") or {}
    lines = [
        f"# GPU check ({summary['mode']}, {summary['date']})",
        "",
        f"Machine: {env.get('gpu', 'no GPU')}, {env.get('gpu_memory_gib', '-')} GiB, CUDA {env.get('cuda', '-')}; "
        f"torch {env.get('torch')}, transformers {env.get('transformers')}, TRL {env.get('trl')}, "
        f"Python {env.get('python')}.",
        "",
        "Parts: " + ", ".join(f"{k} exit {v['rc']} ({v['seconds']} s)" for k, v in summary["parts"].items()),
        "",
    ]
    t = summary.get("tests")
    if t:
        lines += [f"## CUDA tests: {t['counts']}", ""]
        lines += [f"- {c['outcome']}: {c['test']} ({c['seconds']:.1f} s) {c['message']}".rstrip() for c in t["cases"]]
        lines.append("")
    if summary.get("kinds"):
        level = summary["reward_level"]
        lines += [
            "## Compare (one invocation, interleaved repeats)",
            "",
            "| run | n | steps/s median [min..max] | x upstream [range] | steady steps/s (after 2 steps) |"
            f" x upstream | time to reward {level} (s) | final reward | trainer GPU peak MB | worker GPU peak MB |"
            " publish ms/version | worker switch ms/version | GPU util % | GPU busy share | GPU memory used max MB |",
            "|" + "---|" * 15,
        ]

        def fmt(st: dict | None, f: str = ".3f", rng: bool = True) -> str:
            if not st:
                return "-"
            return format(st["median"], f) + (f" [{format(st['min'], f)}..{format(st['max'], f)}]" if rng else "")

        for name, k in summary["kinds"].items():

            def ratio(suffix: str, k: dict = k) -> str:
                x, xr = k.get(f"x_upstream{suffix}"), k.get(f"x_upstream{suffix}_range")
                return "-" if x is None else f"{x:.2f} [{xr[0]:.2f}..{xr[1]:.2f}]"

            lines.append(
                f"| {name} | {k['repeats']} | {fmt(k['steps_per_s'])} | {ratio('')} | "
                f"{fmt(k['steady_steps_per_s'])} | {ratio('_steady')} | "
                f"{k[f'time_to_reward_{level}_s']} | {fmt(k['final_reward'])} | "
                f"{fmt(k['trainer_gpu_peak_mb'], '.0f', False)} | {fmt(k['worker_gpu_peak_mb'], '.0f', False)} | "
                f"{fmt(k['weight_publish_ms_per_version'], '.0f', False)} | "
                f"{fmt(k['worker_switch_ms_per_version'], '.0f', False)} | "
                f"{fmt(k['gpu_util_mean_pct'], '.0f', False)} | "
                f"{fmt(k['gpu_busy_share'], '.2f', False)} | {fmt(k['gpu_memory_used_max_mb'], '.0f', False)} |"
            )
        lines.append("")
    if summary["problems"]:
        lines += ["## Problems", "", *[f"- {p}" for p in summary["problems"]], ""]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the GPU check's output folder ($OUT)")
    p.add_argument("--mode", default="gpu", choices=["gpu", "cpu"])
    p.add_argument("--level", type=float, default=0.5, help="reward level for the time-to-reward column")
    ns = p.parse_args(argv)
    out = Path(ns.out)
    work = out / "work"
    reps, report = runs(work)
    env = _read_json(work / "env.json")
    summary: dict[str, Any] = {
        "mode": ns.mode,
        "date": (env or {}).get("date") or __import__("datetime").date.today().isoformat(),
        "env": env,
        "parts": parts(work),
        "tests": tests(work),
        "reward_level": ns.level,
        "compare_finished": report is not None,
        "compare_failed": (report or {}).get("failed", {}),
        "kinds": kinds(work, reps, report, ns.level),
        "problems": [],
    }
    problems = summary["problems"]
    problems += [f"part {k} exited {v['rc']}" for k, v in summary["parts"].items() if v["rc"] != 0]
    if summary["tests"] and summary["tests"]["counts"]["failed"]:
        problems += [f"CUDA test failed: {c['test']}: {c['message']}" for c in summary["tests"]["cases"]
                     if c["outcome"] == "failed"]  # fmt: skip
    problems += [f"compare run {k} failed: {v}" for k, v in summary["compare_failed"].items()]
    if "compare" in summary["parts"] and ("upstream" not in summary["kinds"] or len(summary["kinds"]) < 2):
        problems.append(f"compare: results for {sorted(summary['kinds'])} only (needs upstream and another kind)")
    (out / "summary.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    md = markdown(summary)
    (out / "summary.md").write_text(md, encoding="utf-8")
    print(md)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
