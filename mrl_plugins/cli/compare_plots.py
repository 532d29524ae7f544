"""``mrl compare``'s plots, drawn from the runs' own timestamps (:attr:`mrl_plugins.run.RunResult.timeline`).

* ``time_split.png`` -- per run kind (its median-speed repeat), the trainer's lane (setup, each step, and inside
  the steps its generate / wait-for-workers / weight-sync sections; the rest of a step is training) and the rollout
  workers' generate on a parallel lane, on one wall-clock axis, so overlap is visible; each run's wall time marked;
* ``reward.png`` -- reward against step and against wall-clock time since ``train()`` began, every repeat;
* ``speed.png`` -- steps/s per run kind: median with [min..max] over the repeats.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

#: trainer lane sections (time/<kind>_s spans) in drawing order: "generate" wraps "wait" with workers
TRAINER_PARTS = {
    "generate": ("generate in the trainer", "tab:orange"),
    "wait": ("wait for the workers' batch", "tab:red"),
    "weight_sync": ("weight sync (publish)", "tab:green"),
}
WORKER_COLOR = "tab:purple"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install 'mrl-plugins[plots]')", file=sys.stderr)
        return None
    return plt


def time_plot(plt: Any, report: dict[str, Any], names: list[str], path: Path) -> bool:
    kinds = [n for n in names if n in report["runs"] and report["runs"][n].get("timeline")]
    if not kinds:
        return False
    from matplotlib.patches import Patch

    lanes_total = sum(1 + len({w for w, *_ in report["runs"][n]["timeline"].get("worker", [])}) for n in kinds)
    fig, ax = plt.subplots(figsize=(12, 1.6 + 0.55 * lanes_total))
    yticks, ylabels = [], []
    y = 0.0
    xmax = 0.0
    for name in reversed(kinds):
        tl = report["runs"][name]["timeline"]
        workers = sorted({w for w, *_ in tl.get("worker", [])})
        lanes = len(workers)
        for w in workers:  # worker lanes under the trainer's
            spans = [(a, b - a) for ww, kind, a, b in tl["worker"] if ww == w and kind == "generate"]
            ax.broken_barh(spans, (y + 0.1, 0.8), color=WORKER_COLOR)
            yticks.append(y + 0.5)
            ylabels.append(f"{name}: worker {w}")
            y += 1.0
        ty = y
        wall = tl["wall"][1]
        ax.broken_barh([(0.0, tl["train"][0])], (ty + 0.35, 0.3), color="lightgray")  # setup
        if tl["steps"]:  # train() until its first step (TRL's set-up, the workers' start) and after its last one
            ax.broken_barh([(tl["train"][0], tl["steps"][0][0] - tl["train"][0])], (ty + 0.35, 0.3), color="tan")
            end = tl["steps"][-1][1]
            ax.broken_barh([(end, max(tl["train"][1], wall) - end)], (ty + 0.35, 0.3), color="dimgray")
        ax.broken_barh([(a, b - a) for a, b in tl["steps"]], (ty + 0.1, 0.8), color="tab:blue", alpha=0.55)
        for a, _ in tl["steps"]:
            ax.plot([a, a], [ty + 0.1, ty + 0.9], color="white", lw=0.6)
        for part, (_, color) in TRAINER_PARTS.items():
            spans = [(a, b - a) for k, a, b in tl.get("trainer", []) if k == part]
            if spans:
                ax.broken_barh(spans, (ty + 0.2, 0.6), color=color)
        ax.plot([wall, wall], [ty - lanes + 0.05, ty + 0.95], color="black", lw=1.5)
        ax.text(wall, ty + 0.5, f" wall {wall:.1f} s", va="center", fontsize=8)
        yticks.append(ty + 0.5)
        ylabels.append(f"{name}: trainer")
        xmax = max(xmax, wall)
        y += 1.0
        ax.axhline(y, color="gray", lw=0.5)
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_xlim(0, xmax * 1.12)
    ax.set_ylim(0, y)
    ax.set_xlabel("wall-clock time since the run began (after its imports; s)")
    ax.set_title("where the time goes: each run kind's median-speed repeat (white ticks: step starts)")
    handles = [
        Patch(color="lightgray", label="setup (model, trainer)"),
        Patch(color="tan", label="train() until its first step (workers start)"),
        Patch(color="dimgray", label="after the last step (workers stop)"),
        Patch(color="tab:blue", alpha=0.55, label="trainer step (rest = training)"),
        *[Patch(color=c, label=lbl) for lbl, c in TRAINER_PARTS.values()],
        Patch(color=WORKER_COLOR, label="generate in a rollout worker (parallel)"),
    ]
    ax.legend(handles=handles, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / len(kinds)), ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def reward_plot(plt: Any, report: dict[str, Any], names: list[str], path: Path) -> bool:
    kinds = [n for n in names if report["repeats"].get(n)]
    if not kinds:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, name in enumerate(kinds):
        color = colors[i % len(colors)]
        for j, r in enumerate(report["repeats"][name]):
            n = len(report["repeats"][name])
            label = f"{name} ({n} repeat{'s' if n > 1 else ''})" if j == 0 else None
            ax1.plot(range(1, len(r["rewards"]) + 1), r["rewards"], color=color, alpha=0.8, lw=1, label=label)
            tl = r.get("timeline") or {}
            t = [x - tl["train"][0] for x in tl.get("reward_t") or []]
            if t and len(t) == len(r["rewards"]):
                ax2.plot(t, r["rewards"], color=color, alpha=0.8, lw=1, marker=".", ms=3, label=label)
    ax1.set(xlabel="training step", ylabel="reward (mean over the step's completions)", title="reward vs step")
    ax2.set(
        xlabel="wall-clock time since train() began (s; includes the workers' start-up)",
        ylabel="reward (mean over the step's completions)",
        title="reward vs wall-clock time (left and up = faster and as good)",
    )
    for ax in (ax1, ax2):
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def speed_plot(plt: Any, report: dict[str, Any], names: list[str], path: Path) -> bool:
    kinds = [n for n in names if n in report["medians"]]
    if not kinds:
        return False
    fig, ax = plt.subplots(figsize=(8, 3.6))
    st = [report["medians"][n]["steps_per_s"] for n in kinds]
    med = [s["median"] for s in st]
    err = [[s["median"] - s["min"] for s in st], [s["max"] - s["median"] for s in st]]
    ax.bar(kinds, med, yerr=err, capsize=4, color="tab:blue", alpha=0.7, label="median, bars = [min..max]")
    for i, n in enumerate(kinds):
        for r in report["repeats"][n]:
            ax.plot(i, r["steps_per_s"], "k.", ms=4)
    ax.plot([], [], "k.", label="one repeat")
    missing = [(n, "failed") for n in names if n in report["failed"]] + [
        (n, "skipped") for n in names if n in report["skipped"]
    ]
    for j, (n, why) in enumerate(missing, len(kinds)):  # no bar: say why
        ax.bar([n], [0.0])
        ax.text(j, 0.0, f"{why}\n(see report)", ha="center", va="bottom", fontsize=8, color="tab:red")
    if "upstream" in kinds:
        ax.axhline(report["medians"]["upstream"]["steps_per_s"]["median"], color="gray", ls="--", lw=1,
                   label="upstream median")  # fmt: skip
    ax.set(ylabel="training steps per second", title="speed per run kind (higher = faster)")
    ax.legend(fontsize=7)
    plt.setp(ax.get_xticklabels(), rotation=15, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def plots(report: dict[str, Any], names: list[str], out: Path) -> list[str]:
    plt = _pyplot()
    if plt is None:
        return []
    files = []
    for fname, fn in (("time_split.png", time_plot), ("reward.png", reward_plot), ("speed.png", speed_plot)):
        if fn(plt, report, names, out / fname):
            files.append(fname)
    return files
