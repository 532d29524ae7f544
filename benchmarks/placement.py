"""``python -m benchmarks plan --config C``: the placement plan of a config, from a short measurement on this machine.

Two short runs of the config's embedded job (``train:`` section; each in its own process, like ``mrl compare``):

1. **turns** -- ``rollout.placement: auto`` started and held in taking turns on all of the trainer's cores
   (``placement_start: turns``, whatever the config says): measures steps/s and the stage times, and gives the
   projection of the split that ``auto`` computes at its first decision (:mod:`mrl_plugins.rollout.autoplace`);
2. **split** (unless ``split=False``) -- ``placement: fixed``, the workers serving from the first step
   (``local_warmup`` off): its steady-state steps/s (median step time of the run's second half), to set beside
   the projection.

``auto`` picks what its first decision would (:func:`pick`): the split when it is projected faster than the
measured turns by more than ``rollout.placement_margin``, turns when the split is projected hopeless, otherwise it
tries the split and keeps whichever of the two measured faster. (A config with ``placement_start: split``
reaches the same pair of measurements from the other end: split first, then turns explored.)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: never reached in a short run: auto stays in its first arrangement and only reports its probe decision
_HOLD = {"placement": "auto", "placement_start": "turns", "placement_interval": 100000, "placement_margin": 0.99}


def _run(data: dict[str, Any], name: str, folder: Path, timeout: float) -> dict[str, Any]:
    import yaml

    cfg_path, out = folder / f"{name}.yaml", folder / f"{name}.json"
    cfg_path.write_text(yaml.safe_dump(data), encoding="utf-8")
    cmd = [sys.executable, "-m", "mrl_plugins.run", "--config", str(cfg_path), "--name", name, "--json", str(out)]
    cmd.append("--quiet")
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1")
    env.pop("MRL_PLUGINS", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "no output")
        raise RuntimeError(f"the {name} run failed (exit {proc.returncode}): {last.strip()[:300]}")
    return json.loads(out.read_text(encoding="utf-8"))


def _steady(step_times: list[float]) -> float:
    tail = step_times[len(step_times) // 2 :]
    return 1.0 / statistics.median(tail) if tail else float("nan")


def measure(
    config: str, *, steps: int = 8, model: str | None = None, split: bool = True, timeout: float = 900
) -> dict[str, Any]:
    """Measure ``config``'s placement options (see the module docstring); returns a JSON-able dict."""
    from mrl_plugins.config import load_config, load_yaml, resolve_config_path
    from mrl_plugins.errors import ConfigError

    path = str(resolve_config_path(config))
    data = load_yaml(path)
    cfg = load_config(data)
    if cfg.rollout.workers < 1 or cfg.rollout.remote_workers:
        raise ConfigError(
            f"python -m benchmarks plan --config: {config!r} has no local rollout workers "
            f"(rollout.workers: {cfg.rollout.workers}, "
            f"remote_workers: {cfg.rollout.remote_workers}): there is no placement to choose"
        )
    if steps < 5:
        raise ConfigError(f"--steps: auto's first decision needs at least 5 steps, got {steps}")
    train = {**(data.get("train") or {}), "steps": steps, **({"model": model} if model else {})}
    plugins = {**(data.get("plugins") or {}), "rollout": "mrl"}
    base = {**data, "train": train, "plugins": plugins}
    out: dict[str, Any] = {
        "config": path,
        "steps": steps,
        "model": train.get("model", cfg.train.model),
        "margin": cfg.rollout.placement_margin,
        "cores": sorted(os.sched_getaffinity(0)),
    }
    with tempfile.TemporaryDirectory(prefix="mrl-plan-") as tmp:
        turns = _run({**base, "rollout": {**(data.get("rollout") or {}), **_HOLD}}, "turns", Path(tmp), timeout)
        m = turns["mrl_metrics"]
        if "mrl/rollout/placement_projected_split_steps_per_s" not in m:
            raise RuntimeError("the turns run ended before auto's first decision; give more --steps")
        out["turns"] = {
            "measured_steps_per_s": m["mrl/rollout/placement_measured_steps_per_s"],
            "run_steps_per_s": turns["steps_per_s"],
            "final_reward": turns["final_reward"],
        }
        out["split_projected_steps_per_s"] = m["mrl/rollout/placement_projected_split_steps_per_s"]
        if split:
            rollout = {**(data.get("rollout") or {}), "placement": "fixed", "local_warmup": False}
            res = _run({**base, "rollout": rollout}, "split", Path(tmp), timeout)
            out["split"] = {
                "steady_steps_per_s": _steady(res["step_times"]),
                "run_steps_per_s": res["steps_per_s"],
                "final_reward": res["final_reward"],
            }
    out["auto_picks"], out["why"] = pick(
        out["turns"]["measured_steps_per_s"],
        out["split_projected_steps_per_s"],
        out["margin"],
        out.get("split", {}).get("steady_steps_per_s"),
    )
    return out


def pick(turns: float, split_projected: float, margin: float, split_measured: float | None) -> tuple[str, str]:
    """What ``auto`` ends up with after its first decision (and the exploration it may start), and why."""
    from mrl_plugins.rollout.autoplace import EXPLORE_BAND

    if split_projected > turns * (1 + margin):
        return "split", f"projected more than {margin:.0%} faster than turns"
    if split_projected < turns * (1 - EXPLORE_BAND):
        return "turns", f"the split is projected more than {EXPLORE_BAND:.0%} slower: not tried"
    if split_measured is None:
        return "split or turns", "the split is projected close: auto tries it and keeps the faster measurement"
    faster = "split" if split_measured > turns else "turns"
    return faster, "the split is projected close: auto tries it and keeps the faster of the two measurements"


def format_result(r: dict[str, Any]) -> str:
    """The plan as text: one line per arrangement, then auto's pick."""
    lines = [
        f"placement plan for {r['config']} (model {r['model']}, {r['steps']} steps per run, cores {r['cores']})",
        f"  turns  {r['turns']['measured_steps_per_s']:7.2f} steps/s  measured: generation and training take turns "
        "on all cores (the trainer's own model generates)",
        f"  split  {r['split_projected_steps_per_s']:7.2f} steps/s  projected from that measurement (what auto "
        "decides on)",
    ]
    if "split" in r:
        lines.append(
            f"  split  {r['split']['steady_steps_per_s']:7.2f} steps/s  measured: the workers generate one batch "
            "ahead on their cores (steady state, second half of the run)"
        )
    lines.append(f"auto picks: {r['auto_picks']} ({r['why']}; it re-checks every rollout.placement_interval steps)")
    return "\n".join(lines)
