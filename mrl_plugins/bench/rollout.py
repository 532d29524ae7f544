"""``mrl bench rollout``: (a) colocated inference latency with/without core binding, (b) GRPO steps/s of
the async disaggregated pipeline against upstream TRL's synchronous generate.

(b) runs the embedded GRPO job (``small`` preset unless ``--model``) in separate processes, same seed,
steps and total core budget (all cores of this machine): upstream TRL with 1 thread, with every core
(torch's default) -- its best is the baseline -- and the plugins with ``configs/disaggregated.yaml``
(trainer on one core, one rollout worker on the other). Each setting is repeated ``--grpo-reps``
times; medians and spread are reported, for the whole run (worker start-up included) and for its second
half (``steady_steps_per_s``). ``overlap_bound_vs_upstream``: the best a one-core-trainer / one-core-worker
overlap can do, ``1 / max(generate, train)`` per step of the 1-thread upstream run, over the best upstream.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

UPSTREAM = {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}
ALL = {"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"}


def _median(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def _steady(step_times: list[float]) -> float:
    """Steps/s of the second half of a run (start-up, warm-up and the first weight versions excluded)."""
    tail = step_times[len(step_times) // 2 :] or step_times
    return 1.0 / statistics.median(tail) if tail else float("nan")


def run_grpo_part(*, steps: int, model: str, reps: int, out: Path) -> dict[str, Any]:
    from mrl_plugins.cli.compare import run_one
    from mrl_plugins.config import resolve_config_path

    cores = len(os.sched_getaffinity(0))
    settings = {
        "upstream_1_thread": ("upstream", UPSTREAM, 1),
        f"upstream_{cores}_threads_default": ("upstream", UPSTREAM, cores),
        "disaggregated_async": ("disaggregated", ALL, None),
    }
    results: dict[str, Any] = {}
    for name, (config, plugins, threads) in settings.items():
        runs = [
            run_one(
                str(resolve_config_path(config)),
                f"{name}-{i}",
                plugins,
                out,
                steps=steps,
                model=model,
                threads=threads,
                timeout=1800,
            )
            for i in range(reps)
        ]
        results[name] = {
            "steps_per_s": _median([r["steps_per_s"] for r in runs]),
            "steady_steps_per_s": _median([_steady(r["step_times"]) for r in runs]),
            "final_reward": _median([r["final_reward"] for r in runs]),
            "time_split": runs[0]["time_split"],
            "threads": runs[0]["threads"],
        }
        print(
            f"  {name:<32} {results[name]['steps_per_s']['median']:.3f} steps/s "
            f"(min {results[name]['steps_per_s']['min']:.3f}, max {results[name]['steps_per_s']['max']:.3f}), "
            f"second half {results[name]['steady_steps_per_s']['median']:.3f} steps/s, "
            f"final reward {results[name]['final_reward']['median']:.3f}",
            flush=True,
        )
    upstream_names = [n for n in settings if n.startswith("upstream")]
    best = max(upstream_names, key=lambda n: results[n]["steps_per_s"]["median"])
    ours = results["disaggregated_async"]
    # Upper bound of a one-core-each overlap: per step, the longer of upstream's 1-thread generation and
    # 1-thread training (no extra forward pass: rollout.old_logps: engine), from the 1-thread run's time split.
    one = results["upstream_1_thread"]["time_split"]
    bound_step_s = max(one["generate"], one["train"]) / steps
    return {
        "settings": results,
        "upstream_best": best,
        "steps": steps,
        "model": model,
        "ratios": {
            "steps_per_s_vs_upstream": ours["steps_per_s"]["median"] / results[best]["steps_per_s"]["median"],
            "steady_steps_per_s_vs_upstream": ours["steady_steps_per_s"]["median"]
            / results[best]["steady_steps_per_s"]["median"],
            "overlap_bound_vs_upstream": (1 / bound_step_s) / results[best]["steps_per_s"]["median"],
            "final_reward_vs_upstream": (
                ours["final_reward"]["median"] / results[best]["final_reward"]["median"]
                if results[best]["final_reward"]["median"]
                else float("nan")
            ),
        },
    }


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mrl bench rollout", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--json", help="write the results here")
    p.add_argument("--reps", type=int, default=5, help="latency repetitions for part (a)")
    p.add_argument("--grpo-reps", type=int, default=2, help="GRPO runs per setting for part (b)")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run for part (b)")
    p.add_argument("--model", default="small", help="preset for part (b)")
    p.add_argument("--quick", action="store_true", help="short smoke run (tiny model, few steps, 1 rep)")
    p.add_argument("--part", choices=["a", "b", "both"], default="both")
    ns = p.parse_args(argv)
    from mrl_plugins.bench.rollout_latency import run_bench as run_latency

    if ns.quick:
        ns.reps, ns.grpo_reps, ns.steps, ns.model = 1, 1, 4, "tiny"
    result: dict[str, Any] = {"ratios": {}}
    if ns.part in ("a", "both"):
        print("(a) colocated inference latency while training runs next to it", flush=True)
        lat = run_latency(reps=ns.reps, json_path=None, quick=ns.quick)
        result["colocate"] = lat.get("colocate", lat)
        result["ratios"].update(lat.get("ratios", {}))
    if ns.part in ("b", "both"):
        print(f"(b) GRPO on '{ns.model}', {ns.steps} steps: disaggregated async vs upstream TRL", flush=True)
        with tempfile.TemporaryDirectory(prefix="mrl-bench-") as tmp:
            grpo = run_grpo_part(steps=ns.steps, model=ns.model, reps=ns.grpo_reps, out=Path(tmp))
        result["grpo"] = grpo
        result["ratios"].update(grpo["ratios"])
    print(json.dumps({"ratios": result["ratios"]}, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0
