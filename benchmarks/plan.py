"""``python -m benchmarks plan``: the bandwidth budget of a disaggregated run (source §2.2), checked against a
link speed; with ``--config C``, the placement plan of a config instead (:mod:`benchmarks.placement`): from two
short runs on this machine, the steps/s of taking turns on all cores (measured), of the async split (projected, as
``rollout.placement: auto`` projects it, and measured), and which one ``auto`` would pick.

Two flows cross the network between the inference (rollout) pool and the trainer:

* **experience** (rollout -> trainer): ``envs x rate x bytes`` per second -- parallel environments, transitions
  (or frames) per second per environment, bytes per transition. The source's example, 128 x 200 x 512 B, is
  13,107,200 B/s = 13.1 MB/s (decimal MB). ``--frame-bytes-from report.json`` takes the bytes per frame that a
  run measured instead of ``--bytes`` (then ``--rate`` counts frames per second per environment).
* **weights** (trainer -> each rollout receiver): ``params x dtype bytes`` per update, sent every
  ``--update-interval`` seconds; the average rate per path is ``bytes per update / interval``, and the trainer's
  egress carries one copy per receiver (``--receivers``) when weights go point to point.

Every need is multiplied by ``--headroom`` (default 3, the source's "provision 3x, then tighten from
measurements"). Against ``--link`` each path is ``ok`` when the provisioned figure fits the link and ``over``
otherwise; *util* is provisioned / link. The command exits 1 if any path is over, 2 on bad input.

Units (``parse_rate``): bits per second ``bit/s Kbit/s Mbit/s Gbit/s Tbit/s`` (also written ``Gbit``, ``Gb/s``,
``Gbps``) and bytes per second ``B/s KB/s MB/s GB/s TB/s`` (decimal) and ``KiB/s MiB/s GiB/s TiB/s`` (binary).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.units import (
    format_count,
    format_rate,
    format_size,
    parse_rate,
    parse_size,
)
from mrl_plugins.errors import ConfigError, choices

# ---------------------------------------------------------------------------------------------------------------------
# units
# ---------------------------------------------------------------------------------------------------------------------

#: Bytes per parameter for ``--dtype``.
DTYPE_BYTES: dict[str, float] = {
    "fp64": 8, "float64": 8, "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
    "fp8": 1, "float8": 1, "int8": 1, "int4": 0.5,
}  # fmt: skip


def _positive(name: str, value: float, *, integer: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name}: must be a positive number, got {value!r}")
    if integer and int(value) != value:
        raise ConfigError(f"{name}: must be a whole number, got {value!r}")
    return float(value)


# ---------------------------------------------------------------------------------------------------------------------
# budgets
# ---------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExperienceBudget:
    """Experience flow, rollout -> trainer: ``bytes_per_s = envs x rate x bytes_per_transition``."""

    envs: int
    rate: float
    bytes_per_transition: float
    headroom: float
    bytes_per_s: float
    provisioned_bytes_per_s: float


@dataclass(frozen=True)
class WeightBudget:
    """Weight broadcast, trainer -> receivers: one full copy per receiver per update."""

    params: float
    dtype: str
    update_interval_s: float
    receivers: int
    headroom: float
    bytes_per_update: float
    per_path_bytes_per_s: float
    sender_bytes_per_s: float
    provisioned_per_path_bytes_per_s: float
    provisioned_sender_bytes_per_s: float


def experience_budget(envs: int, rate: float, bytes_per_transition: float, headroom: float = 3.0) -> ExperienceBudget:
    """Experience bytes per second and the provisioned figure (x ``headroom``).

    ``experience_budget(128, 200, 512).bytes_per_s == 13_107_200`` (13.1 MB/s, the source's example).
    """
    envs_f = _positive("envs", envs, integer=True)
    rate_f = _positive("rate", rate)
    size = _positive("bytes per transition", bytes_per_transition)
    head = _positive("headroom", headroom)
    need = envs_f * rate_f * size
    return ExperienceBudget(int(envs_f), rate_f, size, head, need, need * head)


def weight_budget(
    params: float, dtype: str = "bf16", update_interval_s: float = 15.0, receivers: int = 1, headroom: float = 3.0
) -> WeightBudget:
    """Bytes per weight update (``params x bytes(dtype)``) and the average rate per path and at the sender.

    ``weight_budget(0.5e9, "bf16", 15, 4)``: 1 GB per update, 66.7 MB/s per path, 267 MB/s trainer egress.
    """
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype {dtype!r} is not known; valid: {choices(DTYPE_BYTES)}")
    n = _positive("params", params)
    interval = _positive("update interval (s)", update_interval_s)
    recv = _positive("receivers", receivers, integer=True)
    head = _positive("headroom", headroom)
    per_update = n * DTYPE_BYTES[dtype]
    per_path = per_update / interval
    sender = per_path * recv
    return WeightBudget(
        n, dtype, interval, int(recv), head, per_update, per_path, sender, per_path * head, sender * head
    )


@dataclass(frozen=True)
class PathRow:
    """One row of the plan: a network path, what it needs, what to provision, and the check against the link."""

    path: str
    detail: str
    need_bytes_per_s: float
    provisioned_bytes_per_s: float
    link_bytes_per_s: float | None
    utilisation: float | None
    status: str  # "ok", "over" or "-" (no link given)


def check_paths(paths: Sequence[tuple[str, str, float, float]], link_bytes_per_s: float | None) -> list[PathRow]:
    """Check ``(path, detail, need, provisioned)`` tuples against one link speed (bytes/s) -> rows."""
    rows = []
    for path, detail, need, prov in paths:
        if link_bytes_per_s is None:
            rows.append(PathRow(path, detail, need, prov, None, None, "-"))
            continue
        util = prov / link_bytes_per_s
        rows.append(PathRow(path, detail, need, prov, link_bytes_per_s, util, "over" if util > 1.0 else "ok"))
    return rows


def build_plan(
    experience: ExperienceBudget | None,
    weights: WeightBudget | None,
    link_bytes_per_s: float | None = None,
) -> dict[str, Any]:
    """The plan as a JSON-able dict: ``inputs``, ``paths`` (rows) and ``over`` (any path over the link)."""
    if experience is None and weights is None:
        raise ConfigError(
            "nothing to plan: give --envs/--rate/--bytes (experience) and/or --params/--update-interval (weights)"
        )
    paths: list[tuple[str, str, float, float]] = []
    if experience is not None:
        e = experience
        detail = f"{e.envs} envs x {e.rate:g}/s x {e.bytes_per_transition:g} B"
        paths.append(("experience rollout->trainer", detail, e.bytes_per_s, e.provisioned_bytes_per_s))
    if weights is not None:
        w = weights
        size = f"{format_size(w.bytes_per_update)} ({format_count(w.params)} params x {w.dtype})"
        detail = f"{size} every {w.update_interval_s:g} s"
        paths.append(
            ("weights trainer->1 receiver", detail, w.per_path_bytes_per_s, w.provisioned_per_path_bytes_per_s)
        )
        if w.receivers > 1:
            paths.append(
                (
                    "weights trainer egress",
                    f"{w.receivers} receivers x per-path rate",
                    w.sender_bytes_per_s,
                    w.provisioned_sender_bytes_per_s,
                )
            )
    rows = check_paths(paths, link_bytes_per_s)
    return {
        "inputs": {
            "experience": None if experience is None else asdict(experience),
            "weights": None if weights is None else asdict(weights),
            "link_bytes_per_s": link_bytes_per_s,
        },
        "paths": [asdict(r) for r in rows],
        "over": any(r.status == "over" for r in rows),
    }


def format_plan(plan: Mapping[str, Any]) -> str:
    """The plan as a text table."""
    header = ("path", "need", "provisioned", "link", "util", "status", "from")
    lines = [header]
    for r in plan["paths"]:
        link = "-" if r["link_bytes_per_s"] is None else format_rate(r["link_bytes_per_s"])
        util = "-" if r["utilisation"] is None else f"{100 * r['utilisation']:.1f}%"
        lines.append(
            (
                r["path"],
                format_rate(r["need_bytes_per_s"]),
                format_rate(r["provisioned_bytes_per_s"]),
                link,
                util,
                r["status"],
                r["detail"],
            )
        )
    exp, w = plan["inputs"]["experience"], plan["inputs"]["weights"]
    head = (exp or w)["headroom"]
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(header))]
    out = ["  ".join(str(c).ljust(widths[i]) for i, c in enumerate(row)).rstrip() for row in lines]
    out.append(f"provisioned = need x headroom {head:g}; util = provisioned / link; over when util > 100%")
    if w is not None:
        out.append(f"weights: {format_size(w['bytes_per_update'])} per update ({w['bytes_per_update']:.0f} B)")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------------------
# measured bytes per frame from a report
# ---------------------------------------------------------------------------------------------------------------------


def _runs_of(report: Any) -> list[tuple[str, Mapping[str, Any]]]:
    if not isinstance(report, Mapping):
        raise ConfigError(f"report: expected a JSON object at the top level, got {type(report).__name__}")
    runs = report.get("runs")
    if isinstance(runs, Mapping):
        return [(str(k), v) for k, v in runs.items() if isinstance(v, Mapping)]
    if isinstance(runs, list):
        return [(str(r.get("name", i)), r) for i, r in enumerate(runs) if isinstance(r, Mapping)]
    return [("report", report)]


def _frame_bytes(run: Mapping[str, Any]) -> float | None:
    run = {re.sub("/+", "/", k) if isinstance(k, str) else k: v for k, v in run.items()}  # 'mrl//comm/x' too
    direct = run.get("bytes_per_frame")
    if isinstance(direct, int | float) and not isinstance(direct, bool) and direct > 0:
        return float(direct)
    for b_key, f_key in (("comm_bytes", "comm_frames"), ("mrl/comm/bytes", "mrl/comm/frames")):
        b, f = run.get(b_key), run.get(f_key)
        if isinstance(b, int | float) and isinstance(f, int | float) and b > 0 and f > 0:
            return float(b) / float(f)
    for key in ("metrics", "mrl_metrics"):
        metrics = run.get(key)
        if isinstance(metrics, Mapping):
            found = _frame_bytes(metrics)
            if found is not None:
                return found
    return None


def frame_bytes_from_report(path: str | Path, run: str | None = None) -> tuple[str, float]:
    """Measured bytes per experience frame from a report: ``(run name, bytes)``.

    Read, per run (``runs`` as a name->run object or a list of runs with ``name``; or the top level itself):
    ``bytes_per_frame``, else ``comm_bytes / comm_frames``, else ``mrl/comm/bytes / mrl/comm/frames`` (also inside
    a ``metrics`` or ``mrl_metrics`` object, as ``mrl compare`` writes them). ``run`` picks a run by name; by
    default the first run that has the numbers.
    """
    from mrl_plugins.cli.triage import read_json_report

    report = read_json_report(path)
    runs = _runs_of(report)
    if run is not None:
        named = [(n, r) for n, r in runs if n == run]
        if not named:
            raise ConfigError(f"report {str(path)!r} has no run {run!r}; runs: {choices(n for n, _ in runs)}")
        runs = named
    for name, r in runs:
        value = _frame_bytes(r)
        if value is not None:
            return name, value
    raise ConfigError(
        f"report {str(path)!r}: no run has bytes per frame (keys 'bytes_per_frame', 'comm_bytes'+'comm_frames' or "
        "'mrl/comm/bytes'+'mrl/comm/frames')"
    )


# ---------------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks plan",
        description="Bandwidth budget for experience and weight traffic between rollout and trainer pools.",
        epilog="Example: python -m benchmarks plan --envs 128 --rate 200 --bytes 512 --params 0.5e9 "
        "--update-interval 15 --receivers 4 --link 10Gbit",
    )
    e = p.add_argument_group("experience (rollout -> trainer)")
    e.add_argument("--envs", type=int, help="parallel environments")
    e.add_argument("--rate", type=float, help="transitions (or frames) per second per environment")
    e.add_argument("--bytes", dest="bytes_", help="bytes per transition: 512, 4KiB, 1.5MB")
    e.add_argument("--frame-bytes-from", metavar="REPORT", help="use the measured bytes per frame of a report.json")
    e.add_argument("--run", help="with --frame-bytes-from: the run to read (default: the first that has it)")
    w = p.add_argument_group("weights (trainer -> rollout receivers)")
    w.add_argument("--params", type=float, help="parameter count, e.g. 0.5e9")
    w.add_argument(
        "--dtype", default="bf16", help=f"weight dtype on the wire (default bf16); one of {choices(DTYPE_BYTES)}"
    )
    w.add_argument("--update-interval", type=float, help="seconds between weight updates")
    w.add_argument("--receivers", type=int, default=1, help="rollout workers receiving weights (default 1)")
    p.add_argument("--headroom", type=float, default=3.0, help="provision this multiple of the need (default 3)")
    p.add_argument("--link", help="link speed per path: 10Gbit, 25Gb/s, 1.25GB/s, 800MB/s ...")
    p.add_argument(
        "--measure",
        metavar="RATE",
        help="instead of --link: shape a link to RATE (tc rate: 1gbit, 200mbit) between two network namespaces "
        "here, measure what the torch_distributed experience path carries over it and check against that (root)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    c = p.add_argument_group("placement (rollout.placement: auto) from a short measurement")
    c.add_argument("--config", help="measure this config's embedded job (YAML path or bundled name)")
    c.add_argument("--steps", type=int, default=8, help="steps per measurement run (default 8, at least 5)")
    c.add_argument("--model", help="override train.model for the measurement")
    c.add_argument("--no-split-run", action="store_true", help="skip the split's own measurement (projection only)")
    return p


def _placement_cli(args: argparse.Namespace) -> int:
    from benchmarks.placement import format_result, measure

    given = [f"--{k}" for k in ("envs", "rate", "bytes_", "params", "update_interval", "link") if getattr(args, k)]
    if given:
        raise ConfigError(f"--config plans the placement; the bandwidth options {given} go without it")
    print(f"measuring {args.config}: two short runs ({args.steps} steps each)...", flush=True)
    try:
        result = measure(args.config, steps=args.steps, model=args.model, split=not args.no_split_run)
    except RuntimeError as exc:
        print(f"python -m benchmarks plan: error: {exc}", file=sys.stderr)
        return 1
    print(format_result(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    return 0


def _plan_from_args(args: argparse.Namespace) -> dict[str, Any]:
    experience = None
    exp_given = [x is not None for x in (args.envs, args.rate, args.bytes_, args.frame_bytes_from)]
    if any(exp_given):
        if args.bytes_ is not None and args.frame_bytes_from is not None:
            raise ConfigError("give either --bytes or --frame-bytes-from, not both")
        if args.envs is None or args.rate is None or (args.bytes_ is None and args.frame_bytes_from is None):
            raise ConfigError("the experience budget needs --envs, --rate and --bytes (or --frame-bytes-from)")
        if args.frame_bytes_from is not None:
            run_name, size = frame_bytes_from_report(args.frame_bytes_from, args.run)
            print(f"bytes per frame: {size:.0f} B measured in run {run_name!r} of {args.frame_bytes_from}")
        else:
            size = parse_size(args.bytes_)
        experience = experience_budget(args.envs, args.rate, size, args.headroom)
    weights = None
    if args.params is not None or args.update_interval is not None:
        if args.params is None or args.update_interval is None:
            raise ConfigError("the weight budget needs both --params and --update-interval")
        weights = weight_budget(args.params, args.dtype, args.update_interval, args.receivers, args.headroom)
    link = None if args.link is None else parse_rate(args.link)
    if args.measure is not None:
        if link is not None:
            raise ConfigError("give either --link or --measure, not both")
        from benchmarks.link import measure_link

        got = measure_link(args.measure)
        print(
            f"measured over a {args.measure} link between two network namespaces: {format_rate(got['bytes_per_s'])} "
            f"({got['utilisation']:.0%} of the rate; load average {got['loadavg']})"
        )
        link = got["bytes_per_s"]
    return build_plan(experience, weights, link)


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks plan ...``: print the budget table; 0 when every path fits the link, 1 if one is over,
    2 on bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # argparse already printed usage and the error
        return int(exc.code or 0)
    try:
        if args.config:
            return _placement_cli(args)
        plan = _plan_from_args(args)
    except ConfigError as exc:
        print(f"python -m benchmarks plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(plan))
    if args.json:
        Path(args.json).write_text(json.dumps(plan, indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if plan["over"]:
        over = [r["path"] for r in plan["paths"] if r["status"] == "over"]
        print(f"over the link: {', '.join(over)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
