"""Benchmark part (a) of ``python -m benchmarks rollout``: colocated engine latency while a training loop runs next
to it.

Three processes: this one sends inference requests and times them; an :class:`~benchmarks.engine_server.
EngineServer` answers them (``engine_model`` preset, ``prompts`` prompts x ``new_tokens`` tokens, no EOS so every
request decodes exactly ``new_tokens`` tokens); a trainer process runs forward + backward + AdamW steps on the
``small`` preset (batch ``train_batch`` x ``train_seq`` tokens) without pause. Cases, each with fresh processes:

* ``unbound``: both processes keep torch's default thread count (= the machine's cores) and no affinity;
* ``bound``: engine 1 thread pinned to the last core, trainer 1 thread pinned to core 0 (``split_cores(2)``);
* ``threads_only`` (not with ``quick``): 1 thread each, no pinning -- separates the thread budget from pinning.

Per case: ``reps`` windows of ``requests`` requests each (``gap_ms`` apart; a window stops early after
``window_s`` seconds once it has 3 requests, and a case stops starting windows after 25 s -- ``reps_done`` says
how many ran -- so the slow unbound case stays short); per window p50/p99 request latency
(round trip through the pipe, as a trainer-side caller sees it) and the trainer's steps/s during the window.
Reported: medians over windows with [min, max] spread, plus the trainer's steps/s alone (engine idle) before the
windows. ``ratios.p99_bound_vs_unbound`` = median bound p99 / median unbound p99 (target <= 0.5).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

__all__ = ["cli", "run_bench"]

_MIN_REQUESTS = 3


def _apply_budget(cores: list[int] | None, threads: int | None) -> dict[str, Any]:
    import torch

    if cores is not None or threads is not None:
        from mrl_plugins.device import ComputeBudget, CpuDevice, apply_compute_budget

        apply_compute_budget(ComputeBudget(cores=cores, threads=threads), CpuDevice())
    return {"affinity": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads()}


def _trainer_main(
    cores: list[int] | None, threads: int | None, batch: int, seq: int, steps: Any, ready: Any, stop: Any, conn: Any
) -> None:
    """Trainer process: AdamW steps on the ``small`` preset until ``stop`` is set; ``steps`` counts them."""
    try:
        binding = _apply_budget(cores, threads)
        import torch

        from mrl_plugins.demo.models import build_model

        model, tok = build_model("small", seed=0)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, len(tok), (batch, seq), generator=gen)

        def step() -> None:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):
            step()
        conn.send(binding)
        ready.set()
        while not stop.is_set():
            step()
            with steps.get_lock():
                steps.value += 1
    except BaseException as exc:
        with contextlib.suppress(Exception):
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
        raise


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _run_case(
    name: str,
    engine_cores: list[int] | None,
    engine_threads: int | None,
    trainer_cores: list[int] | None,
    trainer_threads: int | None,
    *,
    reps: int,
    requests: int,
    gap_ms: float,
    engine_model: str,
    prompts: list[list[int]],
    new_tokens: int,
    train_batch: int,
    train_seq: int,
    alone_s: float,
    window_s: float,
    case_budget_s: float,
    timeout: float,
) -> dict[str, Any]:
    from benchmarks.engine_server import EngineServer
    from mrl_plugins.rollout.engine import SamplingParams

    ctx = mp.get_context("spawn")
    # an EOS id outside the vocabulary: every request decodes exactly new_tokens tokens
    params = SamplingParams(max_new_tokens=new_tokens, eos_token_ids=[1_000_000], pad_token_id=0)
    server = EngineServer(engine_model, params=params, cores=engine_cores, threads=engine_threads, seed=0)
    steps = ctx.Value("q", 0)
    ready, stop = ctx.Event(), ctx.Event()
    parent_conn, child_conn = ctx.Pipe(duplex=False)
    trainer = ctx.Process(
        target=_trainer_main,
        args=(trainer_cores, trainer_threads, train_batch, train_seq, steps, ready, stop, child_conn),
        daemon=True,
        name=f"mrl-bench-trainer-{name}",
    )
    trainer.start()
    child_conn.close()
    try:
        if not parent_conn.poll(timeout):
            raise TimeoutError(f"bench trainer ({name}) did not start within {timeout:g} s")
        trainer_binding = parent_conn.recv()
        if "error" in trainer_binding:
            raise RuntimeError(f"bench trainer ({name}) failed: {trainer_binding['error']}")
        if not ready.wait(timeout):
            raise TimeoutError(f"bench trainer ({name}) not ready within {timeout:g} s")

        def rate_over(seconds: float) -> float:
            # at least `seconds` and at least 2 steps (a loaded machine may be slower), at most 5x `seconds`
            s0, t0 = steps.value, time.perf_counter()
            time.sleep(seconds)
            while steps.value - s0 < 2 and time.perf_counter() - t0 < 5 * seconds:
                time.sleep(0.05)
            return (steps.value - s0) / (time.perf_counter() - t0)

        alone = rate_over(alone_s)
        for _ in range(3):  # warm the engine (allocator, caches)
            server.request(prompts, 1, timeout=timeout)
        p50s, p99s, rates, pooled = [], [], [], []
        case_start = time.perf_counter()
        for _ in range(reps):
            if p50s and time.perf_counter() - case_start > case_budget_s:
                break  # a very slow case (loaded machine) keeps the windows done so far; see reps_done
            lat = []
            s0, t0 = steps.value, time.perf_counter()
            for i in range(requests):
                if i >= _MIN_REQUESTS and time.perf_counter() - t0 > window_s:
                    break  # slow case: cap the window's time, keep at least _MIN_REQUESTS samples
                start = time.perf_counter()
                server.request(prompts, 1, timeout=timeout)
                lat.append((time.perf_counter() - start) * 1000.0)
                time.sleep(gap_ms / 1000.0)
            rates.append((steps.value - s0) / (time.perf_counter() - t0))
            p50s.append(_percentile(lat, 0.5))
            p99s.append(_percentile(lat, 0.99))
            pooled.extend(lat)
        engine_binding = server.binding(timeout=timeout)
    finally:
        stop.set()
        trainer.join(timeout=30)
        if trainer.is_alive():
            trainer.kill()
            trainer.join(timeout=5)
        server.close(timeout=10)
        parent_conn.close()
    p50, p99, rate = _summary(p50s), _summary(p99s), _summary(rates)
    return {
        "p50_ms": p50["median"],
        "p99_ms": p99["median"],
        "train_steps_per_s": rate["median"],
        "train_alone_steps_per_s": alone,
        "spread": {
            "p50_ms": [p50["min"], p50["max"]],
            "p99_ms": [p99["min"], p99["max"]],
            "train_steps_per_s": [rate["min"], rate["max"]],
        },  # fmt: skip
        "pooled_p99_ms": _percentile(pooled, 0.99),
        "requests": len(pooled),
        "reps_done": len(p50s),
        "engine_binding": {k: engine_binding[k] for k in ("affinity", "threads")},
        "trainer_binding": trainer_binding,
    }


def run_bench(
    reps: int = 5,
    json_path: str | None = None,
    quick: bool = False,
    *,
    requests: int | None = None,
    gap_ms: float = 5.0,
    window_s: float | None = None,
    engine_model: str = "tiny",
    num_prompts: int = 2,
    new_tokens: int = 16,
    train_batch: int = 8,
    train_seq: int = 64,
    timeout: float = 120.0,
) -> dict[str, Any]:
    """Measure colocated engine latency with and without core binding; see the module docstring.

    :return: ``{"colocate": {"unbound": {...}, "bound": {...}[, "threads_only": {...}]}, "ratios": {...}, ...}``;
        also written to ``json_path`` when given.
    """
    from mrl_plugins.device import allowed_cores, split_cores
    from mrl_plugins.errors import ConfigError

    if reps < 1:
        raise ConfigError(f"reps: must be >= 1, got {reps}")
    cores = sorted(set(allowed_cores()) & os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ConfigError(f"bench rollout colocate needs 2 cores to bind engine and trainer apart; have {cores}")
    trainer_part, engine_part = split_cores(2, cores)
    n_requests = requests if requests is not None else (12 if quick else 30)
    prompts = [[3 + (i * 5 + j) % 16 for j in range(6)] for i in range(num_prompts)]
    common = dict(
        reps=reps, requests=n_requests, gap_ms=gap_ms, engine_model=engine_model, prompts=prompts,
        new_tokens=new_tokens, train_batch=train_batch, train_seq=train_seq, alone_s=1.0 if quick else 1.5,
        window_s=window_s if window_s is not None else (1.5 if quick else 2.0),
        case_budget_s=12.0 if quick else 25.0, timeout=timeout,
    )  # fmt: skip
    start = time.perf_counter()
    cases: dict[str, dict[str, Any]] = {}
    cases["unbound"] = _run_case("unbound", None, None, None, None, **common)
    cases["bound"] = _run_case("bound", [engine_part[-1]], 1, [trainer_part[0]], 1, **common)
    if not quick:
        cases["threads_only"] = _run_case("threads_only", None, 1, None, 1, **common)
    result: dict[str, Any] = {
        "bench": "rollout.colocate",
        "settings": {
            "reps": reps,
            "max_requests_per_rep": n_requests,
            "window_s": common["window_s"],
            "gap_ms": gap_ms,
            "engine_model": engine_model,
            "prompts": num_prompts,
            "new_tokens": new_tokens,
            "trainer_model": "small",
            "train_batch": train_batch,
            "train_seq": train_seq,
            "cores": cores,
            "quick": quick,
            "torch_default_threads_unbound": cases["unbound"]["engine_binding"]["threads"],
        },
        "colocate": cases,
        "ratios": {
            "p99_bound_vs_unbound": cases["bound"]["p99_ms"] / cases["unbound"]["p99_ms"],
            "p50_bound_vs_unbound": cases["bound"]["p50_ms"] / cases["unbound"]["p50_ms"],
            "train_steps_bound_vs_unbound": cases["bound"]["train_steps_per_s"]
            / max(cases["unbound"]["train_steps_per_s"], 1e-9),
        },
        "targets": {"p99_bound_vs_unbound": "<= 0.5"},
        "seconds": time.perf_counter() - start,
    }
    if json_path:
        with open(json_path, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
    return result


def _print_table(result: dict[str, Any], out: Any) -> None:
    print(f"{'case':<14}{'p50 ms':>10}{'p99 ms':>10}{'p99 spread':>20}{'train st/s':>12}{'alone st/s':>12}", file=out)
    for name, row in result["colocate"].items():
        lo, hi = row["spread"]["p99_ms"]
        print(
            f"{name:<14}{row['p50_ms']:>10.2f}{row['p99_ms']:>10.2f}{f'[{lo:.1f}, {hi:.1f}]':>20}"
            f"{row['train_steps_per_s']:>12.2f}{row['train_alone_steps_per_s']:>12.2f}",
            file=out,
        )
    for key, value in result["ratios"].items():
        print(f"ratios.{key} = {value:.3f}", file=out)
    print(f"({result['seconds']:.0f} s)", file=out)


def cli(argv: list[str] | None = None) -> int:
    """``python -m benchmarks rollout`` part (a): ``[--json PATH] [--reps N] [--quick]``; prints a table, returns 0."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks rollout", description=__doc__.splitlines()[0])
    parser.add_argument("--json", dest="json_path", default=None, help="write the results as JSON to this path")
    parser.add_argument("--reps", type=int, default=5, help="measurement windows per case (medians over them)")
    parser.add_argument("--quick", action="store_true", help="fewer requests, skip the threads_only case")
    args = parser.parse_args(argv)
    result = run_bench(reps=args.reps, json_path=args.json_path, quick=args.quick)
    _print_table(result, sys.stdout)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(cli())
