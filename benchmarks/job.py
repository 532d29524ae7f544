"""One run of the embedded GRPO job for a benchmark: the config written beside its logs, run in its own process
by ``mrl compare``'s runner, a failure raised with the runner's error."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_job(data: dict[str, Any], out: Path, label: str, kind: Any, steps: int) -> tuple[dict[str, Any], Any]:
    """Run the config ``data`` as ``label`` under ``out`` (``<label>.yaml`` and its logs); returns the run's
    result and the host load sampled during it. RuntimeError naming the run when it failed."""
    import yaml

    from mrl_plugins.cli.compare import run_one

    path = out / f"{label}.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    result, error, load = run_one(
        path, label, kind, out / label, timeout=1800, max_steps=steps, on_poll=lambda *a: None
    )
    if result is None:
        raise RuntimeError(f"python -m benchmarks rollout: run {label} failed: {error}")
    return result, load
