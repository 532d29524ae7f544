"""``python -m benchmarks rollout``: (a) colocated inference latency with/without core binding, (b) GRPO steps/s of
the async disaggregated pipeline and of ``rollout.placement: auto`` against upstream TRL's synchronous generate,
(c) ``rollout.lend_cores`` on vs off: steps/s, the generation requests' p50/p99 and oversubscription
(:mod:`benchmarks.lend`; ``--part c``, not in the default ``both``).

(b) runs one GRPO job, the ``train`` section of ``--job`` (a bundled config or YAML, default ``compare_small``;
``small`` preset unless ``--model``), in separate processes (``mrl compare``'s runner), same seed, steps, learning
rate and total core budget (all cores of this machine): upstream TRL with 1 thread, with every core (torch's
default) -- its best is the baseline --, the plugins with ``configs/disaggregated.yaml`` (trainer on one core, one
rollout worker on the other; with a KL term in the job the worker also scores the reference, ``ref_logps:
engine``, as ``compare_kl`` does), and the job config's stages with ``rollout.placement: auto``
(``auto_vs_upstream``). Each setting runs ``--grpo-reps`` times, the settings interleaved within a repetition;
medians and spread are reported, for the whole run (worker start-up included) and for its second half
(``steady_steps_per_s``).

Bounds, over the best upstream: ``balance_bound_vs_upstream``, the best any one-core-each arrangement can do with
the same work, two processes each doing half of the 1-thread run with no overhead (2x its steps/s);
``overlap_bound_vs_upstream``, the best the async pipeline's split can do, ``1 / max(generate, train)`` per step of
the 1-thread upstream run, or the balance bound where that is tighter (the time split leaves out the rest of a
step) -- with a KL term the pipeline moves the reference pass from the trainer to the worker, which that split
does not show, so there it is the balance bound. ``share_of_overlap_bound``: how much of it the
async pipeline reaches. ``*_tokens_per_step_vs_upstream``: completion tokens per step against the baseline's (the
pipeline's batches come from a policy one step older, so its completions, and the work of a step, differ).
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


def has_kl(job: dict[str, Any]) -> bool:
    """A job's ``train`` section has a KL term (GRPO's ``beta`` > 0: TRL runs a reference forward pass)."""
    return float((job.get("trl_args") or {}).get("beta", 0.0) or 0.0) > 0


def grpo_settings(
    *, steps: int, model: str, job: str = "compare_small", frozen: bool = False
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Part (b)'s settings: ``name -> (RunKind, config)``, every config with the same job.

    The job is ``job``'s ``train`` section (model, steps, learning rate, TRL arguments): the settings differ only in
    their stages, placement and threads (the bundled configs' own train sections differ: ``upstream`` and
    ``disaggregated`` keep the default learning rate, 3x compare_small's). ``frozen``: every setting trains with
    learning rate 0, so the same policy generates the same work per step in each (the async pipeline's one-step-old
    batches otherwise take the policy elsewhere: measured here, 0.61x vanilla's completion tokens per step)."""
    from mrl_plugins.cli.compare import RunKind, kind_config
    from mrl_plugins.config import load_yaml

    cores = len(os.sched_getaffinity(0))
    job_config = load_yaml(job)
    train = dict(job_config.get("train") or {})
    if frozen:
        train["learning_rate"] = 0.0
    disaggregated = load_yaml("disaggregated")
    if has_kl(train):  # the worker scores the reference too (compare_kl), else the trainer keeps that pass
        disaggregated["rollout"] = {**(disaggregated.get("rollout") or {}), "ref_logps": "engine"}
    auto = {**job_config, "rollout": {**(job_config.get("rollout") or {}), "placement": "auto"}}
    settings = {  # name: (config, kind, train overrides)
        "upstream_1_thread": (load_yaml("upstream"), RunKind(UPSTREAM), {"threads": 1}),
        f"upstream_{cores}_threads_default": (load_yaml("upstream"), RunKind(UPSTREAM, all_cores=True), {}),
        "disaggregated_async": (disaggregated, RunKind(ALL), {}),
        "auto": (auto, RunKind(ALL), {}),
    }
    out: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name, (config, kind, over) in settings.items():
        data = kind_config({**config, "train": train}, kind, steps=steps, model=model)
        data["train"] = {**data["train"], **over}
        out[name] = (kind, data)
    return out


