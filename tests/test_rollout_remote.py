"""Remote rollout workers: a separate `mrl worker` process joins the trainer's pool through the rendezvous
store (as it would from another host), gets weights from a directory and sends experience over
torch.distributed (gloo). Real processes, real sockets; localhost stands in for the other host."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.marks import require_trl
from tests.pool_helpers import make_pool

pytestmark = [require_trl, pytest.mark.slow]

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def _remote_pool(tmp_path, timeout_s=60.0, restarts=0, **rollout):
    cfg = {
        "rollout": {
            "remote_workers": 1,
            "rendezvous": "127.0.0.1:0",
            "timeout_s": timeout_s,
            "restart_workers": restarts,
            **rollout,
        },  # fmt: skip
        "comm": {"transport": "torch_distributed", "codec": "raw"},
        "weight_sync": {"transport": "directory", "directory": str(tmp_path / "weights")},
    }
    return make_pool(cfg, placements=[])


def _start_worker(pool) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    address = pool.workers.remote.address
    cmd = [sys.executable, "-m", "mrl_plugins.cli.main", "worker", "--connect", address, "--index", "0",
           "--threads", "1", "--timeout", "60"]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def train_with_remote_worker(trainer) -> None:
    """``trainer.train()`` with worker 0 of its enabled remote pool started by hand (``mrl worker --connect``); the
    worker takes its stop when train() shuts the pool down and exits 0."""
    proc = _start_worker(trainer._mrl_state.runtime.pool)
    try:
        trainer.train()
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, out[-3000:]


def test_a_taken_rendezvous_port_releases_the_pools_ends(tmp_path, monkeypatch):
    """The rendezvous store cannot listen (its port is taken): the pool's ends are closed before the error."""
    import socket

    from mrl_plugins.comm.dist_transport import DistConsumer

    consumers: list[DistConsumer] = []
    handle = DistConsumer.producer_handle

    def record(self, i):
        consumers.append(self)
        return handle(self, i)

    monkeypatch.setattr(DistConsumer, "producer_handle", record)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = {
            "rollout": {"remote_workers": 1, "rendezvous": f"127.0.0.1:{taken.getsockname()[1]}", "timeout_s": 10},
            "comm": {"transport": "torch_distributed", "codec": "raw"},
            "weight_sync": {"transport": "directory", "directory": str(tmp_path / "weights")},
        }
        try:
            make_pool(cfg, placements=[])
        except Exception as exc:  # noqa: BLE001 - the store's error; the pool's frames are still alive here
            assert "EADDRINUSE" in str(exc), exc
            assert consumers and consumers[0]._closing.is_set()  # closed by the failed start, not by a later gc
        else:
            pytest.fail("the pool started on a taken rendezvous port")


def test_remote_worker_generates_with_published_weights_and_stops_cleanly(tmp_path):
    from mrl_plugins.rollout.engine import TransformersEngine

    pool, model, tok, sampling, *_ = _remote_pool(tmp_path)
    proc = _start_worker(pool)
    try:
        pool.publish(2, list(model.named_parameters()))
        res = pool.collect(pool.submit(PROMPTS, 2, min_version=2))
        assert res.weight_version == 2 and pool.pids == []  # nothing spawned here
        local = TransformersEngine(model, tok, params=sampling, seed=0).generate(PROMPTS, 2)
        assert res.completion_ids == local.completion_ids  # same weights, same seed: the same samples
        for a, b in zip(res.logprobs, local.logprobs):
            assert a == pytest.approx(b, abs=1e-5)
    finally:
        pool.close()
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out[-3000:]  # it took its stop and left


def test_dead_remote_worker_is_a_clear_error_within_the_timeout(tmp_path):
    from mrl_plugins.rollout.pool import WorkerDiedError

    pool, model, *_ = _remote_pool(tmp_path, timeout_s=4.0)
    proc = _start_worker(pool)
    try:
        pool.publish(0, list(model.named_parameters()))
        # the worker's start (spawn, imports, first weights) may take longer than the 4 s liveness timeout
        # on a loaded host: the first answer gets its own deadline, the death below gets rollout.timeout_s
        pool.collect(pool.submit(PROMPTS, 1), timeout=120)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="remote rollout worker 0 stopped heartbeating"):
            pool.collect(pool.submit(PROMPTS, 1), timeout=30)
        assert time.monotonic() - t0 < 15
    finally:
        pool.close(timeout=2)
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)  # reap it and close its pipe


