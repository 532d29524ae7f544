"""Post-run triage for ``mrl doctor --report PATH`` (source §5): scheduling, communication or kernels.

See :func:`load_report` for the report layouts read and :func:`triage` for the definitions of utilisation
and communication wait.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mrl_plugins.cli.checks import Check
from mrl_plugins.errors import ConfigError, choices
from mrl_plugins.run import TIME_SPLIT

#: Transports that talk over the network (need rendezvous ports), per config section.
NETWORK_TRANSPORTS: dict[str, tuple[str, ...]] = {
    "comm": ("torch_distributed",),
    "weight_sync": ("broadcast", "per_param"),
}

TIME_PARTS = ("generate", "weight_sync", "transfer", "train", "wait")
#: Keys of ``mrl_plugins.run``'s ``time_split`` (what ``mrl compare`` writes) that name a part differently, from
#: its one definition :data:`mrl_plugins.run.TIME_SPLIT` (``transfer_wait``: the trainer waiting for experience,
#: i.e. idle while rollouts are produced or in flight, is read as ``wait``).
TIME_ALIASES = {k: part for k, part in TIME_SPLIT.items() if part in TIME_PARTS and k != part}
#: Flags (not seconds) in ``time_split``: ``generate_overlapped`` = 1 means generate and train ran on parallel lanes.
TIME_FLAGS = tuple(k for k, part in TIME_SPLIT.items() if part == "flag")


def read_json_report(path: str | os.PathLike[str]) -> Any:
    """The parsed JSON at ``path``; ConfigError naming the file when it cannot be read or parsed."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"report {str(p)!r} cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ConfigError(f"report {str(p)!r} is not valid JSON: {exc}") from exc


def _num(value: Any, where: str, *, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"{where}: expected a non-negative number, got {value!r}")
    if positive and value <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")
    return float(value)


def load_report(path: str | os.PathLike[str]) -> list[tuple[str, dict[str, Any]]]:
    """Runs of a JSON report as ``(name, run)`` with each run in the schema below.

    The files a run leaves: ``mrl compare``'s ``report.json`` (``{"runs": {name: run, ...}}``; ``{"runs": [{"name":
    ..., ...}, ...]}`` too) and ``mrl run --json``'s result (a single run object, :class:`mrl_plugins.run.RunResult`).

    Run schema (seconds): ``time_split: {generate, weight_sync, transfer, train, wait}`` (``generate``, ``train``
    required, the rest default 0; ``mrl_plugins.run``'s keys (:data:`mrl_plugins.run.TIME_SPLIT`) are read too:
    ``transfer_wait`` as ``wait``, the flag ``generate_overlapped``), ``wall_s`` (> 0); optional ``train_s``
    (wall time of the training loop alone, used instead of ``wall_s`` when present), ``steps_per_s``, ``tokens_per_s``,
    ``utilization`` (0..1, measured device busy share), ``lanes`` (parallel compute lanes), ``comm_wait_s``
    (measured communication wait; default ``weight_sync + transfer``), ``target_steps_per_s`` /
    ``target_tokens_per_s`` (expected throughput).
    """
    p = Path(path)
    report = read_json_report(p)
    if not isinstance(report, Mapping):
        raise ConfigError(f"report {str(p)!r}: expected a JSON object, got {type(report).__name__}")
    runs = report.get("runs")
    if isinstance(runs, Mapping):
        items = [(str(k), v) for k, v in runs.items()]
    elif isinstance(runs, list):
        items = [(str(r.get("name", i)) if isinstance(r, Mapping) else str(i), r) for i, r in enumerate(runs)]
    else:
        items = [(p.stem, report)]
    out = []
    for name, run in items:
        if not isinstance(run, Mapping):
            raise ConfigError(f"report run {name!r}: expected an object, got {type(run).__name__}")
        out.append((name, dict(run)))
    if not out:
        raise ConfigError(f"report {str(p)!r} has no runs")
    return out


