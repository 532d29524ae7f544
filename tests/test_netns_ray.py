"""Rollout workers started, placed and restarted by Ray (``rollout.ray_address``) on a real two-node Ray cluster
across network namespaces (tests/ray_cluster.py: the head in the trainer's namespace, with no CPU of its own, a
worker node of 1 CPU in the other): a GRPO run (`mrl run`, tiny preset) whose worker Ray placed on the worker node
learns, every weight version switched in order, through a SIGKILL of the actor's process mid-run (Ray restarts it,
it rejoins, the run finishes); with ``broadcast`` weights a killed actor is one clear error (its group takes no new
member); the worker node stopped is one clear error within ``rollout.timeout_s`` and nothing hangs (that node's Ray
started under ``taskset -c`` on one core, the actor bound to the other by ``rollout.ray_worker_cores``). After each
test every namespace, Ray process and shared-memory segment of it is gone. Root needed (namespaces), and Ray."""

from __future__ import annotations

import ast
import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from benchmarks import netns
from tests import netns as two_hosts
from tests import ray_cluster
from tests.marks import require_ray, require_trl

pytestmark = [pytest.mark.slow, pytest.mark.ray]

HEAD = ray_cluster.HEAD
RENDEZVOUS = f"{HEAD}:{ray_cluster.RENDEZVOUS_PORT}"
STEPS = 16
KILL_AT = 6  # steps done before the actor's process is SIGKILLed
SCRIPT = str(Path(__file__).parent / "scripts" / "netns_pool.py")


def _shm_of(pids: list[int]) -> list[str]:
    """Shared-memory segments whose name carries one of ``pids`` (the pool's names carry its process's pid)."""
    names = os.listdir("/dev/shm")
    return [n for n in names for p in pids if str(p) in n and n.startswith("mrl")]


@pytest.fixture
def cluster(request):
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"a Ray cluster across namespaces needs them: {why}")
    made = ray_cluster.RayCluster(worker_cpus=1, **getattr(request, "param", {}))
    seen: list[int] = []
    made.seen_pids = seen  # processes the test started in the trainer's namespace (their shm is checked)
    try:
        yield made
    finally:
        made.close()
        assert not ray_cluster.leftover_namespaces(), ray_cluster.leftover_namespaces()
        assert not made.leftover_processes(), made.leftover_processes()
        assert not _shm_of(seen), _shm_of(seen)


def _config(tmp_path: Path, **rollout) -> dict:
    """The README's trainer config ("On a Ray cluster") on the harness's addresses (the worker node reaches the
    trainer at HEAD)."""
    return {
        "mode": "disaggregated",
        "timeout_s": 60,
        "rollout": {
            "workers": 0,
            "remote_workers": 1,
            "ray_address": f"{HEAD}:{ray_cluster.GCS_PORT}",
            "rendezvous": RENDEZVOUS,
            "restart_workers": 1,
            **rollout,
        },
        "weight_sync": {"directory": str(tmp_path / "weights")},
    }


def _steps_done(progress: Path) -> int:
    try:
        lines = progress.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0
    return int(json.loads(lines[-1])["step"]) if lines else 0


