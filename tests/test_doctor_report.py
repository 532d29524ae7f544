"""``mrl doctor --report`` on what the run module really writes (``mrl compare``'s per-run results)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.marks import require_trl


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    return env


def test_every_time_split_key_of_the_run_module_is_read_by_triage():
    from mrl_plugins.cli import triage as t
    from mrl_plugins.run import TIME_SPLIT

    for key, part in TIME_SPLIT.items():
        assert part in (*t.TIME_PARTS, "flag"), key
        assert key in t.TIME_PARTS or key in t.TIME_ALIASES or key in t.TIME_FLAGS, key
    split = {key: 1.0 for key in TIME_SPLIT}
    result = t.triage("r", {"time_split": split, "wall_s": 10.0, "train_s": 8.0})
    assert "x 2 lane(s)" in result.utilisation_from  # generate_overlapped: 2 busy lanes at least
    assert "x 1 lane(s)" in t.triage("r", {"time_split": split | {"generate_overlapped": 0.0}, "wall_s": 9.0}).detail


@require_trl
@pytest.mark.slow
def test_doctor_reads_a_report_of_real_runs(tmp_path):
    """Two real runs through ``python -m mrl_plugins.run --json`` (how ``mrl compare`` runs each), in the
    ``{"runs": {name: result}}`` layout of its ``report.json``; ``mrl doctor --report`` gives a verdict per run."""
    from mrl_plugins.run import TIME_SPLIT

    runs = {}
    # the workers serve from the start (placement fixed): a 2-step run is too short for placement auto to start them
    (tmp_path / "split.yaml").write_text("rollout: {workers: 1, placement: fixed}\n", encoding="utf-8")
    for name, extra in (("upstream", ["--vanilla"]), ("all", [])):
        out = tmp_path / f"run-{name}.json"
        cmd = [sys.executable, "-m", "mrl_plugins.run", "split.yaml", "--model", "tiny", "--steps", "2"]
        proc = subprocess.run(
            [*cmd, "--name", name, "--json", str(out), "--quiet", *extra],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = json.loads(out.read_text())
        assert set(runs[name]["time_split"]) == set(TIME_SPLIT), name
    assert runs["upstream"]["time_split"]["generate_overlapped"] == 0.0
    assert runs["all"]["time_split"]["generate_overlapped"] == 1.0
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"config": "colocate", "runs": runs}), encoding="utf-8")

    proc = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", "doctor", "--report", str(report), "--json", "t.json"],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "unknown time_split" not in proc.stdout + proc.stderr
    for name in runs:
        assert re.search(rf"triage {re.escape(name)}: \w", proc.stdout), proc.stdout
    verdicts = {r["run"]: r for r in json.loads((tmp_path / "t.json").read_text())}
    assert set(verdicts) == set(runs)
    assert re.search(r"x [2-9]\d* lane\(s\)", verdicts["all"]["utilisation_from"]), verdicts["all"]
    for v in verdicts.values():
        assert 0 < v["utilisation"] <= 1
