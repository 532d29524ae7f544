"""The pre-run checks of ``mrl doctor`` (device setup, visible devices, ports, memory, core limits, threads).

Each ``check_*`` function returns :class:`~mrl_plugins.cli.checks.Check` lines; :func:`run_checks` runs them all
for one :class:`DoctorInputs`. The command line and the config reading are in :mod:`mrl_plugins.cli.doctor`.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins import device as dev
from mrl_plugins.cli.checks import Check
from mrl_plugins.device.memory import DEFAULT_HEADROOM
from mrl_plugins.errors import ConfigError

#: Root/system reserve limit (source §5: keep the root context's reserved memory under 20% of device memory).
MAX_ROOT_RESERVE = 0.20
#: The two core-limit APIs that compute isolation on one NPU needs.
NEEDED_CORE_LIMITS = ("set_device_limit", "set_stream_limit")


@dataclass
class DoctorInputs:
    """What the pre-run checks look at (built from the command line, the config and the environment)."""

    device: str = "auto"
    mode: str | None = None
    processes: int = 1
    visible: list[list[int]] | None = None
    ports: dict[str, int] = field(default_factory=dict)
    reserve_root: float | None = None
    reserve: dict[str, float] = field(default_factory=dict)
    threads: list[int] | None = None
    threads_source: str = ""
    card_plan: list[int] | None = None
    network: list[str] = field(default_factory=list)
    env: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


def _fmt_versions(v: Mapping[str, str | None]) -> str:
    names = (("python", "python"), ("torch", "torch"), ("torch_npu", "torch_npu"), ("cann", "CANN"), ("cuda", "CUDA"))
    return ", ".join(f"{label} {v.get(key) or '-'}" for key, label in names)


def _major_minor(version: str) -> tuple[int, int] | None:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None


def check_torch_npu_hazard(env: Mapping[str, str]) -> Check:
    """Fail when the torch_npu distribution is installed but no CANN toolkit is found (``import torch`` breaks)."""
    v = dev.versions(env)
    if dev.torch_npu_without_cann(env):
        return Check(
            "fail",
            "torch_npu+CANN",
            f"torch_npu {v.get('torch_npu') or '(found)'} is installed but {dev.probe.NO_CANN}: torch autoloads "
            f"torch_npu, so `import torch` fails. Fix: {dev.probe.CANN_FIX}",
        )
    if v.get("torch_npu") is None and not dev.torch_npu_installed():
        return Check("ok", "torch_npu+CANN", "torch_npu not installed (no hazard)")
    return Check(
        "ok", "torch_npu+CANN", f"torch_npu {v.get('torch_npu') or '-'} with CANN {v.get('cann') or '(found)'}"
    )


def check_backend(device_spec: str, env: Mapping[str, str]) -> tuple[list[Check], str]:
    """Device types found, the requested device, versions and the torch/torch_npu version matrix.

    Returns the checks and the device type the run will use (``auto`` resolved: NPU, else CUDA, else CPU).
    """
    kind, index = dev.parse_device_spec(device_spec)
    v = dev.versions(env)
    checks = [Check("ok", "versions", _fmt_versions(v))]
    if v.get("torch_npu") and v.get("torch"):
        npu_mm, torch_mm = _major_minor(str(v["torch_npu"])), _major_minor(str(v["torch"]))
        if npu_mm and torch_mm and npu_mm != torch_mm:
            checks.append(
                Check(
                    "fail",
                    "version matrix",
                    f"torch_npu {v['torch_npu']} is built for torch {npu_mm[0]}.{npu_mm[1]}.x but torch is "
                    f"{v['torch']}: install the torch_npu release that matches torch (Ascend/pytorch version table)",
                )
            )
        else:
            checks.append(Check("ok", "version matrix", f"torch_npu {v['torch_npu']} matches torch {v['torch']}"))
    if dev.torch_npu_without_cann(env):
        checks.append(Check("warn", "backend", "not probed: torch_npu without CANN (see the torch_npu+CANN check)"))
        return checks, "cpu" if kind == "auto" else kind
    types = dev.available_device_types()
    npu = dev.npu_status()
    counts = {"cpu": 1, "cuda": dev.probe.cuda_device_count() if "cuda" in types else 0}
    counts["npu"] = npu.device_count if npu.usable else 0
    if npu.installed and not npu.usable:
        checks.append(Check("warn", "torch_npu", f"installed but unusable, runs fall back: {npu.reason}"))
    found = ", ".join(f"{t}" + (f" x{counts[t]}" if t != "cpu" else "") for t in types)
    if kind == "auto":
        resolved = "npu" if "npu" in types else "cuda" if "cuda" in types else "cpu"
        checks.append(Check("ok", "backend", f"device 'auto' -> {resolved} (found: {found})"))
        return checks, resolved
    if kind not in types:
        why = (npu.reason or "torch_npu is not installed") if kind == "npu" else "torch.cuda.is_available() is False"
        checks.append(
            Check("fail", "backend", f"device {device_spec!r} requested but not present ({why}); found: {found}")
        )
        return checks, kind
    if index is not None and index >= counts[kind]:
        checks.append(
            Check("fail", "backend", f"device {device_spec!r}: only {counts[kind]} {kind.upper()} visible ({found})")
        )
        return checks, kind
    checks.append(Check("ok", "backend", f"device {device_spec!r} present (found: {found})"))
    return checks, kind


def _share_status(mode: str | None) -> tuple[str, str]:
    if mode in ("colocate", "hybrid"):
        return "warn", f"shared by design in {mode} mode: give each side a memory reservation (--reserve)"
    return "fail", "give each process its own card"


def parse_card_list(text: str, what: str, ids: bool = False) -> list[Any]:
    """``'0,1,3'`` -> ``[0, 1, 3]``; ConfigError for anything that is not distinct non-negative integers.

    ``ids=True`` (CUDA) also accepts device UUIDs / MIG ids such as ``GPU-8f3c...`` (kept as strings).
    """
    items = [s.strip() for s in text.split(",")]
    if not text.strip() or any(not (s.isdigit() or (ids and s and " " not in s)) for s in items):
        raise ConfigError(f"{what}: {text!r} is not a comma-separated list of card indices (e.g. '0,1')")
    cards = [int(s) if s.isdigit() else s for s in items]
    if len(set(cards)) != len(cards):
        raise ConfigError(f"{what}: {text!r} lists a card twice")
    return cards


def _visible(
    var: str,
    processes: int,
    mode: str | None,
    npu: bool,
    value: str | None,
    assignments: Sequence[Sequence[int]] | None,
) -> tuple[str, str, bool]:
    share_status, share_fix = _share_status(mode)
    shared = f"two processes on one card (sudden OOM or slowdown); {share_fix}"
    if assignments is not None:
        if len(assignments) != processes:
            raise ConfigError(f"--visible-devices gives {len(assignments)} assignments for {processes} processes")
        owner: dict[int, int] = {}
        for i, cards in enumerate(assignments):
            if npu and list(cards) != sorted(cards):
                return (
                    "fail",
                    f"process {i}: {var}={','.join(map(str, cards))} is not ascending (torch_npu sees no card)",
                    False,
                )
            for c in cards:
                if c in owner:
                    return share_status, f"processes {owner[c]} and {i} both get card {c} -> {shared}", True
                owner[c] = i
        text = "; ".join(f"process {i}: {var}={','.join(map(str, c))}" for i, c in enumerate(assignments))
        return "ok", f"{text} (no card shared)", False
    if value is None or not value.strip():
        if processes == 1:
            return "warn", f"{var} unset: the process sees every card; set it explicitly per process", False
        return (
            share_status,
            (
                f"{var} unset with {processes} processes: each sees every card and uses card 0 unless it picks one by "
                f"rank -> {shared}; set {var} per process, or pass --visible-devices '0;1;...'"
            ),
            True,
        )
    try:
        cards = parse_card_list(value, var, ids=not npu)
    except ConfigError as exc:
        return "fail", str(exc), False
    if npu and cards != sorted(cards):
        return "fail", f"{var}={value} is not ascending (torch_npu then counts no card)", False
    if processes > len(cards):
        return share_status, f"{processes} processes but {var}={value} lists {len(cards)} card(s) -> {shared}", True
    text = ", ".join(f"process {i} -> card {cards[i]}" for i in range(processes))
    return "ok", f"{text} ({var}={value}, one entry per process)", False


def plan_cards(card_plan: Sequence[int], var: str, env: Mapping[str, str]) -> tuple[list[list[Any]] | None, str]:
    """Physical card of each process from per-process device indices (into ``var``'s list when it is set).

    Returns ``(assignments, '')`` or ``(None, problem)`` when an index is beyond the cards ``var`` lists.
    """
    value = env.get(var, "").strip()
    if not value:
        return [[i] for i in card_plan], ""
    try:
        cards = parse_card_list(value, var, ids=var != "ASCEND_RT_VISIBLE_DEVICES")
    except ConfigError as exc:
        return None, str(exc)
    for proc, idx in enumerate(card_plan):
        if idx >= len(cards):
            return None, (
                f"process {proc} ({'trainer' if proc == 0 else f'worker {proc - 1}'}) needs device index {idx} but "
                f"{var}={value} lists {len(cards)} card(s): list more cards or use fewer workers"
            )
    return [[cards[i]] for i in card_plan], ""


def check_visible_devices(
    device_type: str,
    processes: int,
    mode: str | None,
    env: Mapping[str, str],
    assignments: Sequence[Sequence[int]] | None = None,
) -> tuple[Check, bool]:
    """Each process must see its own card(s). Returns the check and whether cards are shared between processes.

    ``assignments`` (one card list per process) is what the launcher will set; without it the current variable is
    read and process *i* is assumed to take its *i*-th entry. Sharing fails in disaggregated (or unknown) mode and
    warns in colocate/hybrid mode. On NPU a non-ascending list fails (torch_npu then counts no device).
    """
    var = dev.visible_devices_env(device_type)
    if var is None:
        return Check("ok", "visible devices", f"{device_type}: no visible-device variable to set"), False
    status, detail, shared = _visible(var, processes, mode, device_type == "npu", env.get(var), assignments)
    return Check(status, "visible devices", detail), shared


def parse_assignments(text: str, what: str, example: str) -> dict[str, str]:
    """``'a=1,b=2'`` -> ``{'a': '1', 'b': '2'}``; ConfigError naming the expected form, with ``example`` (what a
    valid ``what`` looks like), otherwise."""
    out: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or not value:
            raise ConfigError(f"{what}: {item.strip()!r} is not name=value (expected e.g. {example!r})")
        if key in out:
            raise ConfigError(f"{what}: {key!r} is given twice")
        out[key] = value
    return out


def check_port_number(name: str, value: Any) -> int:
    """A port must be an integer in 1..65535 (0 would mean 'pick at random', which the table is there to avoid)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ConfigError(f"port {name}={value!r} is not an integer in 1..65535")
    return value


def port_free(port: int, host: str = "127.0.0.1") -> tuple[bool, str]:
    """Try to bind ``host:port`` (SO_REUSEADDR, like a server would). ``(True, '')`` or ``(False, reason)``."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            return False, "in use"
        if exc.errno == errno.EACCES:
            return False, "permission denied (ports < 1024 need root)"
        return False, f"{exc.strerror or exc}"
    finally:
        sock.close()
    return True, ""


def check_ports(table: Mapping[str, int], network: Sequence[str] = ()) -> list[Check]:
    """One table: a port used by two names fails; a port that cannot be bound on 127.0.0.1 now warns.

    ``network`` names the settings that need ports (e.g. ``comm.transport=torch_distributed``); without a table
    they warn, without them an empty table is fine (shared-memory transports use no port).
    """
    if not table:
        if network:
            return [Check("warn", "ports", f"{', '.join(network)} need(s) rendezvous ports but no port table was "
                          "given: assign them from one table (--ports name=port,...), not at random")]  # fmt: skip
        return [Check("ok", "ports", "none assigned (no network transport configured)")]
    by_port: dict[int, list[str]] = {}
    for name, port in table.items():
        by_port.setdefault(port, []).append(name)  # checked by check_port_number when the table was read
    checks = []
    for port, names in sorted(by_port.items()):
        if len(names) > 1:
            checks.append(Check("fail", "ports", f"port {port} assigned to {' and '.join(names)}: collision"))
    busy = []
    for port, names in sorted(by_port.items()):
        free, why = port_free(port)
        if not free:
            busy.append(f"{'/'.join(names)}={port} ({why})")
    if busy:
        checks.append(Check("warn", "ports", f"cannot bind on 127.0.0.1 now: {', '.join(busy)}"))
    if not checks:
        listing = ", ".join(f"{n}={p}" for n, p in table.items())
        checks.append(Check("ok", "ports", f"{len(table)} ports, no collision, all free on 127.0.0.1: {listing}"))
    return checks


def _fraction(name: str, value: Any) -> float:
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"memory fraction {name}={value!r} is not a number in (0, 1]") from None
    if not (0.0 < f <= 1.0) or isinstance(value, bool):
        raise ConfigError(f"memory fraction {name}={value!r} is outside (0, 1]")
    return f


def check_memory(root: float | None, reserve: Mapping[str, float], cards_shared: bool) -> list[Check]:
    """Fractions of one card's memory: root/system reserve <= 0.20 and everything summed <= 1 (no clamping)."""
    shares = {name: _fraction(name, f) for name, f in reserve.items()}  # --peak's come unchecked; root: argparse's
    if root is None and not shares:
        if cards_shared:
            return [Check("warn", "memory", "processes share a card but no reservation was given: without explicit "
                          "limits the trainer takes all device memory; set --reserve name=fraction,... "
                          f"(each = measured peak x {1 + DEFAULT_HEADROOM:g})")]  # fmt: skip
        return [Check("ok", "memory", "no reservations requested")]
    checks = []
    if root is not None:
        if root > MAX_ROOT_RESERVE:
            checks.append(
                Check("fail", "memory", f"root/system reserve {root:.2f} of device memory > {MAX_ROOT_RESERVE:.2f}")
            )
        else:
            checks.append(Check("ok", "memory", f"root/system reserve {root:.2f} <= {MAX_ROOT_RESERVE:.2f}"))
    parts = dict(shares) | ({} if root is None else {"root": root})
    total = sum(parts.values())
    terms = " + ".join(f"{n} {f:.3g}" for n, f in parts.items())
    if total > 1.0 + 1e-9:
        checks.append(Check("fail", "memory", f"reservations sum to {total:.3g} > 1 of one card: {terms}"))
    elif shares:
        checks.append(Check("ok", "memory", f"reservations sum to {total:.3g} of one card: {terms}"))
    return checks


def reserve_from_peaks(peaks: Mapping[str, str], device_memory: str, headroom: float) -> dict[str, float]:
    """Fractions sized as measured peak x (1 + headroom) / device memory (``mrl_plugins.device.reservation_fraction``).

    A peak whose reservation exceeds the card raises ConfigError (from the device layer), never clamped.
    """
    from mrl_plugins.cli.units import parse_size

    total = parse_size(device_memory)
    return {n: dev.reservation_fraction(int(parse_size(p)), int(total), headroom) for n, p in peaks.items()}


def check_core_limits(device_type: str) -> Check:
    """Which of torch_npu's core-limit APIs exist (only NPUs have them)."""
    apis = dev.core_limit_apis()
    present = [n for n, ok in apis.items() if ok]
    missing = [n for n in NEEDED_CORE_LIMITS if not apis.get(n)]
    if device_type != "npu":
        detail = f"n/a on {device_type} (present: {', '.join(present) or 'none'}); CPU isolation uses thread budgets"
        return Check("ok", "core limits", detail)
    if missing:
        return Check(
            "warn",
            "core limits",
            f"torch_npu lacks {', '.join(missing)} (needs {dev.probe.CORE_LIMIT_RELEASES}, Ascend Extension for "
            "PyTorch 7.2.0): rollout and training cannot be split by cube/vector cores; isolation falls back to "
            "streams and memory fractions",
        )
    return Check("ok", "core limits", f"present: {', '.join(present)} (cube/vector cores can be split)")


def available_cores() -> int:
    """Cores this process may run on (affinity mask, else ``os.cpu_count()``)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_threads(env: Mapping[str, str]) -> tuple[int, str]:
    """Threads a process gets when nothing sets them: ``OMP_NUM_THREADS`` if set, else torch's default."""
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp:
        if not omp.isdigit() or int(omp) < 1:
            raise ConfigError(f"OMP_NUM_THREADS={omp!r} is not a positive integer")
        return int(omp), "OMP_NUM_THREADS"
    if not dev.torch_npu_without_cann(env):
        try:
            import torch

            return int(torch.get_num_threads()), "torch default"
        except Exception:  # torch unusable: count the cores, which is torch's default
            pass
    return available_cores(), "cores"


def check_threads(threads: Sequence[int], cores: int, source: str = "") -> Check:
    """Threads summed over processes against cores: more threads than cores warns (oversubscription)."""
    total = sum(threads)
    terms = "+".join(str(t) for t in threads)
    src = f" ({source})" if source else ""
    if total > cores:
        return Check(
            "warn",
            "threads",
            f"{terms} = {total} threads over {len(threads)} process(es){src} > {cores} cores: oversubscription makes "
            "a 2-thread forward 15x slower under load; give each process its own budget (OMP_NUM_THREADS / "
            "torch.set_num_threads, rollout.engine_threads)",
        )
    return Check("ok", "threads", f"{terms} = {total} threads over {len(threads)} process(es){src} <= {cores} cores")


def check_supported_versions() -> Check:
    """TRL (the adapter's range: ``enable()`` refuses others), transformers, torch, accelerate (declared ranges)."""
    from mrl_plugins.cli.doctor_versions import trl_version_notes, version_problems

    ok, missing, bad = version_problems()
    also = f"; ok: {', '.join(ok)}" if ok else ""
    if bad:
        return Check("fail", "supported versions", "; ".join(bad + missing) + also)
    notes = trl_version_notes()
    if missing or notes:
        hint = " (pip install 'mrl-plugins[trl]' for mrl run / enable())" if missing else ""
        return Check("warn", "supported versions", "; ".join(missing + notes) + hint + also)
    return Check("ok", "supported versions", ", ".join(ok))


def run_checks(inputs: DoctorInputs) -> list[Check]:
    """All pre-run checks, in order."""
    env = inputs.env
    checks = [check_supported_versions(), check_torch_npu_hazard(env)]
    backend, device_type = check_backend(inputs.device, env)
    checks += backend
    assignments = inputs.visible
    var = dev.visible_devices_env(device_type)
    if assignments is None and inputs.card_plan is not None and var is not None:
        assignments, problem = plan_cards(inputs.card_plan, var, env)
        if problem:
            checks.append(Check("fail", "visible devices", problem))
    if assignments is not None or inputs.card_plan is None or var is None:
        visible, shared = check_visible_devices(device_type, inputs.processes, inputs.mode, env, assignments)
        checks.append(visible)
    else:
        shared = False
    checks += check_ports(inputs.ports, inputs.network)
    checks += check_memory(inputs.reserve_root, inputs.reserve, shared)
    checks.append(check_core_limits(device_type))
    threads, source = inputs.threads, inputs.threads_source
    if threads is None:
        n, source = default_threads(env)
        threads = [n] * inputs.processes
    checks.append(check_threads(threads, available_cores(), source))
    return checks
