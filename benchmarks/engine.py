"""``python -m benchmarks engine``: the ``transformers`` and ``vllm`` rollout engines on the same cores, in one
invocation.

Each engine lives in its own process, both pinned to the same cores with the same thread count (``--cores``,
``--threads``), so start-up, peak RSS and CPU time are the engine's own. The parent runs the repetitions
interleaved (``transformers, vllm, vllm, transformers, ...``: the order alternates), and only one process
computes at a time; the other waits on its pipe. Per repetition: ``prompts`` prompts x ``generations``
completions of exactly ``new_tokens`` tokens (no stop token, so both engines decode the same token count),
wall seconds and CPU seconds of the process (every thread), then a weight version applied (``transformers``:
the parameter copy the in-process engine makes; ``vllm``: the layerwise reload) and ``idle_s`` seconds of idle
time whose CPU use is measured (a busy-polling engine would steal the trainer's core there).

Trainer next to an idle engine: a third process, a trainer-like loop (forward + backward + AdamW step of the same
model, ``--train-batch`` sequences of the prompt length plus ``new_tokens``, 1 torch thread) bound to a core that
is none of the engines' (``--trainer-core``; default the first such core: on 2 cores with ``--cores last``, core 0),
runs steps for the idle window right after an engine generated and applied a version, as a rollout worker sits
between requests. Each repetition also times it *alone*, with every engine process stopped (``SIGSTOP``, so none can
run), in the same interleaved order (``alone, transformers, vllm``, reversed on odd repetitions).

Reported, with medians and [min, max] over repetitions: ``tokens_per_s``, ``cpu_s_per_1k_tokens``,
``apply_version_ms``, ``idle_cpu_share``, ``trainer_steps_per_s_next_to_idle``; once per engine: ``startup_s`` and
``peak_rss_mb``; ``trainer``: its core, ``steps_per_s_alone`` and per engine the per-repetition ratios
``next_to_idle_vs_alone``; the host's load average before and after. Ratio keys:
``vllm_vs_transformers_tokens_per_s`` (> 1: vLLM faster), ``vllm_vs_transformers_cpu_per_token`` (< 1: vLLM
cheaper), ``vllm_switch_ms`` (median apply), ``trainer_next_to_idle_vllm_vs_alone`` and
``trainer_next_to_idle_transformers_vs_alone`` (medians' ratio; ~1.0: the idle engine takes nothing from the
trainer; ``None`` with ``--trainer-core none`` or when no core is left outside ``--cores``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import resource
import signal
import statistics
import sys
import time
from typing import Any

__all__ = ["build_parser", "cli", "run_bench"]

ENGINES = ("transformers", "vllm")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks engine",
        description="transformers vs vLLM rollout engines on the same cores (interleaved).",
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
    ap.add_argument(
        "--trainer-core", default="auto",
        help="core of the trainer-like loop: 'auto' (default: the first core outside --cores), 'none' or a core",
    )  # fmt: skip
    ap.add_argument("--train-batch", type=int, default=8, help="sequences per trainer step (default 8)")
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


def _trainer_core(spec: str, engine_cores: list[int]) -> int | None:
    """The trainer-like loop's core: none of the engines' (it measures what an idle engine takes from it)."""
    from mrl_plugins.errors import ConfigError

    if spec == "none":
        return None
    free = [c for c in sorted(os.sched_getaffinity(0)) if c not in engine_cores]
    if spec == "auto":
        return free[0] if free else None
    try:
        core = int(spec)
    except ValueError:
        raise ConfigError(f"--trainer-core: {spec!r} is not 'auto', 'none' or a core number") from None
    if core not in free:
        raise ConfigError(f"--trainer-core: {core} is not among the cores outside --cores {engine_cores}: {free}")
    return core


def _trainer_main(opts: dict, conn: Any) -> None:
    """Child process: a trainer-like loop on its own core; answers ``("train", seconds)`` with steps/s."""
    try:
        os.sched_setaffinity(0, [opts["trainer_core"]])
        import torch

        torch.set_num_threads(1)
        from mrl_plugins.demo.models import build_model

        model, _tok = build_model(opts["model"], seed=0)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        gen = torch.Generator().manual_seed(2)
        ids = torch.randint(3, int(model.config.vocab_size), (opts["train_batch"], 6 + opts["new_tokens"]),
                            generator=gen)  # fmt: skip

        def step() -> None:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(2):  # optimizer state allocated, first-call costs paid, not timed
            step()
        conn.send(("ready", {}))
        while True:
            cmd = conn.recv()
            if cmd == "stop":
                conn.send(("stopped", {}))
                break
            _, seconds = cmd
            n, t0 = 0, time.perf_counter()
            while n == 0 or time.perf_counter() - t0 < seconds:
                step()
                n += 1
            conn.send(("train", {"steps_per_s": n / (time.perf_counter() - t0)}))
    except BaseException as exc:  # noqa: BLE001 - report to the parent
        conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``; just ``pid`` elsewhere)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def _engine_main(name: str, opts: dict, conn: Any) -> None:
    """Child process: build the engine, then answer ``gen`` / ``apply`` / ``idle`` / ``stop`` from the parent."""
    import warnings

    warnings.simplefilter("ignore", FutureWarning)  # third-party deprecation noise (vLLM, transformers) in the report
    warnings.simplefilter("ignore", DeprecationWarning)
    try:
        os.sched_setaffinity(0, opts["cores"])
        import torch

        torch.set_num_threads(opts["threads"])
        from benchmarks.engine_server import copy_weights
        from mrl_plugins.demo.models import build_model
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
                                   "tokens": sum(map(len, out.completion_ids))}))  # fmt: skip
            elif cmd == "apply":
                version += 1
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(1.0 + 1e-3)
                t0 = time.perf_counter()
                if name == "vllm":
                    engine.apply_weights(version=version)
                else:  # the in-process engine: one copy into its model's parameters
                    copy_weights(engine.model, model.state_dict())
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
        target, args = (_trainer_main, (opts, child)) if name == "trainer" else (_engine_main, (name, opts, child))
        self.proc = ctx.Process(target=target, args=args, name=f"mrl-bench-{name}", daemon=True)
        self.proc.start()

    def send(self, cmd: Any) -> None:
        self.conn.send(cmd)

    def ask(self, cmd: Any, expect: str) -> dict:
        from mrl_plugins.errors import StageTimeoutError

        if cmd is not None:
            self.conn.send(cmd)
        if not self.conn.poll(self.timeout):
            raise StageTimeoutError(f"bench engine {self.name}: no answer to {cmd or expect!r} in {self.timeout} s")
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
    from mrl_plugins.demo.models import PRESETS, build_model
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.rollout.vllm_engine import check_vllm_servable

    if args.quick:
        args.reps, args.prompts, args.new_tokens, args.idle_s = 2, 8, 16, 1.0
    if args.reps < 1 or args.prompts < 1 or args.new_tokens < 1 or args.threads < 1 or args.generations < 1:
        raise ConfigError("--reps, --prompts, --generations, --new-tokens and --threads must be >= 1")
    if args.train_batch < 1:
        raise ConfigError("--train-batch must be >= 1")
    if args.model not in PRESETS and not os.path.isfile(os.path.join(args.model, "config.json")):
        raise ConfigError(f"--model: {args.model!r} is neither a preset ({list(PRESETS)}) nor a checkpoint folder")
    cores = _cores(args.cores)
    trainer_core = _trainer_core(str(args.trainer_core), cores)
    model, _ = build_model(args.model, seed=0)
    check_vllm_servable(model.config, "cpu")  # before any process starts
    del model
    opts = {"cores": cores, "threads": args.threads, "model": args.model, "new_tokens": args.new_tokens,
            "prompts": args.prompts, "generations": args.generations, "idle_s": args.idle_s,
            "trainer_core": trainer_core, "train_batch": args.train_batch}  # fmt: skip
    load_before = os.getloadavg()
    children: dict[str, _Child] = {}
    trainer: _Child | None = None
    keys = ("tps", "cpu1k", "apply", "idle", "train")
    per: dict[str, dict[str, list[float]]] = {e: {k: [] for k in keys} for e in ENGINES}
    alone: list[float] = []
    once: dict[str, dict] = {}
    try:
        if trainer_core is not None:  # first, so it computes nothing while the engines start
            trainer = _Child("trainer", opts, args.timeout_s)
            trainer.ask(None, "ready")
        for name in ENGINES:  # one at a time: start-up measured without the other computing
            children[name] = _Child(name, opts, args.timeout_s)
            once[name] = children[name].ask(None, "ready")
        slots = (("alone",) if trainer is not None else ()) + ENGINES
        for rep in range(args.reps):
            for name in slots if rep % 2 == 0 else tuple(reversed(slots)):
                if name == "alone":  # every engine process stopped: none of them can run next to the trainer
                    pids = [p for c in children.values() for p in _tree(c.proc.pid)]
                    _signal_all(pids, signal.SIGSTOP)
                    try:
                        alone.append(trainer.ask(("train", args.idle_s), "train")["steps_per_s"])
                    finally:
                        _signal_all(pids, signal.SIGCONT)
                    continue
                c = children[name]
                g = c.ask("gen", "gen")
                per[name]["tps"].append(g["tokens"] / g["wall_s"])
                per[name]["cpu1k"].append(g["cpu_s"] / g["tokens"] * 1000)
                per[name]["apply"].append(c.ask("apply", "apply")["ms"])
                c.send("idle")  # the engine sits between requests; the trainer steps on its own core meanwhile
                if trainer is not None:
                    per[name]["train"].append(trainer.ask(("train", args.idle_s), "train")["steps_per_s"])
                per[name]["idle"].append(c.ask(None, "idle")["share"])
        for name, c in children.items():
            once[name].update(c.ask("stop", "stopped"))
        if trainer is not None:
            trainer.ask("stop", "stopped")
    finally:
        for c in [*children.values(), *([trainer] if trainer is not None else [])]:
            c.close()
    engines = {
        name: {
            "tokens_per_s": _stats(per[name]["tps"]),
            "cpu_s_per_1k_tokens": _stats(per[name]["cpu1k"]),
            "apply_version_ms": _stats(per[name]["apply"]),
            "idle_cpu_share": _stats(per[name]["idle"]),
            "trainer_steps_per_s_next_to_idle": _stats(per[name]["train"]) if alone else None,
            "startup_s": once[name]["startup_s"],
            "peak_rss_mb": once[name]["peak_rss_mb"],
        }
        for name in ENGINES
    }
    med = {name: {k: v["median"] for k, v in e.items() if isinstance(v, dict)} for name, e in engines.items()}
    trainer_res = None
    if alone:
        trainer_res = {
            "core": trainer_core,
            "batch": [args.train_batch, 6 + args.new_tokens],
            "steps_per_s_alone": _stats(alone),
            "next_to_idle_vs_alone": {
                name: _stats([x / a for x, a in zip(per[name]["train"], alone, strict=True)]) for name in ENGINES
            },
        }
    alone_med = statistics.median(alone) if alone else None
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"} | {"cores": cores},
        "host": {"cpus": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()},
        "engines": engines,
        "trainer": trainer_res,
        "ratios": {
            "vllm_vs_transformers_tokens_per_s": med["vllm"]["tokens_per_s"] / med["transformers"]["tokens_per_s"],
            "vllm_vs_transformers_cpu_per_token": med["vllm"]["cpu_s_per_1k_tokens"]
            / med["transformers"]["cpu_s_per_1k_tokens"],
            "vllm_switch_ms": med["vllm"]["apply_version_ms"],
            **{
                f"trainer_next_to_idle_{name}_vs_alone": (
                    med[name]["trainer_steps_per_s_next_to_idle"] / alone_med if alone_med else None
                )
                for name in ("vllm", "transformers")
            },
        },
    }


def _fmt(s: dict) -> str:
    return f"{s['median']:.3g} [{s['min']:.3g}..{s['max']:.3g}]"


def report(res: dict) -> str:
    st, host = res["settings"], res["host"]
    lines = [
        f"python -m benchmarks engine: {st['model']}, {st['prompts']} prompts x {st['generations']} x "
        f"{st['new_tokens']} tokens, "
        f"cores {st['cores']}, {st['threads']} thread(s), {st['reps']} interleaved reps; host load "
        f"{host['load_before'][0]:.2f} -> {host['load_after'][0]:.2f} on {host['cpus']} CPUs",
    ]
    for name, e in res["engines"].items():
        lines.append(
            f"  {name:<12} tokens/s {_fmt(e['tokens_per_s'])}  cpu-s/1k tok {_fmt(e['cpu_s_per_1k_tokens'])}  "
            f"apply ms {_fmt(e['apply_version_ms'])}  idle cpu {_fmt(e['idle_cpu_share'])}  "
            f"start {e['startup_s']:.1f} s  peak rss {e['peak_rss_mb']:.0f} MB"
        )
    r, tr, eng = res["ratios"], res.get("trainer"), res["engines"]
    lines.append(
        f"  vllm_vs_transformers_tokens_per_s {r['vllm_vs_transformers_tokens_per_s']:.2f}  "
        f"vllm_vs_transformers_cpu_per_token {r['vllm_vs_transformers_cpu_per_token']:.2f}  "
        f"vllm_switch_ms {r['vllm_switch_ms']:.1f}"
    )
    if tr is None:
        lines.append("  trainer next to an idle engine: not measured (no core outside --cores or --trainer-core none)")
        return "\n".join(lines)
    lines.append(
        f"  trainer (core {tr['core']}, batch {tr['batch'][0]} x {tr['batch'][1]} tokens, 1 thread) steps/s: "
        f"alone {_fmt(tr['steps_per_s_alone'])}"
        + "".join(f"  next to idle {n} {_fmt(e['trainer_steps_per_s_next_to_idle'])}" for n, e in eng.items())
    )
    lines.append(
        "  "
        + "  ".join(
            f"trainer_next_to_idle_{n}_vs_alone {r[f'trainer_next_to_idle_{n}_vs_alone']:.3f} "
            f"[per rep {_fmt(tr['next_to_idle_vs_alone'][n])}]"
            for n in ("vllm", "transformers")
        )
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
