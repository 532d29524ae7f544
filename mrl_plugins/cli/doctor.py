"""``mrl doctor``: pre-run checks of the device setup, and post-run triage of a report (source §5).

Pre-run (``mrl doctor [--config PATH] [--processes N] [--ports ...] [--reserve ...] ...``) prints one line per
check, ``ok|warn|fail  <check>: <detail>``, and exits 1 if any check failed (0 otherwise, 2 on bad input). The
checks are the ``check_*`` of :mod:`mrl_plugins.cli.doctor_checks` (backend, versions, torch_npu+CANN, visible
devices, ports, memory, core limits, threads) and, with ``rollout.ray_address``, :mod:`mrl_plugins.cli.doctor_ray`.
Processes: ``--processes``, else the number of ``--visible-devices`` lists, else from ``--config`` 1 trainer +
``rollout.workers`` (see :func:`inputs_from_config`), else 1.

Post-run (``mrl doctor --report PATH [--lanes N] [--high-util F] [--target-*-per-s X]``) reads a JSON report and
prints a verdict per run, see :func:`triage` and :func:`load_report` for the schema and the definitions of
utilisation and communication wait. It reads the report's numbers alone: a pre-run flag (``--config``, ``--device``,
...) with ``--report``, a triage flag without it, or ``--device-memory`` / ``--headroom`` without ``--peak``, is a
usage error (exit 2), not ignored.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from mrl_plugins import device as dev
from mrl_plugins.cli.checks import Check, checked_type
from mrl_plugins.cli.doctor_checks import (
    DoctorInputs,
    _fraction,
    check_port_number,
    default_threads,
    parse_assignments,
    parse_card_list,
    reserve_from_peaks,
    run_checks,
)
from mrl_plugins.cli.doctor_ray import ray_checks
from mrl_plugins.cli.triage import NETWORK_TRANSPORTS, load_report, triage
from mrl_plugins.config import MODES, load_config, load_yaml
from mrl_plugins.device.memory import DEFAULT_HEADROOM
from mrl_plugins.device.placement import accelerator_indices, colocated_count
from mrl_plugins.errors import ConfigError, MrlError


def inputs_from_config(data: Mapping[str, Any]) -> dict[str, Any]:
    """What doctor uses from a config (loaded as a run loads it: removed and internal keys are the same errors),
    following how the TRL adapter places processes.

    ``processes`` = 1 trainer + ``rollout.workers`` (0 workers: the engine runs inside the trainer). ``card_plan``:
    the device index of each process -- the trainer on ``train.device``'s index (``npu:2`` -> 2, else 0), the workers
    where the adapter puts them (:func:`mrl_plugins.device.placement.accelerator_indices`, one training rank).
    ``threads_cfg``: (trainer threads or 0 for the default, its source, engine threads): with workers (local or
    remote) the trainer keeps one thread per core of ``rollout.trainer_cores``, else ``train.threads``; remote
    workers are not counted among this host's processes (they run where ``mrl worker`` starts them). ``network``: the
    transports (``auto`` resolved) that cross hosts and need rendezvous ports.
    """
    cfg = load_config(dict(data))
    rc = cfg.rollout
    out: dict[str, Any] = {"device": cfg.train.device, "mode": cfg.mode}
    colocated = colocated_count(cfg.mode, rc.workers, rc.colocated_workers)
    out["processes"] = 1 + rc.workers
    base = dev.parse_device_spec(cfg.train.device)[1] or 0
    out["card_plan"] = [base] + accelerator_indices(cfg.mode, rc.workers, colocated, base)[: rc.workers]
    if rc.workers or rc.remote_workers:
        out["threads_cfg"] = (rc.trainer_threads, "rollout.trainer_cores", rc.engine_threads)
    else:
        out["threads_cfg"] = (cfg.train.threads, "train.threads", rc.engine_threads)
    out["remote_workers"] = rc.remote_workers
    out["network"] = [
        f"{section}.transport={getattr(cfg, section).transport}"
        for section, names in NETWORK_TRANSPORTS.items()
        if getattr(cfg, section).transport in names
    ]
    return out


HIGH_UTIL = 0.7  # --high-util's default
#: what each name=value flag looks like (its error shows it)
EXAMPLES = {"--ports": "master=29500,weights=29501", "--reserve": "trainer=0.5,rollout=0.3", "--peak": "trainer=8GiB"}
#: the flags (argparse dests) of each mode, refused in the other one, which would ignore them
PRE_RUN_FLAGS = (
    *("config", "device", "mode", "processes", "visible_devices", "ports", "reserve", "peak", "device_memory"),
    *("headroom", "reserve_root", "threads"),
)
TRIAGE_FLAGS = ("lanes", "high_util", "target_steps_per_s", "target_tokens_per_s")

_at_least_one = checked_type(int, lambda v: v >= 1, "an integer >= 1")
_per_s = checked_type(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
_high_util = checked_type(
    float, lambda v: 0.5 <= v <= 1, "a fraction in [0.5, 1] (under 0.5 the verdict is scheduling)"
)
_headroom = checked_type(float, lambda v: 0 <= v <= 4, "a number in [0, 4] (as rollout.memory_headroom)")
_root_share = checked_type(float, lambda v: 0 < v <= 1, "a fraction of device memory in (0, 1]")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mrl doctor",
        description="Pre-run checks of the device setup (ok/warn/fail; exit 1 on fail), or with --report the "
        "post-run triage of a report.json.",
    )
    p.add_argument(
        "--config",
        help="an mrl YAML config, path or bundled name such as colocate (mode, device, rollout.workers/"
        "engine_threads)",
    )
    p.add_argument(
        "--device", help="device spec: auto, cpu, cuda[:N], npu[:N] (default: config's train.device, else auto)"
    )
    p.add_argument("--mode", choices=MODES, help="deployment mode (default: config's; overrides it everywhere)")
    p.add_argument(
        "--processes", type=_at_least_one, help="processes that will use devices (>= 1; default: from config, else 1)"
    )
    p.add_argument("--visible-devices", help="per-process card lists, ';' between processes: '0;1' or '0,1;2,3'")
    p.add_argument("--ports", help=f"port table name=port,... e.g. {EXAMPLES['--ports']}")
    p.add_argument("--reserve", help=f"memory fractions of one card: name=fraction,... e.g. {EXAMPLES['--reserve']}")
    p.add_argument("--peak", help=f"measured peaks name=SIZE,... (e.g. {EXAMPLES['--peak']}); needs --device-memory")
    p.add_argument("--device-memory", help="device memory size for --peak, e.g. 64GiB")
    headroom = f"for --peak: reservation = peak x (1 + headroom), in [0, 4] (default {DEFAULT_HEADROOM:g})"
    p.add_argument("--headroom", type=_headroom, help=headroom)
    p.add_argument("--reserve-root", type=_root_share, help="root/system reserve as a fraction of device memory")
    p.add_argument("--threads", help="torch threads per process: one number for all, or one per process 'a,b,...'")
    p.add_argument("--json", metavar="PATH", help="also write the checks (or triage) as JSON")
    t = p.add_argument_group(
        "post-run triage", "--report reads only the report: the flags above are refused with it, these need it"
    )
    t.add_argument("--report", help="mrl compare's report.json or mrl run --json's result")
    t.add_argument(
        "--lanes", type=_at_least_one, help="parallel compute lanes for CPU utilisation (>= 1; default: inferred)"
    )
    t.add_argument(
        "--high-util", type=_high_util, help=f"utilisation counted as high, in [0.5, 1] (default {HIGH_UTIL})"
    )
    t.add_argument(
        "--target-steps-per-s", type=_per_s, help="expected steps/s (> 0): below it at high utilisation = kernels"
    )
    t.add_argument("--target-tokens-per-s", type=_per_s, help="expected tokens/s (> 0): as --target-steps-per-s")
    return p


def _flag_problem(args: argparse.Namespace) -> str | None:
    """A flag the command would ignore: --report triages a finished run from the report's own numbers (no config,
    device or setup enters it), the triage flags need --report, --device-memory and --headroom need --peak."""

    def given(dests: Sequence[str]) -> str:
        return ", ".join(f"--{d.replace('_', '-')}" for d in dests if getattr(args, d) is not None)

    if args.report is not None:
        if extra := given(PRE_RUN_FLAGS):
            return (
                f"{extra}: pre-run check flag(s), not used by --report, which triages the finished run from the "
                "report's own numbers; run `mrl doctor` without --report to check a setup"
            )
    elif extra := given(TRIAGE_FLAGS):
        return f"{extra}: post-run triage flag(s), used only with --report PATH"
    elif args.peak is None and (extra := given(("device_memory", "headroom"))):
        return f"{extra}: size(s) the reservations of --peak, which was not given"
    return None


def _inputs_from_args(args: argparse.Namespace, env: Mapping[str, str], data: Mapping | None) -> DoctorInputs:
    """``data``: the ``--config`` YAML as read (None without one)."""
    cfg = inputs_from_config(data) if data is not None else {}
    inputs = DoctorInputs(env=env)
    inputs.device = args.device or cfg.get("device") or "auto"
    inputs.mode = args.mode or cfg.get("mode")
    visible = None
    if args.visible_devices is not None:
        visible = [parse_card_list(s, "--visible-devices") for s in args.visible_devices.split(";")]
    if args.processes is not None:
        inputs.processes = args.processes
    elif visible is not None:
        inputs.processes = len(visible)
    else:
        inputs.processes = cfg.get("processes", 1)
    inputs.visible = visible
    inputs.ports = {}
    inputs.network = list(cfg.get("network", []))
    if args.ports is not None:
        ports = parse_assignments(args.ports, "--ports", EXAMPLES["--ports"])
        inputs.ports |= {k: check_port_number(k, v) for k, v in ports.items()}
    if args.reserve is not None:
        reserve = parse_assignments(args.reserve, "--reserve", EXAMPLES["--reserve"])
        inputs.reserve = {k: _fraction(k, v) for k, v in reserve.items()}
    if args.peak is not None:
        if not args.device_memory:
            raise ConfigError("--peak needs --device-memory (e.g. 64GiB)")
        headroom = DEFAULT_HEADROOM if args.headroom is None else args.headroom
        peaks = reserve_from_peaks(
            parse_assignments(args.peak, "--peak", EXAMPLES["--peak"]), args.device_memory, headroom
        )
        clash = set(peaks) & set(inputs.reserve)
        if clash:
            raise ConfigError(f"{sorted(clash)} given in both --reserve and --peak")
        inputs.reserve |= peaks
    inputs.reserve_root = args.reserve_root
    if args.threads is not None:
        values = [s.strip() for s in args.threads.split(",")]
        if any(not v.isdigit() or int(v) < 1 for v in values):
            raise ConfigError(f"--threads {args.threads!r}: positive integers, one for all or one per process")
        if len(values) not in (1, inputs.processes):
            raise ConfigError(f"--threads gives {len(values)} values for {inputs.processes} processes")
        inputs.threads = [int(v) for v in values] * (inputs.processes if len(values) == 1 else 1)
        inputs.threads_source = "--threads"
    elif "threads_cfg" in cfg and inputs.processes == cfg["processes"]:
        trainer, src, engine = cfg["threads_cfg"]
        if trainer == 0:
            trainer, src = default_threads(env)
        inputs.threads = [trainer] + [engine] * (inputs.processes - 1)
        inputs.threads_source = f"trainer: {src}" + (
            ", workers: rollout.engine_threads" if inputs.processes > 1 else ""
        )
        if cfg.get("remote_workers"):
            inputs.threads_source += (
                f"; {cfg['remote_workers']} remote worker(s) not counted: they run where mrl worker starts them"
            )
    if visible is None and cfg.get("processes") == inputs.processes:
        inputs.card_plan = cfg.get("card_plan")
    return inputs


def _with_flags(data: Mapping[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The ``--config`` YAML with ``--mode`` and ``--device`` (``train.device``) applied: every check, the card
    plan and the pre-flight included, sees the same deployment."""
    out = dict(data)
    if args.mode:
        out["mode"] = args.mode
    if args.device:
        train = out.get("train")
        out["train"] = {**(train if isinstance(train, Mapping) else {}), "device": args.device}
    return out


