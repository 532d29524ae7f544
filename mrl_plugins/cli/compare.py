"""``mrl compare``: the same GRPO/RLOO run as vanilla TRL, with every stage on, and stage by stage.

Each run is its own process (``python -m mrl_plugins.run``) so that memory, threads and shared
memory of one run cannot leak into the next. Runs, in order:

* ``upstream`` -- vanilla TRL: every stage on ``upstream`` (the adapter replaces nothing; a test
  checks it equals vanilla TRL step for step), with every core for torch (its best setting);
* ``all`` -- every stage on ``mrl``;
* ``rollout`` -- only the rollout stage on ``mrl`` (weights and experience take TRL's way:
  per-parameter copy / pickling);
* ``rollout+weight_sync`` and ``rollout+comm`` -- the weight-sync and comm stages act on the path
  between the trainer and a separate inference copy, which only the rollout stage creates, so each
  is measured on top of ``rollout`` alone.

Writes ``report.md``, ``report.json`` and PNG plots into ``--out``; exits 1 when a plugin run's
final reward (mean of the last 10 logged steps) is below upstream's by more than ``--tolerance``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RUNS: dict[str, dict[str, str] | None] = {
    "upstream": {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"},
    "all": {"rollout": "mrl", "weight_sync": "mrl", "comm": "mrl"},
    "rollout": {"rollout": "mrl", "weight_sync": "upstream", "comm": "upstream"},
    "rollout+weight_sync": {"rollout": "mrl", "weight_sync": "mrl", "comm": "upstream"},
    "rollout+comm": {"rollout": "mrl", "weight_sync": "upstream", "comm": "mrl"},
}


def _progress(i: int, n: int, name: str, t0: float) -> None:
    width = 24
    done = int(width * i / n)
    print(
        f"\r[{'#' * done}{'.' * (width - done)}] {i}/{n} runs, {time.perf_counter() - t0:5.0f} s  {name:<22}",
        end="" if i < n else "\n",
        flush=True,
    )


def run_one(
    config: str,
    name: str,
    plugins: dict[str, str],
    out: Path,
    *,
    steps: int | None,
    model: str | None,
    threads: int | None,
    timeout: float,
) -> dict[str, Any]:
    json_path = out / f"run-{name.replace('+', '_')}.json"
    cmd = [
        sys.executable,
        "-m",
        "mrl_plugins.run",
        config,
        "--name",
        name,
        "--json",
        str(json_path),
        "--plugins",
        ",".join(f"{k}={v}" for k, v in plugins.items()),
    ]
    if steps:
        cmd += ["--steps", str(steps)]
    if model:
        cmd += ["--model", model]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", PYTHONUNBUFFERED="1")
    env.pop("MRL_PLUGINS", None)
    log_path = out / f"run-{name.replace('+', '_')}.log"
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"run {name!r} failed (exit {proc.returncode}); log {log_path}:\n{tail}")
    return json.loads(json_path.read_text(encoding="utf-8"))


def preflight_runs(data: dict[str, Any], names: list[str], *, steps: int | None, model: str | None) -> None:
    """What each run's process will check before it builds its model (:func:`mrl_plugins.run.preflight`), done
    here for every run first: a typo fails in seconds, not after the earlier runs."""
    from mrl_plugins.run import preflight

    train = dict(data.get("train") or {})
    if steps:
        train["steps"] = steps
    if model:
        train["model"] = model
    for name in names:
        preflight({**data, "train": train, "plugins": {**(data.get("plugins") or {}), **RUNS[name]}})


def summarize(runs: dict[str, dict[str, Any]], tolerance: float) -> dict[str, Any]:
    base = runs["upstream"]
    summary: dict[str, Any] = {
        "speedup": (runs["all"]["steps_per_s"] / base["steps_per_s"])
        if "all" in runs and base["steps_per_s"]
        else None,
        "final_reward": {n: r["final_reward"] for n, r in runs.items()},
        "steps_per_s": {n: r["steps_per_s"] for n, r in runs.items()},
        "speedup_per_run": {n: r["steps_per_s"] / base["steps_per_s"] for n, r in runs.items() if base["steps_per_s"]},
        "tolerance": tolerance,
    }
    floor = base["final_reward"] * (1 - tolerance)
    failed = [n for n, r in runs.items() if n != "upstream" and r["final_reward"] < floor]
    summary["reward_ok"] = not failed
    summary["reward_below_tolerance"] = failed
    return summary


def _bytes_per_stage(r: dict[str, Any]) -> dict[str, float]:
    m = r.get("mrl_metrics", {})
    return {
        "weights": m.get("mrl/weights/bytes", 0.0),
        "comm": m.get("mrl/comm/bytes", 0.0),
    }


def table(runs: dict[str, dict[str, Any]], summary: dict[str, Any]) -> str:
    head = (
        "| run | steps/s | x upstream | tokens/s | wall s | generate s | weight sync s | transfer+wait s | train s |"
        " weight bytes | comm bytes | peak RSS MB (trainer / worker) | final reward |"
    )
    lines = [head, "|" + "---|" * 13]
    for name, r in runs.items():
        ts = r["time_split"]
        b = _bytes_per_stage(r)
        rss = f"{r['peak_rss_bytes'] / 2**20:.0f} / {r.get('peak_child_rss_bytes', 0) / 2**20:.0f}"
        lines.append(
            f"| {name} | {r['steps_per_s']:.3f} | {summary['speedup_per_run'].get(name, 0):.2f} | "
            f"{r['tokens_per_s']:.0f} | {r['wall_s']:.1f} | {ts.get('generate', 0):.1f} | "
            f"{ts.get('weight_sync', 0):.2f} | {ts.get('transfer_wait', 0):.1f} | {ts.get('train', 0):.1f} | "
            f"{b['weights'] / 1e6:.1f} MB | {b['comm'] / 1e6:.2f} MB | {rss} | {r['final_reward']:.3f} |"
        )
    return "\n".join(lines)


def plots(runs: dict[str, dict[str, Any]], out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'mrl-plugins[plots]')", file=sys.stderr)
        return []
    files = []
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        steps = list(range(1, len(r["rewards"]) + 1))
        ax1.plot(steps, r["rewards"], label=name)
        per_step = r["train_s"] / max(1, len(r["rewards"]))
        ax2.plot([s * per_step for s in steps], r["rewards"], label=name)
    ax1.set(xlabel="step", ylabel="reward", title="reward vs step")
    ax2.set(xlabel="wall time (s, mean step time)", ylabel="reward", title="reward vs wall time")
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "reward.png", dpi=100)
    plt.close(fig)
    files.append("reward.png")
    fig, ax = plt.subplots(figsize=(8, 4))
    names = list(runs)
    bottom = [0.0] * len(names)
    for part in ("generate", "weight_sync", "transfer_wait", "train"):  # generate overlaps train with workers
        vals = [runs[n]["time_split"].get(part, 0.0) for n in names]
        ax.bar(names, vals, bottom=bottom, label=part)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="seconds", title="time split per run")
    ax.legend(fontsize=8)
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(out / "time_split.png", dpi=100)
    plt.close(fig)
    files.append("time_split.png")
    return files


def cli(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="mrl compare", description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("config_pos", nargs="?", metavar="CONFIG", help="same as --config")
    p.add_argument("--config", help="mrl YAML (path or bundled name; default compare_small)")
    p.add_argument("--out", default="mrl-compare", help="output folder for report.md/json and plots")
    p.add_argument("--json", help="also write report.json here")
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--model", help="override train.model (tiny, small or a checkpoint folder)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of runs (default: {','.join(RUNS)})")
    p.add_argument("--tolerance", type=float, default=0.10, help="max relative final-reward drop vs upstream")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    ns = p.parse_args(argv)
    if ns.config and ns.config_pos and ns.config != ns.config_pos:
        p.error(f"two configs given: {ns.config_pos!r} and --config {ns.config!r}")
    ns.config = ns.config or ns.config_pos or "compare_small"
    from mrl_plugins.config import load_yaml, resolve_config_path
    from mrl_plugins.errors import ConfigError, choices

    names = [n.strip() for n in ns.runs.split(",") if n.strip()]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        raise ConfigError(f"--runs: unknown run {unknown[0]!r}; valid: {choices(RUNS)}")
    if "upstream" not in names:
        names.insert(0, "upstream")
    if not 0 <= ns.tolerance < 1:
        raise ConfigError(f"--tolerance: must be in [0, 1), got {ns.tolerance}")
    config = str(resolve_config_path(ns.config))
    preflight_runs(load_yaml(config), names, steps=ns.steps, model=ns.model)  # every run checked before the first
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    _progress(0, len(names), names[0], t0)
    for i, name in enumerate(names):
        runs[name] = run_one(
            config,
            name,
            RUNS[name],
            out,
            steps=ns.steps,
            model=ns.model,
            threads=0 if name == "upstream" else None,
            timeout=ns.timeout,
        )
        _progress(i + 1, len(names), names[i + 1] if i + 1 < len(names) else "done", t0)
    summary = summarize(runs, ns.tolerance)
    report = {"config": config, "runs": runs, **summary}
    (out / "report.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1), encoding="utf-8")
    pngs = plots(runs, out)
    md = [
        f"# mrl compare ({config})",
        "",
        table(runs, summary),
        "",
        f"speedup (all stages vs upstream): {summary['speedup']:.2f}x" if summary["speedup"] else "",
        f"final reward within {ns.tolerance:.0%} of upstream: "
        + ("yes" if summary["reward_ok"] else "NO: " + ", ".join(summary["reward_below_tolerance"])),
        "",
        *[f"![{f}]({f})" for f in pngs],
    ]
    (out / "report.md").write_text("\n".join(md) + "\n", encoding="utf-8")
    print(table(runs, summary))
    if summary["speedup"]:
        print(f"\nspeedup (all stages vs upstream): {summary['speedup']:.2f}x")
    print(f"report: {out / 'report.md'}")
    if not summary["reward_ok"]:
        print(
            f"FAIL: final reward of {', '.join(summary['reward_below_tolerance'])} is more than "
            f"{ns.tolerance:.0%} below upstream's",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(cli(sys.argv[1:]))
