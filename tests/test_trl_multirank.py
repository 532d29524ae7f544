"""The TRL adapter with 2 training ranks (accelerate, DDP over gloo on CPU): every rank owns its inference copy
(an in-process engine, or a worker pool of its own) and publishes its weights to it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import psutil
import pytest

from tests.marks import require_trl

pytestmark = [require_trl, pytest.mark.slow]

SCRIPT = os.path.join(os.path.dirname(__file__), "scripts", "trl_multirank.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, rollout: dict, mode: str, kind: str = "grpo") -> list[dict]:
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    cmd = [accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           SCRIPT, str(tmp_path), json.dumps(rollout), mode, kind]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["world"] for r in ranks] == [2, 2]
    return ranks


def test_in_process_engine_on_every_rank_generates_with_the_trained_weights(tmp_path):
    ranks = _launch(tmp_path, {"workers": 0, "old_logps": "trainer"}, "colocate")
    for r in ranks:
        assert len(r["hist"]) == 4 and r["version"] == 3  # this rank published every step's weights
        diffs = [h["sampling/sampling_logp_difference/max"] for h in r["hist"]]
        assert max(diffs) < 1e-4  # gathered over both ranks: neither engine lags the trainer


def test_each_rank_runs_its_own_worker_pool(tmp_path):
    ranks = _launch(tmp_path, {"workers": 1, "max_staleness": 1, "local_warmup": False}, "disaggregated")
    pids = [p for r in ranks for p in r["pids"]]
    assert len(set(pids)) == 2  # one worker per rank
    assert ranks[0]["cores"] != ranks[1]["cores"]  # each rank's share of the cores
    for r in ranks:
        assert len(r["hist"]) == 4 and r["version"] == 3
        assert max(h.get("mrl/rollout/staleness", 0) for h in r["hist"]) <= 1
        assert sum(h.get("mrl/rollout/lookahead_hits", 0) for h in r["hist"]) >= 1
    for pid in pids:  # every rank shut its pool down
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_each_ranks_workers_score_with_that_ranks_reference_model(tmp_path):
    rollout = {"workers": 1, "max_staleness": 1, "local_warmup": False, "ref_logps": "engine"}
    ranks = _launch(tmp_path, rollout, "disaggregated", "rloo")  # RLOO: beta 0.05, a separate reference model
    for r in ranks:
        assert len(r["hist"]) == 4 and r["version"] == 3
        assert sum(h.get("mrl/rollout/ref_logps_engine", 0) for h in r["hist"]) == 4  # every generation
        assert sum(h.get("mrl/rollout/ref_logps_trainer", 0) for h in r["hist"]) == 0