@require_ray
@require_trl
def test_grpo_worker_on_the_ray_node_learns_and_survives_a_sigkill(cluster, tmp_path):
    data = _config(tmp_path, local_warmup=False, engine_threads=1, trainer_threads=1)
    data["train"] = {"model": "tiny", "steps": STEPS}
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = re.search(r"```yaml\n(# trainer config.*?)```", readme, re.S).group(1).replace("10.0.0.1", HEAD)
    pasted = yaml.safe_load(
        block
    )  # the README's config ("On a Ray cluster") is this one, on the namespaces' addresses
    test_only = ("local_warmup", "engine_threads", "trainer_threads")
    assert pasted["rollout"] == {k: v for k, v in data["rollout"].items() if k not in test_only}
    assert (
        pasted["timeout_s"] == data["timeout_s"] and "comm" not in pasted
    )  # auto: torch_distributed, rendezvous host
    assert set(pasted["weight_sync"]) == {"directory"}  # auto with a directory: the directory transport
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    doctor = cluster.hosts.run(cluster.trainer, [sys.executable, "-m", "mrl_plugins.cli.main", "doctor", "--config",
                               str(tmp_path / "run.yaml")], timeout=120, env=ray_cluster.env(), capture_output=True,
                               text=True)  # fmt: skip
    ray_lines = [x for x in doctor.stdout.splitlines() if " ray " in f" {x}"]
    want = ["ok    ray cluster", "ok    ray placement", "ok    ray free now"]
    assert [x.split(":")[0] for x in ray_lines] == want, doctor.stdout + doctor.stderr
    assert f"2 of 2 node(s) alive at {HEAD}:{ray_cluster.GCS_PORT}" in ray_lines[0]  # the head and the worker node
    assert f"{cluster.worker_addr} {{CPU 1}}" in ray_lines[0] and "1 bundle(s) {CPU 1} with PACK" in ray_lines[1]
    progress, result = tmp_path / "progress.jsonl", tmp_path / "r.json"
    cmd = [sys.executable, "-m", "mrl_plugins.run", "--config", str(tmp_path / "run.yaml"), "--json", str(result),
           "--progress", str(progress)]  # fmt: skip
    trainer = cluster.hosts.popen(
        cluster.trainer, cmd, cwd=tmp_path, env=ray_cluster.env(PYTHONFAULTHANDLER="1"), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    cluster.seen_pids.append(trainer.pid)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in trainer.stdout], daemon=True)
    reader.start()
    first = cluster.wait_actor(180)  # placed on the worker node: the head has no CPU to offer
    deadline = time.monotonic() + 240
    while _steps_done(progress) < KILL_AT and trainer.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert trainer.poll() is None and _steps_done(progress) >= KILL_AT, "the run did not reach the kill point"
    os.kill(first, 9)  # the actor's process, mid-run
    second = cluster.wait_actor(120, other_than=first)  # Ray restarted it
    trainer.wait(300)
    reader.join(10)
    out = "".join(lines.queue)
    assert trainer.returncode == 0, out[-4000:]
    assert re.search(rf"rollout worker 0: Ray actor \w+ on node {re.escape(cluster.worker_addr)} ", out), out[-4000:]
    assert "a restarted process (incarnation 2) rejoined the pool" in out
    res = json.loads(result.read_text())
    m = res["mrl_metrics"]
    assert res["steps"] == STEPS and m["mrl/rollout/worker_restarts"] == 1
    logs = [ast.literal_eval(line) for line in out.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == STEPS and max(float(g["mrl/rollout/staleness"]) for g in logs) <= 1
    # every batch the trainer took was answered once: one frame per generation (none lost to the kill: its chunk
    # went to the restarted process), a duplicate answer is counted, never used twice
    assert m["mrl/comm/frames"] - m.get("mrl/rollout/duplicate_batches", 0) == STEPS, m
    # each incarnation (Ray's log of its process) switched to every version it saw in order; the restarted one
    # starts from the current version and reaches the last ones
    logs_by_pid = cluster.worker_logs()
    switches = {
        pid: [(int(a), int(b)) for a, b in re.findall(r"switch model_id=policy (-?\d+) -> (\d+)", logs_by_pid[pid])]
        for pid in (first, second)
    }
    for pid, seq in switches.items():
        versions = [b for _, b in seq]
        assert versions and versions == sorted(set(versions)), (pid, seq)
    assert switches[second][0][0] == -1 and switches[second][0][1] >= switches[first][-1][1]  # a fresh copy
    assert switches[second][-1][1] >= STEPS - 2
    r = res["rewards"]
    assert sum(r[-5:]) / 5 > sum(r[:5]) / 5 + 0.05, r  # it learns, as with a local worker


class Pool(two_hosts.ScriptDriver):
    """tests/scripts/netns_pool.py in the trainer's namespace: a WorkerPool whose worker Ray places and starts."""

    def __init__(self, cluster, config: dict, log: Path) -> None:
        out = open(log, "w")  # noqa: SIM115 - closed in close()
        proc = cluster.hosts.popen(
            cluster.trainer, [sys.executable, SCRIPT, json.dumps(config)], env=ray_cluster.env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out, text=True,
        )  # fmt: skip
        cluster.seen_pids.append(proc.pid)
        super().__init__(proc, out, ready_timeout=240)

    def __call__(self, op: str, timeout: float = 120, **kw) -> dict:
        return super().__call__(op, timeout, **kw)

    def close(self) -> float:
        """Close the pool (its actors, placement group and Ray connection); seconds until the process was gone."""
        return self.close_script(60)


@require_ray
@require_trl
def test_killed_actor_with_broadcast_weights_is_one_clear_error(cluster, tmp_path):
    config = _config(tmp_path, timeout_s=30)
    config["weight_sync"] = {"transport": "broadcast", "timeout_s": 30.0}
    config["comm"] = {"codec": "raw"}  # the logprobs exact (fp16 on the wire by default across hosts)
    pool = Pool(cluster, config, tmp_path / "trainer.log")
    assert pool("publish", v=1)["ok"]
    got = pool("collect", v=1, timeout=180)
    assert got["ok"] and got["max_err"] < 1e-4, got  # the worker on the Ray node generates with version 1
    os.kill(cluster.wait_actor(10), 9)
    got = pool("collect", v=1, timeout=120)
    assert not got["ok"], got
    died = r"WorkerDiedError: rollout worker 0 \(Ray actor \w+ on node 10\.79\.0\.2\) died: .+; not restarted: "
    assert re.search(died + r"weight_sync or comm ends that are not rejoinable", got["error"]), got
    assert got["s"] < 30  # Ray reports the death: well before rollout.timeout_s
    assert cluster.actor_pids() == []  # max_restarts 0: Ray did not start it again
    assert pool.close() < 30


FIRST, SECOND = sorted(os.sched_getaffinity(0))[:2] if len(os.sched_getaffinity(0)) > 1 else (0, 0)


@require_ray
@require_trl
@pytest.mark.skipif(FIRST == SECOND, reason="Ray's cores and the worker's apart need 2 cores")
@pytest.mark.parametrize("cluster", [{"ray_cores": [FIRST]}], indirect=True)
def test_worker_node_stopped_is_a_clear_error_within_the_timeout(cluster, tmp_path):
    """Its worker node's Ray runs on the first core only (`taskset -c`), the actor on the second
    (``rollout.ray_worker_cores``): Ray's processes there never share the worker's core."""
    timeout_s = 12.0
    pool = Pool(cluster, _config(tmp_path, timeout_s=timeout_s, ray_worker_cores=[SECOND]), tmp_path / "trainer.log")
    assert pool("publish", v=1)["ok"]
    assert pool("collect", v=1, timeout=180)["ok"]
    actor = cluster.wait_actor(10)
    threads = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{actor}/task")}
    assert all(cores == {SECOND} for cores in threads.values()), threads  # the actor's process: the worker's core
    ray_own = {pid: os.sched_getaffinity(pid) for pid in cluster.pids(cluster.worker) if pid != actor}
    assert ray_own and all(cores == {FIRST} for cores in ray_own.values()), ray_own  # raylet, agents, idle workers
    cluster.stop_worker_node()  # raylet, agents and the actor: the node is gone, without a goodbye
    got = pool("collect", v=1, timeout=120)
    assert not got["ok"], got
    assert "WorkerDiedError: remote rollout worker 0 stopped heartbeating" in got["error"] or (
        "lost its node and Ray cannot place it again" in got["error"]
    ), got
    assert got["s"] < timeout_s + 6, got  # at rollout.timeout_s (plus the liveness checks' granularity)
    assert pool.close() < 30  # nothing hangs: the actor, its placement group and the connection are released