@dataclass(frozen=True)
class Triage:
    """Verdict for one run with the numbers behind it (shares are fractions of wall time)."""

    run: str
    verdict: str  # scheduling | communication | kernels | compute-bound | no clear bottleneck
    status: str
    utilisation: float
    utilisation_from: str
    comm_share: float
    wait_share: float
    steps_per_s: float | None
    tokens_per_s: float | None
    detail: str
    advice: str

    def line(self) -> str:
        return Check(self.status, f"triage {self.run}", f"{self.verdict} -- {self.detail} -> {self.advice}").line()


def triage(
    name: str,
    run: Mapping[str, Any],
    *,
    lanes: int | None = None,
    high_util: float = 0.7,
    target_steps_per_s: float | None = None,
    target_tokens_per_s: float | None = None,
) -> Triage:
    """The source's triage (§5) for one run.

    * window: the run's ``train_s`` (training loop) if present, else ``wall_s``.
    * utilisation: the run's ``utilization`` when measured (device busy share), else the CPU busy share
      ``(generate + train) / (window x lanes)``; ``lanes`` (parallel compute lanes whose busy time is in the split:
      1 when rollout and training take turns, 2 when both times are recorded and overlap) is the argument, else
      the run's ``lanes``, else the smallest whole number consistent with the times, ``ceil(busy / window)``, and
      at least 2 when the split's flag ``generate_overlapped`` is set (rollout workers generate while it trains);
      the run's ``lanes`` must be a whole number >= 1 (ConfigError; ``mrl doctor`` checks its --lanes, --high-util).
    * communication wait share: ``comm_wait_s`` (else ``weight_sync + transfer``) / window; ``wait`` (idle,
      waiting for experience) is reported as the idle share and counts against utilisation, not communication.
    * verdicts, in order: comm wait > 30% -> communication (compress first, then overlap); utilisation < 50% ->
      scheduling (uneven arrivals, small batches); utilisation >= ``high_util`` with throughput below a target
      (argument or the run's ``target_*``) -> kernels; >= ``high_util`` otherwise -> compute-bound; else no clear
      bottleneck.
    """
    where = f"report run {name!r}"
    split = run.get("time_split")
    if not isinstance(split, Mapping):
        raise ConfigError(
            f"{where}: needs 'time_split' {{generate, weight_sync, transfer, train, wait}} seconds (what mrl "
            "compare's report.json and mrl run --json's result hold)"
        )
    split = dict(split)
    flags = {k: _num(split.pop(k), f"{where} time_split.{k}") for k in TIME_FLAGS if k in split}
    for alias, key in TIME_ALIASES.items():
        if alias in split:
            if key in split:
                raise ConfigError(f"{where}: time_split has both {alias!r} and {key!r} (the same time)")
            split[key] = split.pop(alias)
    for key in ("generate", "train"):
        if key not in split:
            raise ConfigError(f"{where}: time_split lacks {key!r}; keys: {choices(TIME_PARTS)}")
    unknown = set(split) - set(TIME_PARTS)
    if unknown:
        valid = choices([*TIME_PARTS, *TIME_ALIASES, *TIME_FLAGS])
        raise ConfigError(f"{where}: unknown time_split key(s) {sorted(unknown)}; valid: {valid}")
    t = {k: _num(split.get(k, 0.0), f"{where} time_split.{k}") for k in TIME_PARTS}
    if "wall_s" not in run:
        raise ConfigError(f"{where}: needs 'wall_s' (wall-clock seconds of the run)")
    window_key = "train_s" if run.get("train_s") is not None else "wall_s"
    wall = _num(run[window_key], f"{where} {window_key}", positive=True)
    busy = t["generate"] + t["train"]
    if run.get("utilization") is not None:
        util = _num(run["utilization"], f"{where} utilization")
        if util > 1:
            raise ConfigError(f"{where}: utilization must be in 0..1, got {util}")
        util_from = "measured"
    else:
        if lanes is None and "lanes" in run:
            lanes_ = _num(run["lanes"], f"{where} lanes", positive=True)
            if lanes_ != int(lanes_):
                raise ConfigError(f"{where} lanes: must be a whole number >= 1, got {run['lanes']!r}")
            lanes = int(lanes_)
        least = 2 if flags.get("generate_overlapped") else 1  # rollout workers generate while the trainer trains
        n = lanes if lanes is not None else max(least, math.ceil(busy / wall - 1e-9))
        util = busy / (wall * n)
        if util > 1 + 1e-9:
            raise ConfigError(
                f"{where}: generate + train = {busy:.3g} s exceeds {window_key} {wall:.3g} s x {n} lane(s); "
                "give the number of parallel lanes that recorded busy time (--lanes or the run's 'lanes')"
            )
        util_from = (
            f"(generate {t['generate']:.3g} s + train {t['train']:.3g} s) / ({window_key} {wall:.3g} s x {n} lane(s))"
        )
    if run.get("comm_wait_s") is not None:
        comm = _num(run["comm_wait_s"], f"{where} comm_wait_s")
        comm_from = f"comm wait {comm:.3g} s"
    else:
        comm = t["weight_sync"] + t["transfer"]
        comm_from = f"weight_sync {t['weight_sync']:.3g} s + transfer {t['transfer']:.3g} s"
    comm_share, wait_share = comm / wall, t["wait"] / wall
    sps = None if run.get("steps_per_s") is None else _num(run["steps_per_s"], f"{where} steps_per_s")
    tps = None if run.get("tokens_per_s") is None else _num(run["tokens_per_s"], f"{where} tokens_per_s")
    tgt_s = target_steps_per_s if target_steps_per_s is not None else run.get("target_steps_per_s")
    tgt_t = target_tokens_per_s if target_tokens_per_s is not None else run.get("target_tokens_per_s")
    tgt_s = None if tgt_s is None else _num(tgt_s, f"{where} target steps/s", positive=True)
    tgt_t = None if tgt_t is None else _num(tgt_t, f"{where} target tokens/s", positive=True)
    detail = (
        f"utilisation {100 * util:.0f}% [{util_from}], comm wait {100 * comm_share:.0f}% [{comm_from}], "
        f"idle wait {100 * wait_share:.0f}%"
    )
    if sps is not None:
        detail += f", {sps:.3g} steps/s"
    if tps is not None:
        detail += f", {tps:.3g} tokens/s"
    below = []
    if tgt_s is not None and sps is not None and sps < tgt_s:
        below.append(f"{sps:.3g} steps/s < target {tgt_s:.3g}")
    if tgt_t is not None and tps is not None and tps < tgt_t:
        below.append(f"{tps:.3g} tokens/s < target {tgt_t:.3g}")
    if comm_share > 0.30:
        verdict, status = "communication", "warn"
        parts = {"weight sync": t["weight_sync"], "experience transfer": t["transfer"]}
        top = max(parts, key=parts.__getitem__) if run.get("comm_wait_s") is None else "communication"
        advice = (
            f"comm wait > 30%, mostly {top}: compress first (fewer bytes per frame/update: fp16/int16 experience "
            "fields, bf16 weights), then overlap with compute (async pipeline, prefetch; pull weights on version "
            "change)"
        )
    elif util < 0.50:
        verdict, status = "scheduling", "warn"
        advice = (
            "utilisation < 50% with low comm wait: uneven arrivals or small batches; raise batch/generations per "
            "step, overlap rollout and training (async pipeline), balance workers"
        )
    elif util >= high_util and below:
        verdict, status = "kernels", "warn"
        advice = (
            f"busy but slow ({'; '.join(below)}): kernels are not using fused/fast implementations (fused attention "
            "/ RMSNorm, graph mode for fixed shapes)"
        )
    elif util >= high_util:
        verdict, status = "compute-bound", "ok"
        advice = (
            f"utilisation >= {100 * high_util:.0f}%, comm low; if throughput is below what the device should do, "
            "kernels are next (check with --target-steps-per-s / --target-tokens-per-s)"
            if not (tgt_s or tgt_t)
            else "throughput meets the target"
        )
    else:
        verdict, status = "no clear bottleneck", "ok"
        advice = f"utilisation between 50% and {100 * high_util:.0f}%, comm wait <= 30%"
    return Triage(name, verdict, status, util, util_from, comm_share, wait_share, sps, tps, detail, advice)
