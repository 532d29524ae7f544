"""``python -m benchmarks comm``: experience batches between two processes through three paths.

Cases (each producer and consumer process limited to one torch thread, same batches):

* ``pickle_queue`` -- a bounded ``multiprocessing.Queue`` of dicts of numpy arrays, pickled once by the
  queue's feeder thread and unpickled by the consumer (the naive baseline at its best: no extra copy;
  the ``queue`` transport pickles in ``send`` so callers may reuse their tensors, one copy more);
* ``shm_raw`` -- the shared-memory ring, codec ``raw`` (lossless, zero-copy views);
* ``shm_fp16`` -- the shared-memory ring, codec ``fp16`` (floats cast, ints narrowed, overflow-guarded).

Batches are GRPO experience: ``prompt_ids``/``prompt_mask`` [B, T/4] and ``completion_ids``/
``completion_mask`` [B, T] int64, ``old_per_token_logps`` [B, T] fp32 (a few -inf entries, which send
the overflow guard down its exact path), ``advantages``/``rewards`` [B] fp32; sizes 64x1024 and 8x128.
The consumer times ``receive`` + ``release`` of a run of batches after a warm-up (the ring path
verifies the payload checksum (xxh3 by default) of every frame, so its data are read); throughput
is the median over ``reps`` runs, with min and max. The cases of one repetition run back to back in
rotating order; each ratio is the median over repetitions of the ratio *within* a repetition (the
machine's drift between repetitions cancels), and ``..._min`` is the worst repetition.

``trainer_side``: what keeping one received batch costs the trainer (the pool's ``own``), in this process on
a frame in memory: decode + copy out of the transport buffer, for each codec, with the rule in use (copy the
fields that are views on the buffer, once) against the rule before it (copy every field: fp16-cast fields
were copied twice), interleaved per repetition; microseconds per batch, median [min-max].
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import torch

from .link import LINK_HELP
from .payloads import SIZES, make_batch

_KEEP_ITERS = {"64x1024": 40, "8x128": 400}

CASES = {"pickle_queue": ("queue", "raw"), "shm_raw": ("shm", "raw"), "shm_fp16": ("shm", "fp16")}
#: batches per timed run: (case kind, size) -> count, chosen so a run takes ~0.1-0.4 s here
_COUNTS = {("queue", "64x1024"): 60, ("queue", "8x128"): 1500, ("shm", "64x1024"): 600, ("shm", "8x128"): 3000}
_WARMUP = 10


class _PlainQueueProducer:
    """Baseline sender: ``Queue.put`` of a dict of numpy views (pickled once, by the feeder thread)."""

    def __init__(self, q: Any) -> None:
        self.q = q

    def send(self, batch: dict[str, torch.Tensor], meta: dict[str, Any], timeout: float) -> None:
        self.q.put((dict(meta), {k: v.numpy() for k, v in batch.items()}), timeout=timeout)

    def close(self) -> None:
        self.q.close()
        self.q.join_thread()


class _PlainQueue:
    """Case (a), the naive baseline at its best: a bounded ``multiprocessing.Queue``, no extra copies."""

    def __init__(self, slots: int) -> None:
        self.q = mp.get_context("spawn").Queue(maxsize=slots)
        self._nbytes: dict[tuple, int] = {}

    def producer_handle(self, i: int) -> Any:
        return _PlainQueueHandle(self.q)

    def receive(self, timeout: float) -> Any:
        from mrl_plugins.comm.base import Received

        meta, arrays = self.q.get(timeout=timeout)
        batch = {k: torch.from_numpy(a) for k, a in arrays.items()}
        # bytes on the wire: the pickle of (meta, arrays), measured once per batch layout
        key = tuple((k, a.shape, a.dtype.str) for k, a in arrays.items())
        if key not in self._nbytes:
            import pickle

            self._nbytes[key] = len(pickle.dumps((meta, arrays), protocol=pickle.HIGHEST_PROTOCOL))
        return Received(meta, batch, self._nbytes[key])

    def close(self, unlink: bool = True) -> None:
        self.q.close()
        self.q.cancel_join_thread()


class _PlainQueueHandle:
    def __init__(self, q: Any) -> None:
        self.q = q

    def attach(self) -> _PlainQueueProducer:
        return _PlainQueueProducer(self.q)


def _pin(core_index: int) -> None:
    """Producer on the last core, consumer on the first (every case alike): unpinned, the scheduler sometimes
    put both on one core and a run measured 5x slower (bimodal medians)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, [cores[core_index]])


def _producer(handle: Any, commands: Any) -> None:
    torch.set_num_threads(1)
    _pin(-1)
    prod = handle.attach()
    batches: dict[str, dict[str, torch.Tensor]] = {}
    seq = 0
    try:
        while True:
            cmd = commands.get(timeout=300)
            if cmd is None:
                return
            size, count = cmd
            batch = batches.setdefault(size, make_batch(*SIZES[size]))
            for _ in range(_WARMUP + count):
                prod.send(batch, {"model_id": "policy", "version": 1, "seq": seq}, timeout=120)
                seq += 1
    finally:
        prod.close()