def test_remote_worker_started_again_rejoins_with_the_current_version(tmp_path):
    """A SIGKILLed `mrl worker` started again (as Ray restarts an actor) joins as the next incarnation of its index:
    the chunk its predecessor left unanswered goes to it, it generates with the latest version, the restart is
    counted; rejoinable ends (directory weights, torch_distributed experience) make that possible."""
    from mrl_plugins.rollout.engine import TransformersEngine

    pool, model, tok, sampling, _pm, ctx = _remote_pool(tmp_path, timeout_s=30.0, restarts=1)
    procs = [_start_worker(pool)]
    try:
        pool.publish(1, list(model.named_parameters()))
        assert pool.collect(pool.submit(PROMPTS, 1, min_version=1), timeout=120).weight_version == 1
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(10)
        with torch_no_grad():
            for p in model.parameters():
                p.mul_(1.01)  # version 2 generates differently from version 1
        pool.publish(2, list(model.named_parameters()))
        ticket = pool.submit(PROMPTS, 2, min_version=2)  # queued for the dead incarnation
        procs.append(_start_worker(pool))
        res = pool.collect(ticket, timeout=120)
        assert res.weight_version == 2 and ctx.metrics.snapshot()["mrl/rollout/worker_restarts"] == 1
        local = TransformersEngine(model, tok, params=sampling, seed=0).generate(PROMPTS, 2)
        assert res.completion_ids == local.completion_ids  # the restarted worker holds version 2's weights
        assert pool.consumer.stats()["frames"] == 2  # the unanswered chunk was generated once, by the new process
    finally:
        pool.close(timeout=5)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=10)
    assert procs[1].returncode == 0  # the restarted worker took its stop and left


def torch_no_grad():
    import torch

    return torch.no_grad()


def test_remote_workers_need_transports_that_reach_other_hosts():
    from mrl_plugins.errors import ConfigError

    # the transports left at auto cross hosts with remote workers; chosen by hand, one that cannot is refused
    with pytest.raises(ConfigError, match=r"remote_workers: .* need comm and weight-sync ends that reach other hosts"):
        make_pool({"rollout": {"remote_workers": 1}, "comm": {"transport": "shm"}}, placements=[])
    with pytest.raises(ConfigError, match="rollout.rendezvous: expected HOST:PORT"):
        make_pool({"rollout": {"remote_workers": 1, "rendezvous": "nohost"}}, placements=[])
    # a trainer that listens for other hosts must give them an experience address they reach (refused before any
    # socket is opened; the address is never contacted): only a config that sets the derived comm.host can miss
    cross = {"rollout": {"remote_workers": 1, "rendezvous": "10.77.0.1:0"}, "comm": {"host": "127.0.0.1"}}
    with pytest.raises(ConfigError, match=r"comm.host is '127.0.0.1', which workers on other hosts cannot reach"):
        make_pool(cross, placements=[])


def test_grpo_trains_with_a_remote_worker(tmp_path):
    import torch

    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": "tiny", "steps": 4, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    mrl_plugins.enable(
        trainer,
        {
            "mode": "disaggregated",
            "rollout": {"workers": 0, "remote_workers": 1, "local_warmup": False, "timeout_s": 60},
            "comm": {"transport": "torch_distributed"},
            "weight_sync": {"transport": "directory", "directory": str(tmp_path / "weights")},
        },
    )
    train_with_remote_worker(trainer)
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hist) == 4 and max(h["mrl/rollout/staleness"] for h in hist) <= 1
    assert sum(h.get("mrl/rollout/lookahead_hits", 0) for h in hist) >= 2


def _worker_command(address: str, index: int, *options: str) -> list[str]:
    worker = [sys.executable, "-m", "mrl_plugins.cli.main", "worker"]
    return [*worker, "--connect", address, "--index", str(index), *options]


