"""``python -m benchmarks NAME [options]``: run one benchmark or lab tool from a checkout (``--help``: the list)."""

from __future__ import annotations

import importlib
import sys

#: name -> (module, what it measures)
TOOLS: dict[str, tuple[str, str]] = {
    "comm": ("benchmarks.comm", "experience batches between two processes through three paths"),
    "weights": ("benchmarks.weights", "weight-sync bandwidth against the per-parameter baseline and memcpy"),
    "rollout": (
        "benchmarks.rollout",
        "colocated inference latency with/without core binding; GRPO steps/s, async workers vs TRL; lending",
    ),
    "engine": (
        "benchmarks.engine",
        "transformers vs vLLM rollout engines on the same cores: tokens/s, CPU per token, start-up, apply ms",
    ),
    "ray": ("benchmarks.launchers", "the same GRPO job with rollout.launcher local, manual and ray"),
    "plan": ("benchmarks.plan", "bandwidth budget per path; --config C: placement plan (auto) from a short run"),
    "config_docs": ("benchmarks.config_docs", "writes docs/config.md from the config dataclasses (--check: compare)"),
    "checkpoint": ("benchmarks.checkpoint", "a ~135M-parameter Qwen2 checkpoint built in code (training-bound jobs)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    asked = bool(argv) and argv[0] in ("-h", "--help")
    if not argv or asked or argv[0] not in TOOLS:
        out = sys.stdout if asked else sys.stderr
        print(f"usage: python -m benchmarks {{{','.join(TOOLS)}}} [options]  (NAME --help: its options)", file=out)
        if not asked:
            why = f"unknown benchmark {argv[0]!r}" if argv else "which benchmark?"
            print(f"python -m benchmarks: error: {why}; valid: {', '.join(TOOLS)}", file=out)
            return 2
        print("\nbenchmarks and lab tools:", file=out)
        for name, (_, text) in TOOLS.items():
            print(f"  {name:<9}{text}", file=out)
        return 0
    import os

    from mrl_plugins.config_fields import INTERNAL_ENV
    from mrl_plugins.errors import MrlError

    os.environ[INTERNAL_ENV] = "1"  # the lab sets internal values (lending off, placements held...) in its runs

    module, _ = TOOLS[argv[0]]
    try:
        return int(importlib.import_module(module).cli(argv[1:]) or 0)
    except MrlError as exc:
        print(f"python -m benchmarks {argv[0]}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