def _run_cases(reps: int, scale: float) -> dict[str, Any]:
    """All cases side by side: one producer process per case, runs interleaved (rotating order) so
    that drift of a shared machine hits every case alike; only one case moves data at a time."""
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.comm.shm_ring import shm_factory

    ctx = mp.get_context("spawn")
    cons: dict[str, Any] = {}
    cmds: dict[str, Any] = {}
    procs: dict[str, Any] = {}
    rates: dict[str, dict[str, list[float]]] = {c: {s: [] for s in SIZES} for c in CASES}
    nbytes: dict[str, dict[str, int]] = {c: {} for c in CASES}
    counts = {(c, s): max(5, int(_COUNTS[(CASES[c][0], s)] * scale)) for c in CASES for s in SIZES}
    try:
        for name, (kind, codec) in CASES.items():
            cfg = CommConfig(transport=kind, codec=codec, heartbeat_timeout_s=60.0)  # default ring: 4 x 8 MiB
            if kind == "shm":
                cons[name] = shm_factory(cfg, n_producers=1, run_id="bench")
            else:
                cons[name] = _PlainQueue(cfg.ring_slots)
            cmds[name] = ctx.Queue()
            procs[name] = ctx.Process(target=_producer, args=(cons[name].producer_handle(0), cmds[name]), daemon=True)
            procs[name].start()
        _pin(0)
        names = list(CASES)
        for size in SIZES:
            for rep in range(reps):
                for name in names[rep % len(names) :] + names[: rep % len(names)]:
                    count = counts[(name, size)]
                    cmds[name].put((size, count))
                    c = cons[name]
                    for _ in range(_WARMUP):
                        c.receive(timeout=120).release()
                    t0 = time.perf_counter()
                    for _ in range(count):
                        r = c.receive(timeout=120)
                        nbytes[name][size] = r.nbytes
                        r.release()
                    rates[name][size].append(count / (time.perf_counter() - t0))
        for name in names:
            cmds[name].put(None)
        for p in procs.values():
            p.join(timeout=60)
    finally:
        for name, p in procs.items():
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
            cmds[name].close()
            cmds[name].join_thread()
        for c in cons.values():
            c.close(unlink=True)
    out: dict[str, Any] = {}
    for name in CASES:
        out[name] = {}
        for size in SIZES:
            raw = sum(v.numel() * v.element_size() for v in make_batch(*SIZES[size]).values())
            rs, nb = rates[name][size], nbytes[name][size]
            out[name][size] = {
                "batches_per_s": _spread(rs),
                "gb_per_s": _spread([x * nb / 1e9 for x in rs]),
                "logical_gb_per_s": _spread([x * raw / 1e9 for x in rs]),
                "bytes_per_batch": nb,
                "raw_bytes_per_batch": raw,
                "batches_per_run": counts[(name, size)],
                "per_rep": rs,
            }
    return out