def run_grpo_part(
    *, steps: int, model: str, reps: int, out: Path, job: str = "compare_small", frozen: bool = False
) -> dict[str, Any]:
    """The GRPO settings, each a separate process (``mrl compare``'s runner), repetitions interleaved."""
    from .job import run_job

    settings = grpo_settings(steps=steps, model=model, job=job, frozen=frozen)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in settings}
    loads: dict[str, list[Any]] = {name: [] for name in settings}
    for rep in range(reps):
        for name, (kind, data) in settings.items():
            result, load = run_job(data, out, f"{name}-{rep}", kind, steps)
            runs[name].append(result)
            loads[name].append(load)
    results: dict[str, Any] = {}
    for name, rs in runs.items():
        results[name] = {
            "steps_per_s": _median([r["steps_per_s"] for r in rs]),
            "steady_steps_per_s": _median([_steady(r["step_times"]) for r in rs]),
            "final_reward": _median([r["final_reward"] for r in rs]),
            "tokens_per_s": _median([r["tokens_per_s"] for r in rs]),
            "host_load": loads[name],  # before and during each run (mrl compare's sampler)
            "time_split": rs[0]["time_split"],
            "threads": rs[0]["threads"],
        }
        print(
            f"  {name:<32} {results[name]['steps_per_s']['median']:.3f} steps/s "
            f"(min {results[name]['steps_per_s']['min']:.3f}, max {results[name]['steps_per_s']['max']:.3f}), "
            f"second half {results[name]['steady_steps_per_s']['median']:.3f} steps/s, "
            f"final reward {results[name]['final_reward']['median']:.3f}, "
            f"{results[name]['tokens_per_s']['median']:.0f} tokens/s",
            flush=True,
        )
    upstream_names = [n for n in settings if n.startswith("upstream")]
    best = max(upstream_names, key=lambda n: results[n]["steps_per_s"]["median"])
    base = results[best]["steps_per_s"]["median"]
    ours = results["disaggregated_async"]
    # Upper bounds of one core each: two processes sharing the 1-thread run's work evenly (any arrangement), and
    # the pipeline's split: per step, the longer of upstream's 1-thread generation and 1-thread training (no extra
    # forward pass: rollout.old_logps: engine), from the 1-thread run's time split -- with a KL term the reference
    # pass moves to the worker, which that split does not show: then the even one.
    balance = 2 * results["upstream_1_thread"]["steps_per_s"]["median"] / base
    one = results["upstream_1_thread"]["time_split"]
    overlap = balance  # the time split leaves out the step's other work: the even bound may be the tighter one
    if not has_kl(settings["auto"][1]["train"]):
        overlap = min(overlap, (steps / max(one["generate"], one["train"])) / base)
    tokens_per_step = {n: r["tokens_per_s"]["median"] / r["steps_per_s"]["median"] for n, r in results.items()}
    ratios = {
        "steps_per_s_vs_upstream": ours["steps_per_s"]["median"] / base,
        "steady_steps_per_s_vs_upstream": ours["steady_steps_per_s"]["median"]
        / results[best]["steady_steps_per_s"]["median"],
        "overlap_bound_vs_upstream": overlap,
        "balance_bound_vs_upstream": balance,
        "auto_vs_upstream": results["auto"]["steps_per_s"]["median"] / base,
        "async_tokens_per_step_vs_upstream": tokens_per_step["disaggregated_async"] / tokens_per_step[best],
        "auto_tokens_per_step_vs_upstream": tokens_per_step["auto"] / tokens_per_step[best],
        "final_reward_vs_upstream": (
            ours["final_reward"]["median"] / results[best]["final_reward"]["median"]
            if results[best]["final_reward"]["median"]
            else float("nan")
        ),
    }
    ratios["share_of_overlap_bound"] = ratios["steps_per_s_vs_upstream"] / ratios["overlap_bound_vs_upstream"]
    return {
        "settings": results, "upstream_best": best, "job": job, "steps": steps, "model": model, "frozen": frozen,
        "ratios": ratios,
    }  # fmt: skip


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks rollout", description=__doc__.split("\n\n")[0].replace("``", "")
    )
    p.add_argument("--json", help="write the results here")
    p.add_argument("--reps", type=int, default=5, help="latency repetitions for part (a)")
    p.add_argument("--grpo-reps", type=int, default=2, help="GRPO runs per setting for part (b)")
    p.add_argument("--steps", type=int, default=30, help="GRPO steps per run for part (b)")
    p.add_argument("--model", default="small", help="preset for part (b)")
    p.add_argument("--job", default="compare_small", help="part (b): bundled config or YAML whose train section runs")
    p.add_argument(
        "--frozen",
        action="store_true",
        help="part (b): learning rate 0 in every setting (the same work per step: share_of_overlap_bound then "
        "measures the pipeline, not where the one-step-old batches take the policy)",
    )
    p.add_argument("--quick", action="store_true", help="short smoke run (tiny model, few steps, 1 rep)")
    p.add_argument("--part", choices=["a", "b", "c", "both", "all"], default="both", help="both: a and b; all: a-c")
    p.add_argument("--lend-config", default="compare_kl", help="bundled config or YAML for part (c)")
    p.add_argument("--lend-reps", type=int, default=3, help="runs per setting (lend on, off) for part (c)")
    p.add_argument(
        "--lend-placement-start",
        default="split",
        choices=["split", "turns", ""],
        help="part (c): rollout.placement_start for both settings (lending happens in the split; '': the config's)",
    )
    ns = p.parse_args(argv)
    from benchmarks.rollout_latency import run_bench as run_latency

    if ns.quick:
        ns.reps, ns.grpo_reps, ns.steps, ns.model, ns.lend_reps = 1, 1, 4, "tiny", 1
    if ns.part in ("b", "both", "all"):  # a --job that cannot be read: its error now, before anything runs
        grpo_settings(steps=ns.steps, model=ns.model, job=ns.job, frozen=ns.frozen)
    result: dict[str, Any] = {"ratios": {}}
    if ns.part in ("a", "both", "all"):
        print("(a) colocated inference latency while training runs next to it", flush=True)
        lat = run_latency(reps=ns.reps, json_path=None, quick=ns.quick)
        result["colocate"] = lat.get("colocate", lat)
        result["ratios"].update(lat.get("ratios", {}))
    if ns.part in ("b", "both", "all"):
        print(
            f"(b) GRPO on '{ns.model}' ({ns.job}{', learning rate 0' if ns.frozen else ''}), {ns.steps} steps: "
            "disaggregated async vs upstream TRL",
            flush=True,
        )
        with tempfile.TemporaryDirectory(prefix="mrl-bench-") as tmp:
            grpo = run_grpo_part(
                steps=ns.steps, model=ns.model, reps=ns.grpo_reps, out=Path(tmp), job=ns.job, frozen=ns.frozen
            )
        result["grpo"] = grpo
        result["ratios"].update(grpo["ratios"])
    if ns.part in ("c", "all"):
        from benchmarks.lend import run_lend_part

        steps = 150 if ns.quick else ns.steps  # tiny: ~10 s, the worker is ready after ~5 s
        print(f"(c) GRPO on '{ns.model}' ({ns.lend_config}), {steps} steps: rollout.lend_cores on vs off", flush=True)
        with tempfile.TemporaryDirectory(prefix="mrl-bench-") as tmp:
            lend = run_lend_part(
                config=ns.lend_config, steps=steps, model=ns.model, reps=ns.lend_reps, out=Path(tmp),
                placement_start=ns.lend_placement_start,
            )  # fmt: skip
        result["lend"] = lend
        result["ratios"].update(lend["ratios"])
    print(json.dumps({"ratios": result["ratios"]}, indent=1))
    if ns.json:
        Path(ns.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    return 0
