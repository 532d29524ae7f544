"""``mrl bench engine``: the ``transformers`` and ``vllm`` rollout engines on the same cores, in one invocation.

Each engine lives in its own process, both pinned to the same cores with the same thread count (``--cores``,
``--threads``), so start-up, peak RSS and CPU time are the engine's own. The parent runs the repetitions
interleaved (``transformers, vllm, vllm, transformers, ...``: the order alternates), and only one process
computes at a time; the other waits on its pipe. Per repetition: ``prompts`` prompts x ``generations``
completions of exactly ``new_tokens`` tokens (no stop token, so both engines decode the same token count),
wall seconds and CPU seconds of the process (every thread), then a weight version applied (``transformers``:
the parameter copy the in-process engine makes; ``vllm``: the layerwise reload) and ``idle_s`` seconds of idle
time whose CPU use is measured (a busy-polling engine would steal the trainer's core there).

Reported, with medians and [min, max] over repetitions: ``tokens_per_s``, ``cpu_s_per_1k_tokens``,
``apply_version_ms``, ``idle_cpu_share``; once per engine: ``startup_s`` and ``peak_rss_mb``; the host's
load average before and after. Ratio keys: ``vllm_vs_transformers_tokens_per_s`` (> 1: vLLM faster),
``vllm_vs_transformers_cpu_per_token`` (< 1: vLLM cheaper), ``vllm_switch_ms`` (median apply).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import statistics
import sys
import time
from typing import Any

__all__ = ["build_parser", "cli", "run_bench"]

ENGINES = ("transformers", "vllm")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mrl bench engine",
        description="mrl bench engine: transformers vs vLLM rollout engines on the same cores (interleaved).",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--model", default="small", help="preset or local checkpoint folder (default: small)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved repetitions per engine (default 5)")
    ap.add_argument("--prompts", type=int, default=16, help="prompts per request (default 16)")
    ap.add_argument("--generations", type=int, default=1, help="completions per prompt (default 1)")
    ap.add_argument("--new-tokens", type=int, default=48, help="tokens per completion (default 48)")
    ap.add_argument("--cores", default="last", help="cores for both engines: 'last' (default), 'all' or e.g. 0,1")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine (default 1)")
    ap.add_argument("--idle-s", type=float, default=2.0, help="idle seconds measured after each rep (default 2)")
    ap.add_argument("--quick", action="store_true", help="2 reps, 8 prompts x 16 tokens, 1 s idle (smoke run)")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit for each engine step (default 600)")
    return ap


def _cores(spec: str) -> list[int]:
    from mrl_plugins.errors import ConfigError

    have = sorted(os.sched_getaffinity(0))
    if spec == "last":
        return have[-1:]
    if spec == "all":
        return have
    try:
        cores = sorted({int(c) for c in spec.split(",") if c.strip()})
    except ValueError:
        raise ConfigError(f"--cores: {spec!r} is not 'last', 'all' or a comma-separated core list") from None
    missing = [c for c in cores if c not in have]
    if not cores or missing:
        raise ConfigError(f"--cores: {missing or spec!r} not among this process's cores {have}")
    return cores


def _engine_main(name: str, opts: dict, conn: Any) -> None:
    """Child process: build the engine, then answer ``gen`` / ``apply`` / ``idle`` / ``stop`` from the parent."""
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # third-party deprecation noise (vLLM, transformers) in the report
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        os.sched_setaffinity(0, opts["cores"])
        import torch

        torch.set_num_threads(opts["threads"])
        from mrl_plugins.models import build_model
        from mrl_plugins.rollout.engine import SamplingParams, TransformersEngine

        model, _tok = build_model(opts["model"], seed=0)
        params = SamplingParams(max_new_tokens=opts["new_tokens"], eos_token_ids=[], pad_token_id=0)
        t0 = time.perf_counter()
        if name == "vllm":
            from mrl_plugins.rollout.vllm_engine import VLLMEngine

            engine: Any = VLLMEngine(model, None, params=params, seed=0)
        else:
            engine = TransformersEngine(model, None, params=params, seed=0)
        startup_s = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(1)
        vocab = int(model.config.vocab_size)
        prompts = [torch.randint(3, vocab, (6,), generator=gen).tolist() for _ in range(opts["prompts"])]
        engine.generate(prompts[:1], 1)  # first call: kernels compiled / caches allocated, not timed
        conn.send(("ready", {"startup_s": startup_s}))
        version = 0
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                break
            if cmd == "gen":
                w0, c0 = time.perf_counter(), time.process_time()
                out = engine.generate(prompts, opts["generations"])
                conn.send(("gen", {"wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
                                   "tokens": out.num_tokens}))  # fmt: skip
            elif cmd == "apply":
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0 + 1e-3)
                t0 = time.perf_counter()
                if name == "vllm":
                    engine.apply_weights(version=version)
                else:
                    engine.update_weights(model.state_dict().items(), version)
                conn.send(("apply", {"ms": (time.perf_counter() - t0) * 1e3}))
            elif cmd == "idle":
                c0, w0 = time.process_time(), time.perf_counter()
                time.sleep(opts["idle_s"])
                conn.send(("idle", {"share": (time.process_time() - c0) / (time.perf_counter() - w0)}))
        rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        conn.send(("stopped", {"peak_rss_mb": rss_kb / 1024}))
        close = getattr(engine, "close", None)
        if callable(close):
            close()
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


class _Child:
    def __init__(self, name: str, opts: dict, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        self.name, self.timeout = name, timeout
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(name, opts, child), name=f"mrl-bench-{name}", daemon=True)
        self.proc.start()

    def ask(self, cmd: str | None, expect: str) -> dict:
        from mrl_plugins.errors import StageTimeoutError

        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(self.timeout):
            raise StageTimeoutError(f"bench engine {self.name}: no answer to {cmd or 'start'!r} in {self.timeout} s")
        kind, payload = self.conn.recv()
        if kind == "error":
            raise RuntimeError(f"bench engine {self.name}: {payload}")
        assert kind == expect, (kind, expect)
        return payload

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(10)


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def run_bench(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the results dict (see the module docstring)."""
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.models import PRESETS, build_model
    from mrl_plugins.rollout.vllm_engine import check_vllm_servable

    if args.quick:
        args.reps, args.prompts, args.new_tokens, args.idle_s = 2, 8, 16, 1.0
    if args.reps < 1 or args.prompts < 1 or args.new_tokens < 1 or args.threads < 1 or args.generations < 1:
        raise ConfigError("--reps, --prompts, --generations, --new-tokens and --threads must be >= 1")
    if args.model not in PRESETS and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ConfigError(f"--model: {args.model!r} is neither a preset ({list(PRESETS)}) nor a checkpoint folder")
    cores = _cores(args.cores)
    model, _ = build_model(args.model, seed=0)
    check_vllm_servable(model.config, "cpu")  # before any process starts
    del model
    opts = {"cores": cores, "threads": args.threads, "model": args.model, "new_tokens": args.new_tokens,
            "prompts": args.prompts, "generations": args.generations, "idle_s": args.idle_s}  # fmt: skip
    load_before = os.getloadavg()
    children: dict[str, _Child] = {}
    per: dict[str, dict[str, list[float]]] = {e: {"tps": [], "cpu1k": [], "apply": [], "idle": []} for e in ENGINES}
    once: dict[str, dict] = {}
    try:
        for name in ENGINES:  # one at a time: start-up measured without the other computing
            children[name] = _Child(name, opts, args.timeout_s)
            once[name] = children[name].ask(None, "ready")
        for rep in range(args.reps):
            order = ENGINES if rep % 2 == 0 else tuple(reversed(ENGINES))
            for name in order:
                c = children[name]
                g = c.ask("gen", "gen")
                per[name]["tps"].append(g["tokens"] / g["wall_s"])
                per[name]["cpu1k"].append(g["cpu_s"] / g["tokens"] * 1000)
                per[name]["apply"].append(c.ask("apply", "apply")["ms"])
                per[name]["idle"].append(c.ask("idle", "idle")["share"])
        for name, c in children.items():
            once[name].update(c.ask("stop", "stopped"))
    finally:
        for c in children.values():
            c.close()
    engines = {
        name: {
            "tokens_per_s": _stats(per[name]["tps"]),
            "cpu_s_per_1k_tokens": _stats(per[name]["cpu1k"]),
            "apply_version_ms": _stats(per[name]["apply"]),
            "idle_cpu_share": _stats(per[name]["idle"]),
            "startup_s": once[name]["startup_s"],
            "peak_rss_mb": once[name]["peak_rss_mb"],
        }
        for name in ENGINES
    }
    med = {name: {k: v["median"] for k, v in e.items() if isinstance(v, dict)} for name, e in engines.items()}
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"cores": cores},
        "host": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()},
        "engines": engines,
        "ratios": {
            "vllm_vs_transformers_tokens_per_s": med["vllm"]["tokens_per_s"] / med["transformers"]["tokens_per_s"],
            "vllm_vs_transformers_cpu_per_token": med["vllm"]["cpu_s_per_1k_tokens"]
            / med["transformers"]["cpu_s_per_1k_tokens"],
            "vllm_switch_ms": med["vllm"]["apply_version_ms"],
        },
    }


