"""``python -m benchmarks weights``: weight-sync bandwidth against the per-parameter baseline and memcpy.

Cases, each on a Qwen2.5-0.5B-like shape list (290 bf16 tensors, 988 MB; ``--quick``: a ~120 MB
list) and on the ``small`` preset model (``mrl_plugins.demo.models.build_model("small")``, ~11 MB fp32; without
transformers installed a Qwen2-like shape list stands in: hidden 256, 4 layers, vocab 16000, fp32, ~28 MB):

(a) ``per_param``: one synchronous gloo broadcast per parameter between two processes (baseline);
(b) ``bucketed``: the ``broadcast`` transport with its defaults (every chunk's xxh3 checksum
    computed by the sender and verified by the receiver), same two processes;
    ``bucketed_no_checksum``: the same with ``verify_checksum=False``;
(c) ``shm_sequential``: shm publish, then the verified load into a receiver's staging buffer (the order a run
    takes), one process, one thread;
plus this machine's memcpy bandwidth (``torch`` ``copy_`` of 256 MiB, one thread) sampled between the
cases of the same run, and
``switch_ms``: staging -> active of a :class:`DoubleBufferedReceiver` holding the small model.

Every process runs one torch thread. GB/s are medians over ``reps`` repetitions after one warm-up,
with min and max; the three gloo cases take turns within each repetition, in an order rotating from
one repetition to the next (same process pair, the destination zeroed before and compared bit for
bit after every transfer), so that a change of machine load hits them alike. The gloo ratios are
medians over repetitions of the ratio *within* a repetition (``..._min``: the worst repetition).
``ratios``: ``bucketed_vs_per_param`` = (b)/(a) with the default config, i.e. checksums verified
(the baseline verifies nothing); each gloo case also reports ``receiver_cpu_share``, the receiving
process's CPU time (all its threads, gloo's I/O threads included) per second of transfer (median);
``bucketed_no_checksum_vs_per_param`` = (b without checksums)/(a), equal work; ``shm_sequential_vs_memcpy`` =
(c)/memcpy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from mrl_plugins.weight_sync.broadcast import BroadcastSender, PerParamSender
from mrl_plugins.weight_sync.config import WeightSyncConfig
from mrl_plugins.weight_sync.receiver import DoubleBufferedReceiver
from mrl_plugins.weight_sync.shm import ShmSender

from .link import LINK_HELP
from .payloads import Shapes, make_tensors, qwen_shapes

CASES = ("per_param", "bucketed", "bucketed_no_checksum")


def small_shapes() -> tuple[Shapes, str]:
    """The ``small`` preset's parameter shapes and where they came from.

    The preset needs transformers (the ``trl`` extra); without it a Qwen2-like shape list stands in
    and its label says so.
    """
    try:
        import transformers  # noqa: F401
    except ImportError:
        return qwen_shapes(16000, 256, 704, 4, 64, torch.float32), "qwen2-like hidden 256, 4 layers, vocab 16000, fp32"
    from mrl_plugins.demo.models import PRESETS, build_model

    model, tok = build_model("small")
    p = PRESETS["small"]
    label = (
        f"mrl_plugins.demo.models small: qwen2 hidden {p.hidden_size}, {p.num_hidden_layers} layers, "
        f"vocab {len(tok)}, {next(model.parameters()).dtype}"
    )
    return [(n, tuple(t.shape), t.dtype) for n, t in model.named_parameters()], label


def module_from(named: list[tuple[str, torch.Tensor]]) -> torch.nn.Module:
    """A module tree holding the given tensors as parameters under their dotted names."""
    root = torch.nn.Module()
    for name, t in named:
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(t.clone(), requires_grad=False))
    return root


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def memcpy_samples(reps: int, nbytes: int = 256 << 20) -> list[float]:
    """GB/s of ``reps`` single-thread ``copy_`` calls of ``nbytes``."""
    a = torch.ones(nbytes, dtype=torch.uint8)
    b = torch.empty_like(a)
    b.copy_(a)
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        b.copy_(a)
        xs.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return xs


def _timed(fn: Callable[[], Any], reps: int, nbytes: int) -> dict[str, float]:
    fn()  # warm-up (page faults, first-touch)
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xs.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return _summary(xs)


def shm_gbps(named: list[tuple[str, torch.Tensor]], reps: int, verify: bool = True) -> dict[str, float]:
    """(c): publish into shm + verified copy into a staging buffer, sequentially in this process."""
    nbytes = sum(t.nbytes for _, t in named)
    cfg = WeightSyncConfig(verify_checksum=verify)
    sender = ShmSender(cfg, model_id="bench", run_id=f"bench{os.getpid()}")
    try:
        rx = sender.receiver_handle().attach()
        dest = {n: torch.empty_like(t) for n, t in named}
        state = {"v": 0}

        def once() -> None:
            state["v"] += 1
            sender.publish(state["v"], named)
            rx.fetch_into(state["v"], dest)

        once()  # grows the first slot; _timed's warm-up the second
        res = _timed(once, reps, nbytes)
        rx.close()
        return res
    finally:
        sender.close()


def switch_ms(named: list[tuple[str, torch.Tensor]], reps: int) -> dict[str, float]:
    """staging -> active of a DoubleBufferedReceiver (device staging) holding ``named`` as its module."""
    model = module_from(named)
    sender = ShmSender(WeightSyncConfig(), model_id="bench_switch", run_id=f"bench{os.getpid()}")
    try:
        recv = DoubleBufferedReceiver(model, sender.receiver_handle().attach(), model_id="bench_switch")
        xs = []
        for v in range(1, reps + 2):
            sender.publish(v, named)
            recv.poll(30)
            recv.switch(30)
            if v > 1:
                xs.append(recv.stats()["switch_ms"])
        recv.close()
        return _summary(xs)
    finally:
        sender.close()


def _order(rep: int) -> tuple[str, ...]:
    """The gloo cases of repetition ``rep``, in an order rotating from one repetition to the next."""
    k = rep % len(CASES)
    return CASES[k:] + CASES[:k]


def _paired(res: dict[str, Any], a: str, b: str) -> tuple[float, float]:
    """Median and minimum over repetitions of the ratio a/b *within* a repetition (cases run back to back)."""
    rs = [x / y for x, y in zip(res[a]["per_rep"], res[b]["per_rep"])]
    return statistics.median(rs), min(rs)


def _gloo_child(
    role: str, shapes: Shapes, reps: int, q_in: Any, q_out: Any, handles: Any, cfg_kw: dict | None = None
) -> None:
    torch.set_num_threads(1)
    named = make_tensors(shapes)
    nbytes = sum(t.nbytes for _, t in named)
    cfg = WeightSyncConfig(**{"transport": "broadcast", "timeout_s": 120, **(cfg_kw or {})})
    try:
        if role == "send":
            nocrc = dataclasses.replace(cfg, verify_checksum=False)
            senders = {
                "per_param": PerParamSender(cfg, model_id="bench"),
                "bucketed": BroadcastSender(cfg, model_id="b"),
                "bucketed_no_checksum": BroadcastSender(nocrc, model_id="c"),
            }
            q_out.put({k: s.receiver_handle() for k, s in senders.items()})
            for v in range(reps + 1):
                for case in _order(v):
                    q_in.get(timeout=120)
                    senders[case].publish(v, named)
            q_in.get(timeout=120)
            for s in senders.values():
                s.close()
            return
        hs = handles.get(timeout=120)
        rxs = {k: h.attach() for k, h in hs.items()}
        dest = {n: torch.empty_like(t) for n, t in named}
        xs: dict[str, list[float]] = {case: [] for case in CASES}
        cpu: dict[str, list[float]] = {case: [] for case in CASES}  # receiving process CPU per wall second
        exact = dict.fromkeys(CASES, True)
        for v in range(reps + 1):  # the cases take turns, so that a change of machine load hits them alike
            for case in _order(v):
                for t in dest.values():
                    t.zero_()
                q_in.put("go")
                t0, c0 = time.perf_counter(), time.process_time()
                rxs[case].fetch_into(v, dest, 120)
                if v:  # the first round is the warm-up
                    wall = time.perf_counter() - t0
                    xs[case].append(nbytes / wall / 1e9)
                    cpu[case].append((time.process_time() - c0) / wall)
                exact[case] = exact[case] and all(torch.equal(dest[n], t) for n, t in named)
        result = {
            case: {
                **_summary(xs[case]),
                "per_rep": xs[case],
                "bit_exact": exact[case],
                "receiver_cpu_share": statistics.median(cpu[case]),
            }
            for case in CASES
        }
        q_in.put("done")
        q_out.put(result)
    except BaseException as exc:  # report to the parent instead of hanging it
        q_out.put({"error": f"{role}: {type(exc).__name__}: {exc}"})
        raise


def gloo_gbps(shapes: Shapes, reps: int, timeout: float = 300, cfg_kw: dict | None = None) -> dict[str, Any]:
    """(a) and (b) between two spawned processes (``cfg_kw``: WeightSyncConfig overrides)."""
    ctx = mp.get_context("spawn")
    go, handles, result = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_gloo_child, args=("send", shapes, reps, go, handles, None, cfg_kw), daemon=True),
        ctx.Process(target=_gloo_child, args=("recv", shapes, reps, go, result, handles, cfg_kw), daemon=True),
    ]
    try:
        for p in procs:
            p.start()
        out = result.get(timeout=timeout)
        if "error" in out:
            raise RuntimeError(out["error"])
        for p in procs:
            p.join(30)
        return out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in (go, handles, result):
            q.close()
            q.join_thread()


def run_bench(reps: int = 5, json_path: str | None = None, quick: bool = False) -> dict:
    """Run every case; return (and optionally write) the result dict. See the module docstring."""
    torch.set_num_threads(1)
    big = qwen_shapes(32000, 896, 4864, 4) if quick else qwen_shapes()
    small, small_src = small_shapes()
    out: dict[str, Any] = {"reps": reps, "quick": quick, "threads_per_process": 1, "models": {},
                           "where": "loopback: both processes on one host"}  # fmt: skip
    # memcpy is sampled between the cases (not once up front) so that the ratios see the same
    # machine conditions as the cases they divide (the machine may be shared)
    mc: list[float] = memcpy_samples(3)
    for key, shapes, label in (("qwen0.5b", big, "Qwen2.5-0.5B-like" + (" (quick)" if quick else "")),
                               ("small", small, small_src)):  # fmt: skip
        named = make_tensors(shapes)
        nbytes = sum(t.nbytes for _, t in named)
        res: dict[str, Any] = {"label": label, "tensors": len(named), "bytes": nbytes}
        res.update(gloo_gbps(shapes, reps))
        mc += memcpy_samples(3)
        res["shm_sequential"] = shm_gbps(named, reps)
        mc += memcpy_samples(3)
        out["models"][key] = res
        del named
    out["memcpy_gbps"] = _summary(mc)
    main = out["models"]["qwen0.5b"]
    small_named = make_tensors(small)
    out["switch_ms"] = switch_ms(small_named, reps)
    bucketed, bucketed_min = _paired(main, "bucketed", "per_param")
    nocrc, nocrc_min = _paired(main, "bucketed_no_checksum", "per_param")
    out["ratios"] = {
        # the default config (every chunk checksummed and verified) against the baseline, which verifies nothing
        "bucketed_vs_per_param": bucketed,
        "bucketed_vs_per_param_min": bucketed_min,
        # equal work: neither side checksums
        "bucketed_no_checksum_vs_per_param": nocrc,
        "bucketed_no_checksum_vs_per_param_min": nocrc_min,
        "shm_sequential_vs_memcpy": main["shm_sequential"]["median"] / out["memcpy_gbps"]["median"],
        "small_bucketed_vs_per_param": _paired(out["models"]["small"], "bucketed", "per_param")[0],
        "switch_ms": out["switch_ms"]["median"],
    }
    out["notes"] = (
        "bucketed_vs_per_param is the default config: xxh3 of every chunk computed by the sender and verified by "
        "the receiver (the per-parameter baseline verifies nothing); bucketed_no_checksum_vs_per_param compares "
        "equal work (no checksum on either side). "
        "shm_sequential is one process, one thread: publish, then load."
    )
    out["targets"] = {"bucketed_vs_per_param": ">= 1.3", "shm_sequential_vs_memcpy": ">= 0.40", "switch_ms": "< 10"}
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _fmt(d: dict[str, float]) -> str:
    return f"{d['median']:7.2f}  [{d['min']:.2f} .. {d['max']:.2f}]"


def cli(argv: list[str] | None = None) -> int:
    """``python -m benchmarks weights [--json PATH] [--reps N] [--quick] [--link RATE]``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks weights", description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per case (default 5)")
    ap.add_argument("--quick", action="store_true", help="smaller shape list instead of the 0.5B one")
    ap.add_argument("--link", metavar="RATE", help=LINK_HELP)
    args = ap.parse_args(argv)
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    if args.link:
        from .link import link_cli, weights_link

        return link_cli(
            "python -m benchmarks weights", weights_link, args.link, args.json, reps=args.reps, quick=args.quick
        )
    r = run_bench(args.reps, args.json, args.quick)
    print("loopback (both processes on one host):")
    print(f"memcpy (1 thread)          GB/s {_fmt(r['memcpy_gbps'])}")
    for key, m in r["models"].items():
        print(f"{key}: {m['label']}, {m['tensors']} tensors, {m['bytes'] / 1e6:.0f} MB")
        for case in (*CASES, "shm_sequential"):
            share = m[case].get("receiver_cpu_share")
            extra = "" if share is None else f"   receiver CPU {share:.2f} cores"
            print(f"  {case:24s} GB/s {_fmt(m[case])}{extra}")
    print(f"switch_ms (small, device staging) {_fmt(r['switch_ms'])}")
    for k, v in r["ratios"].items():
        print(f"ratio {k:34s} {v:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(cli())