def check_preflight(data: Mapping[str, Any]) -> Check:
    """The pre-flight ``mrl run`` does before it builds its model (:func:`mrl_plugins.run.preflight`: plugin,
    backend and ``disable`` names, the stage combination, workers against cores and devices, the engine's needs)."""
    from mrl_plugins.run import preflight

    try:
        preflight(dict(data))
    except MrlError as exc:
        return Check("fail", "config", f"a run refuses it: {exc}")
    return Check("ok", "config", "passes the run's pre-flight (plugins, backends, placement)")


def _write_json(path: str, payload: Any) -> None:
    Path(path).write_text(json.dumps(payload, indent=2) + "\n", encoding="utf-8")


def cli(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """``mrl doctor ...``: 0 when nothing failed, 1 when a check failed, 2 on bad input."""
    parser = _parser()
    try:
        args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
        if problem := _flag_problem(args):
            parser.error(problem)
    except SystemExit as exc:  # argparse already printed usage and the error
        return int(exc.code or 0)
    env = dict(os.environ) if env is None else env
    try:
        if args.report:
            results = [
                triage(
                    name,
                    run,
                    lanes=args.lanes,
                    high_util=HIGH_UTIL if args.high_util is None else args.high_util,
                    target_steps_per_s=args.target_steps_per_s,
                    target_tokens_per_s=args.target_tokens_per_s,
                )
                for name, run in load_report(args.report)
            ]
            for r in results:
                print(r.line())
            if args.json:
                _write_json(args.json, [asdict(r) for r in results])
            return 0
        data = _with_flags(load_yaml(args.config), args) if args.config else None
        checks = run_checks(_inputs_from_args(args, env, data))
        if data is not None:  # what a run of it refuses before its model is built; Ray's cluster against it
            checks.append(check_preflight(data))
            checks += ray_checks(data)
    except ConfigError as exc:
        print(f"mrl doctor: error: {exc}", file=sys.stderr)
        return 2
    for c in checks:
        print(c.line())
    failed = [c for c in checks if c.status == "fail"]
    warned = sum(c.status == "warn" for c in checks)
    print(f"{len(checks)} checks: {len(failed)} fail, {warned} warn")
    if args.json:
        _write_json(args.json, [asdict(c) for c in checks])
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