def _fmt(s: dict) -> str:
    return f"{s['median']:.3g} [{s['min']:.3g}..{s['max']:.3g}]"


def report(res: dict) -> str:
    st, host = res["settings"], res["host"]
    lines = [
        f"mrl bench engine: {st['model']}, {st['prompts']} prompts x {st['generations']} x {st['new_tokens']} tokens, "
        f"cores {st['cores']}, {st['threads']} thread(s), {st['reps']} interleaved reps; host load "
        f"{host['load_before'][0]:.2f} -> {host['load_after'][0]:.2f} on {host['cpus']} CPUs",
    ]
    for name, e in res["engines"].items():
        lines.append(
            f"  {name:<12} tokens/s {_fmt(e['tokens_per_s'])}  cpu-s/1k tok {_fmt(e['cpu_s_per_1k_tokens'])}  "
            f"apply ms {_fmt(e['apply_version_ms'])}  idle cpu {_fmt(e['idle_cpu_share'])}  "
            f"start {e['startup_s']:.1f} s  peak rss {e['peak_rss_mb']:.0f} MB"
        )
    r = res["ratios"]
    lines.append(
        f"  vllm_vs_transformers_tokens_per_s {r['vllm_vs_transformers_tokens_per_s']:.2f}  "
        f"vllm_vs_transformers_cpu_per_token {r['vllm_vs_transformers_cpu_per_token']:.2f}  "
        f"vllm_switch_ms {r['vllm_switch_ms']:.1f}"
    )
    return "\n".join(lines)


def cli(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    res = run_bench(args)
    print(report(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
