"""``python -m benchmarks comm --link RATE`` and ``python -m benchmarks weights --link RATE``: the same paths
between two network hosts.

Two network namespaces joined by a veth link shaped to ``RATE`` with ``tc tbf`` (:mod:`benchmarks.netns`;
needs root): the trainer's end in one (10.77.0.1), the rollout worker's end in the other (10.77.0.2), each a
process of one torch thread started with ``ip netns exec`` (``python -m benchmarks.link ROLE ARGS``).

Experience (``comm``): a ``torch_distributed`` producer sends GRPO batches
(:func:`~benchmarks.payloads.make_batch`, 64x1024 and 8x128) to the consumer, alternating the codecs
``raw`` and ``fp16`` run by run (rotating order) on the same connection; the consumer times each run of
batches after a warm-up, decoding and checking every frame. ``compressed_vs_raw_link_<size>`` is the median
over repetitions of fp16's batches/s over raw's within a repetition; ``compressed_bytes_link_<size>`` the
frame bytes ratio.

Weights: a ``broadcast`` sender (bucketed, xxh3-checksummed) and a ``per_param`` sender in the trainer's
namespace, their receiver in the worker's, publishing a Qwen2-like shape list (``--quick``: a smaller one)
in turns. One transfer is timed from the sender's ``publish`` until the receiver reported the version
received and verified (the destination is compared bit for bit after the first and the last).
``bucketed_link_goodput`` is the payload's bits per second over the link rate; ``bucketed_vs_per_param_link``
the paired ratio of the two.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from mrl_plugins.errors import ConfigError

WORKER_ADDR = "10.77.0.2"
#: the help of ``--link`` in ``python -m benchmarks comm`` and ``weights``
LINK_HELP = (
    "instead: between two network namespaces over a veth link shaped to RATE with tc (e.g. 1gbit; needs root); "
    "see benchmarks/link.py"
)
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def link_cli(prog: str, measure: Any, rate: str, json_path: str | None, **kw: Any) -> int:
    """The ``--link RATE`` branch of ``python -m benchmarks comm|weights``: measure, write ``json_path``; 0 if every
    target is met, 1 if not, 2 when the link cannot be made here (not root) or the rate is not one tc reads."""
    try:
        res = measure(rate, **kw)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if json_path:
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=2)
    return 0 if all(res["targets_met"].values()) else 1


def parse_rate(rate: str) -> float:
    """Bits per second of a ``tc`` rate such as ``1gbit``, ``200mbit`` (SI units, as tc reads them)."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"--link: expected a tc rate like 1gbit, 500mbit or 100kbit, got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _spread(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def _rotated(names: list[str], rep: int) -> list[str]:
    return names[rep % len(names) :] + names[: rep % len(names)]


# ---------------------------------------------------------------------------------------------- experience
def _comm_schedule(reps: int, quick: bool) -> list[tuple[str, int, str, int]]:
    """(size, rep, codec, batches) in the order both ends run them."""
    counts = {"64x1024": 20 if quick else 60, "8x128": 200 if quick else 600}
    return [
        (size, rep, codec, counts[size])
        for size in counts
        for rep in range(reps)
        for codec in _rotated(["raw", "fp16"], rep)
    ]


def _comm_consumer(args: dict) -> dict:
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.comm.dist_transport import DistConsumer

    cfg = CommConfig(transport="torch_distributed", host=args["host"], codec="raw", heartbeat_timeout_s=60.0)
    cons = DistConsumer(cfg, n_producers=1, run_id="benchlink", host=args["host"])
    print(json.dumps({"port": cons.port}), flush=True)
    out = []
    try:
        for size, rep, codec, count in args["schedule"]:
            for _ in range(args["warmup"]):
                cons.receive(timeout=120).release()
            t0, nbytes = time.perf_counter(), 0
            for _ in range(count):
                r = cons.receive(timeout=120)
                nbytes = r.nbytes
                r.release()
            out.append({"size": size, "rep": rep, "codec": codec, "rate": count / (time.perf_counter() - t0),
                        "bytes": nbytes})  # fmt: skip
        return {"runs": out, "corrupt": cons.stats()["corrupt"]}
    finally:
        cons.close()


def _comm_producer(args: dict) -> dict:
    from benchmarks.payloads import SIZES, make_batch
    from mrl_plugins.comm.codec import make_codec
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.comm.dist_transport import DistProducerHandle

    cfg = CommConfig(transport="torch_distributed", host=args["host"], codec="raw", heartbeat_timeout_s=60.0)
    prod = DistProducerHandle(args["host"], args["port"], 0, 1, "benchlink", cfg.to_dict()).attach(timeout=60)
    codecs = {name: make_codec(cfg, name) for name in ("raw", "fp16")}
    batches = {size: make_batch(*SIZES[size]) for size in SIZES}
    seq = 0
    try:
        for size, _rep, codec, count in args["schedule"]:
            prod.codec = codecs[codec]
            for _ in range(args["warmup"] + count):
                prod.send(batches[size], {"model_id": "policy", "version": 1, "seq": seq}, timeout=120)
                seq += 1
        return {"sent": seq}
    finally:
        prod.close()


def comm_link(rate: str, reps: int = 3, quick: bool = False) -> dict[str, Any]:
    """Experience batches over a link shaped to ``rate``: raw against fp16 (see the module docstring)."""
    schedule = _comm_schedule(reps, quick)
    got = _two_hosts(rate, "comm-consumer", "comm-producer", {"schedule": schedule, "warmup": 3})
    runs = got["first"]["runs"]
    cases: dict[str, dict[str, Any]] = {}
    ratios: dict[str, float] = {}
    for size in dict.fromkeys(r["size"] for r in runs):
        per = {c: [r for r in runs if r["size"] == size and r["codec"] == c] for c in ("raw", "fp16")}
        for c, rs in per.items():
            cases.setdefault(f"link_{c}", {})[size] = {
                "batches_per_s": _spread([r["rate"] for r in rs]),
                "link_utilisation": _spread([r["rate"] * r["bytes"] * 8 / parse_rate(rate) for r in rs]),
                "bytes_per_batch": rs[0]["bytes"],
                "per_rep": [r["rate"] for r in rs],
            }
        paired = [f["rate"] / r["rate"] for f, r in zip(per["fp16"], per["raw"])]
        ratios[f"compressed_vs_raw_link_{size}"] = statistics.median(paired)
        ratios[f"compressed_vs_raw_link_{size}_min"] = min(paired)
        ratios[f"compressed_bytes_link_{size}"] = per["fp16"][0]["bytes"] / per["raw"][0]["bytes"]
    targets = {"compressed_vs_raw_link_64x1024": (">=", 1.6)} if parse_rate(rate) == 1e9 else {}
    return _finish("comm", rate, reps, cases, ratios, targets, got, corrupt=got["first"]["corrupt"])


def measure_link(rate: str, reps: int = 3) -> dict[str, Any]:
    """What the experience path (``torch_distributed``, raw 64x1024 frames) carries over a link shaped to ``rate``
    between two network namespaces: payload bytes per second (median of ``reps`` runs), for
    ``python -m benchmarks plan``."""
    schedule = [("64x1024", rep, "raw", 40) for rep in range(reps)]
    got = _two_hosts(rate, "comm-consumer", "comm-producer", {"schedule": schedule, "warmup": 3})
    per_run = [r["rate"] * r["bytes"] for r in got["first"]["runs"]]
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = " ".join(f.read().split()[:3])
    measured = statistics.median(per_run)
    return {"link": rate, "bytes_per_s": measured, "utilisation": measured * 8 / parse_rate(rate),
            "per_run": per_run, "loadavg": load}  # fmt: skip


# ---------------------------------------------------------------------------------------------- weights
def _shapes(quick: bool) -> Any:
    from benchmarks.payloads import qwen_shapes

    # 0.5B-like list: 988 MB (8 s a transfer at 1 Gbit/s); quick: 6 layers of it on a 32k vocabulary, ~155 MB
    return qwen_shapes(vocab=32000, layers=6) if quick else qwen_shapes()


def _weights_sender(args: dict) -> dict:
    from benchmarks.payloads import make_tensors
    from mrl_plugins.weight_sync.broadcast import BroadcastSender, PerParamSender
    from mrl_plugins.weight_sync.config import WeightSyncConfig

    named = make_tensors(_shapes(args["quick"]))
    senders = {
        kind: cls(WeightSyncConfig(transport=kind, timeout_s=300).validate(), model_id=kind, host=args["host"])
        for kind, cls in (("per_param", PerParamSender), ("broadcast", BroadcastSender))
    }
    handles = {k: dataclasses.asdict(s.receiver_handle()) for k, s in senders.items()}
    print(json.dumps({"handles": handles}), flush=True)
    runs = []
    try:
        for v, (rep, kind) in enumerate(args["schedule"], start=1):
            s = senders[kind]
            time.sleep(0.3)  # the receiver waits in fetch_into by now
            t0 = time.perf_counter()
            s.publish(v, named)
            s.store.wait([f"done/{v}"])
            runs.append({"rep": rep, "kind": kind, "seconds": time.perf_counter() - t0})
        return {"runs": runs, "nbytes": sum(t.nbytes for _, t in named)}
    finally:
        for s in senders.values():
            s.close()


def _weights_receiver(args: dict) -> dict:
    import torch

    from benchmarks.payloads import make_tensors
    from mrl_plugins.weight_sync.broadcast import BroadcastHandle

    named = make_tensors(_shapes(args["quick"]))
    rx = {kind: BroadcastHandle(**h).attach() for kind, h in args["handles"].items()}
    dest = {n: torch.zeros_like(t) for n, t in named}
    schedule = args["schedule"]
    exact = []
    for v, (_rep, kind) in enumerate(schedule, start=1):
        if v in (1, len(schedule)):
            for t in dest.values():
                t.zero_()
        rx[kind].fetch_into(v, dest)
        rx[kind].store.set(f"done/{v}", b"1")
        if v in (1, len(schedule)):
            exact.append(all(torch.equal(dest[n], t) for n, t in named))
    return {"bit_exact": all(exact)}


def weights_link(rate: str, reps: int = 3, quick: bool = False) -> dict[str, Any]:
    """The bucketed, checksummed broadcast against per-parameter broadcasts over a link shaped to ``rate``."""
    schedule = [(rep, kind) for rep in range(reps + 1) for kind in _rotated(["per_param", "broadcast"], rep)]
    got = _two_hosts(rate, "weights-sender", "weights-receiver", {"schedule": schedule, "quick": quick},
                     handshake="handles")  # fmt: skip
    runs = [r for r in got["first"]["runs"] if r["rep"] > 0]  # repetition 0 is the warm-up
    nbytes, bits = got["first"]["nbytes"], parse_rate(rate)
    secs = {k: [r["seconds"] for r in runs if r["kind"] == k] for k in ("per_param", "broadcast")}
    cases = {
        ("bucketed_link" if k == "broadcast" else "per_param_link"): {
            "gb_per_s": _spread([nbytes / s / 1e9 for s in xs]),
            "goodput": _spread([nbytes * 8 / s / bits for s in xs]),
            "seconds": _spread(xs),
        }
        for k, xs in secs.items()
    }
    ratios = {
        "bucketed_link_goodput": cases["bucketed_link"]["goodput"]["median"],
        "per_param_link_goodput": cases["per_param_link"]["goodput"]["median"],
        "bucketed_vs_per_param_link": statistics.median(p / b for p, b in zip(secs["per_param"], secs["broadcast"])),
    }
    targets = {"bucketed_link_goodput": (">=", 0.8)} if bits == 1e9 else {}
    return _finish("weights", rate, reps, cases, ratios, targets, got, nbytes=nbytes,
                   bit_exact=got["second"]["bit_exact"])  # fmt: skip


# ---------------------------------------------------------------------------------------------- both
def _two_hosts(rate: str, first: str, second: str, args: dict, handshake: str = "port") -> dict[str, Any]:
    """Run role ``first`` in the trainer's namespace and ``second`` in the worker's; their JSON answers."""
    from benchmarks import netns

    why = netns.unavailable()
    if why is not None:
        raise ConfigError(f"a link between two network namespaces cannot be made here: {why}")
    try:
        parse_rate(rate)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: `-m benchmarks.link` finds it
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": path}
    args = {**args, "host": netns.TRAINER_ADDR}
    t0 = time.perf_counter()
    with netns.Hosts(1, rate=rate) as h:
        cmd = [sys.executable, "-m", "benchmarks.link"]
        a = h.popen(h.trainer, [*cmd, first, json.dumps(args)], env=env, stdout=subprocess.PIPE, text=True)
        hello = json.loads(a.stdout.readline() or "null")
        if not hello:
            raise RuntimeError(
                f"python -m benchmarks comm|weights --link: the {first} process exited (code {a.wait(30)})"
            )
        b = h.run(h.worker_ns[0], [*cmd, second, json.dumps({**args, handshake: hello[handshake]})], timeout=900,
                  env=env, capture_output=True, text=True)  # fmt: skip
        if b.returncode != 0:
            raise RuntimeError(
                f"python -m benchmarks comm|weights --link: the {second} process failed: {b.stderr[-2000:]}"
            )
        out, _ = a.communicate(timeout=300)
        drops = h.drops()
    return {"first": json.loads(out.strip().splitlines()[-1]), "second": json.loads(b.stdout.strip().splitlines()[-1]),
            "seconds": time.perf_counter() - t0, "drops": drops}  # fmt: skip


def _finish(what: str, rate: str, reps: int, cases: dict, ratios: dict, targets: dict, got: dict, **extra: Any):
    met = {k: (ratios[k] >= v if op == ">=" else ratios[k] <= v) for k, (op, v) in targets.items()}
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[:3]
    result = {
        "link": rate,
        "where": "two network namespaces, veth + tc tbf (burst 256kb, queue 1mb), 1 torch thread per process",
        "cases": cases,
        "ratios": ratios,
        "targets": {k: f"{op} {v}" for k, (op, v) in targets.items()},
        "targets_met": met,
        "reps": reps,
        "link_drops": got["drops"],
        "seconds": got["seconds"],
        "loadavg": " ".join(load),
        **extra,
    }
    print(f"{what} over a {rate} link (two network namespaces), median of {reps} runs, load {result['loadavg']}")
    for name, per in cases.items():
        print(f"  {name}: {json.dumps(per)}")
    for k, v in ratios.items():
        tgt = result["targets"].get(k)
        ok = "" if tgt is None else f"  (target {tgt}: {'met' if met[k] else 'MISSED'})"
        print(f"  {k} = {v:.3f}{ok}")
    return result


ROLES = {
    "comm-consumer": _comm_consumer,
    "comm-producer": _comm_producer,
    "weights-sender": _weights_sender,
    "weights-receiver": _weights_receiver,
}

if __name__ == "__main__":
    import torch

    torch.set_num_threads(1)
    answer = ROLES[sys.argv[1]](json.loads(sys.argv[2]))
    print(json.dumps(answer), flush=True)
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown while gloo's threads run (as `mrl worker`)