def test_an_index_the_trainer_lacks_fails_at_once_naming_the_valid_ones(tmp_path):
    """The trainer lists its remote workers' indices as its store opens: `mrl worker --index 5` for a trainer with one
    remote worker (index 0) fails as soon as it connects, naming the valid index, instead of waiting its --timeout."""
    pool, *_ = _remote_pool(tmp_path)
    address = pool.workers.remote.address
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            _worker_command(address, 5, "--timeout", "300"), capture_output=True, text=True, timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        took = time.monotonic() - t0
        assert pool.workers.remote.joined(0) == 0  # it took no worker's place
    finally:
        pool.close(timeout=2)
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.strip().splitlines() == [
        f"mrl worker: error: worker index 5: the trainer at {address} has remote workers 0 only"
    ]
    assert took < 60  # not the --timeout of 300 s


def test_a_failing_worker_says_why_and_the_trainer_reports_it(tmp_path):
    """The worker loop fails after the worker joined (the trainer's rollout.engine_threads exceeds this host's
    cores: the compute budget refuses it): `mrl worker` prints the reason as its last line and exits 3, and the
    trainer's wait for the workers raises the same reason (before: exit 3 and nothing said on the worker's side)."""
    from mrl_plugins.rollout.pool import WorkerDiedError

    n = len(os.sched_getaffinity(0))
    pool, *_ = _remote_pool(tmp_path, engine_threads=n + 1)
    cmd = _worker_command(pool.workers.remote.address, 0, "--timeout", "60")
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE, text=True)
    why = f"ConfigError: budget.threads={n + 1} exceeds the {n} cores it may run on; use at most {n}"
    try:
        with pytest.raises(WorkerDiedError, match=f"rollout worker 0 failed: {why}"):
            pool.wait_ready()
        _, err = proc.communicate(timeout=60)
    finally:
        pool.close(timeout=2)
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 3, err[-3000:]
    assert err.strip().splitlines()[-1] == f"mrl worker: error: worker 0 failed: {why}"  # the traceback before it


TRAINER_WITHOUT_ITS_WORKER = """
import sys

from mrl_plugins.errors import StageTimeoutError
from tests.pool_helpers import make_pool

cfg = {
    "rollout": {"remote_workers": 1, "rendezvous": "127.0.0.1:0", "timeout_s": 2.0, "start_timeout_s": 3.0},
    "comm": {"transport": "torch_distributed", "codec": "raw"},
    "weight_sync": {"transport": "directory", "directory": sys.argv[1]},
}
pool = make_pool(cfg, placements=[])[0]
print(pool.workers.remote.address, flush=True)
try:
    pool.wait_ready()
except StageTimeoutError as exc:
    print(exc, flush=True)
finally:
    pool.close(timeout=1)
"""


def test_the_trainer_names_the_worker_command_and_its_timeout_does_too(tmp_path):
    """A trainer process with no logging set up (as a user of enable() runs it): stderr names the `mrl worker`
    command for the remote worker it waits for; once the start bound passed without that worker connecting, the error
    names the command again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", TRAINER_WITHOUT_ITS_WORKER, str(tmp_path / "weights")], capture_output=True,
        text=True, timeout=240, cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    address, error = out.stdout.strip().splitlines()[-2:]
    command = f"mrl worker --connect {address} --index 0"
    assert f"rollout worker 0: waiting for `{command}` on its host" in out.stderr, out.stderr[-3000:]
    assert (
        error
        == f"rollout: remote worker(s) [0] never connected within 3 s (the start bound): run `{command}` on its host"
    )


def test_a_broadcast_publish_that_times_out_names_the_worker_that_never_connected(tmp_path):
    """Weights over broadcast: the trainer's publish waits for the weights' group, which forms only once the remote
    worker joins. Nobody started it: the publish's timeout says which command to run, not only that a peer did not
    answer the group."""
    from mrl_plugins.errors import StageTimeoutError

    pool, model, *_ = make_pool(
        {
            "timeout_s": 3.0,  # the publish's wait for the weights' group
            "rollout": {"remote_workers": 1, "rendezvous": "127.0.0.1:0"},
            "comm": {"transport": "torch_distributed", "codec": "raw"},
            "weight_sync": {"transport": "broadcast"},
        },
        placements=[],
    )
    command = f"mrl worker --connect {pool.workers.remote.address} --index 0"
    try:
        with pytest.raises(
            StageTimeoutError, match=rf"^rollout: remote worker\(s\) \[0\] never connected within .*`{command}`"
        ):
            pool.publish(1, list(model.state_dict().items()))
    finally:
        pool.close(timeout=2)