def _trainer_side(reps: int, scale: float) -> dict[str, Any]:
    """Decode + keep one batch (the pool's ``own``) vs decode + copy every field (the rule before), per codec."""
    from mrl_plugins.comm.codec import Codec
    from mrl_plugins.comm.frame import decode_frame, encode_frame
    from mrl_plugins.rollout.assemble import own

    def copy_all(v: Any) -> torch.Tensor:
        return torch.as_tensor(v).clone()

    out: dict[str, Any] = {}
    for size, (b, t) in SIZES.items():
        n = max(4, int(_KEEP_ITERS[size] * scale))
        for codec in ("raw", "fp16"):
            frame = memoryview(encode_frame(make_batch(b, t), {"seq": 0}, Codec(codec)))
            per: dict[str, list[float]] = {"one_copy": [], "copy_every_field": []}
            for rep in range(reps):
                order = [("one_copy", own), ("copy_every_field", copy_all)]
                for name, keep in order if rep % 2 == 0 else order[::-1]:
                    t0 = time.perf_counter()
                    for _ in range(n):
                        _meta, batch = decode_frame(frame)
                        kept = {k: keep(v) for k, v in batch.items()}
                    per[name].append((time.perf_counter() - t0) / n * 1e6)
                    del kept
            out[f"{codec}_{size}"] = {
                "us_per_batch": {k: _spread(v) for k, v in per.items()},
                "one_copy_vs_before": statistics.median(
                    a / b for a, b in zip(per["one_copy"], per["copy_every_field"])
                ),
            }
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run_bench(reps: int = 5, json_path: str | None = None, quick: bool = False) -> dict[str, Any]:
    """Run all cases; print a table; optionally write JSON; return the results dict."""
    reps = max(1, min(reps, 2) if quick else reps)
    scale = 0.25 if quick else 1.0
    threads = torch.get_num_threads()
    affinity = os.sched_getaffinity(0)
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        cases = _run_cases(reps, scale)  # producers are spawned (inheriting all cores) before the consumer pins
        trainer_side = _trainer_side(reps, scale)  # one thread, on the consumer's core
        elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
        os.sched_setaffinity(0, affinity)

    def bps(case: str, size: str) -> list[float]:
        return cases[case][size]["per_rep"]

    def paired(a: str, b: str, size: str) -> float:
        """Median over repetitions of the ratio within one repetition: the cases of a repetition run
        back to back, so the machine's drift between repetitions cancels."""
        return statistics.median(x / y for x, y in zip(bps(a, size), bps(b, size)))

    ratios: dict[str, float] = {}
    for size in SIZES:
        ratios[f"shm_vs_pickle_{size}"] = paired("shm_raw", "pickle_queue", size)
        ratios[f"compressed_vs_pickle_{size}"] = paired("shm_fp16", "pickle_queue", size)
        ratios[f"compressed_bytes_{size}"] = (
            cases["shm_fp16"][size]["bytes_per_batch"] / cases["shm_raw"][size]["bytes_per_batch"]
        )
        ratios[f"compressed_vs_uncompressed_speed_{size}"] = paired("shm_fp16", "shm_raw", size)
        ratios[f"compressed_vs_uncompressed_speed_{size}_min"] = min(
            x / y for x, y in zip(bps("shm_fp16", size), bps("shm_raw", size))
        )
    targets = {
        "shm_vs_pickle_64x1024": (">=", 8.0),
        "compressed_bytes_64x1024": ("<=", 0.55),
        "compressed_vs_uncompressed_speed_64x1024": (">=", 0.8),
    }
    met = {k: (ratios[k] >= v if op == ">=" else ratios[k] <= v) for k, (op, v) in targets.items()}
    result = {
        "cases": cases,
        "trainer_side": trainer_side,
        "ratios": ratios,
        "targets": {k: f"{op} {v}" for k, (op, v) in targets.items()},
        "targets_met": met,
        "reps": reps,
        "threads_per_process": 1,
        "where": "loopback: producer and consumer processes on one host",
        "seconds": elapsed,
    }
    _print(result)
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return result


def _print(res: dict[str, Any]) -> None:
    print(f"comm bench (loopback: shared memory and queues on one host): median of {res['reps']} runs [min-max], "
          "1 thread per process")  # fmt: skip
    print(f"{'case':<14}{'batch':<9}{'batches/s':>26}{'GB/s (wire)':>22}{'bytes/batch':>13}{'vs pickle':>11}")
    for size in SIZES:
        base = res["cases"]["pickle_queue"][size]["batches_per_s"]["median"]
        for name, per in res["cases"].items():
            r = per[size]
            b, g = r["batches_per_s"], r["gb_per_s"]
            print(
                f"{name:<14}{size:<9}{b['median']:>10.0f} [{b['min']:>6.0f}-{b['max']:>6.0f}]"
                f"{g['median']:>10.2f} [{g['min']:.2f}-{g['max']:.2f}]{r['bytes_per_batch']:>13}"
                f"{b['median'] / base:>10.1f}x"
            )
    print("trainer side, keeping one received batch (decode + copy out), us/batch median [min-max]:")
    for key, r in res["trainer_side"].items():
        one, before = r["us_per_batch"]["one_copy"], r["us_per_batch"]["copy_every_field"]
        print(
            f"  {key:<14} one copy at most {one['median']:>9.0f} [{one['min']:.0f}-{one['max']:.0f}]"
            f"   every field copied {before['median']:>9.0f} [{before['min']:.0f}-{before['max']:.0f}]"
            f"   ratio {r['one_copy_vs_before']:.2f}"
        )
    for k, v in res["ratios"].items():
        tgt = res["targets"].get(k)
        ok = "" if tgt is None else f"  (target {tgt}: {'met' if res['targets_met'][k] else 'MISSED'})"
        print(f"  {k} = {v:.3f}{ok}")


def cli(argv: list[str] | None = None) -> int:
    """``python -m benchmarks comm [--json PATH] [--reps N] [--quick] [--link RATE]``; 0 if all targets are met,
    else 1."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks comm", description=__doc__.split("\n")[0])
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="fewer batches and at most 2 reps (smoke run)")
    ap.add_argument("--link", metavar="RATE", help=LINK_HELP)
    args = ap.parse_args(argv)
    if args.link:
        from .link import comm_link, link_cli

        reps = max(1, min(args.reps, 2) if args.quick else args.reps)
        return link_cli("python -m benchmarks comm", comm_link, args.link, args.json, reps=reps, quick=args.quick)
    res = run_bench(reps=args.reps, json_path=args.json, quick=args.quick)
    return 0 if all(res["targets_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
