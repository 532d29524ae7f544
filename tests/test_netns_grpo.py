"""The multi-host config of docs/multi-host.md, run as pasted: a GRPO run across two network hosts (Linux network
namespaces on a veth link, 1 Gbit/s tbf): the trainer (`mrl run`) in one namespace, `mrl worker --connect` in
the other; experience over torch_distributed, weights over the broadcast transport (no shared filesystem: the
worker has no weight directory at all)."""

from __future__ import annotations

import ast
import json
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests import doc_blocks
from tests import netns as two_hosts
from tests.marks import require_trl

MULTI_HOST = "docs/multi-host.md"  # the README links it

pytestmark = [pytest.mark.slow]
hosts = two_hosts.hosts  # the fixture

STEPS = 20


def test_harness_joins_two_hosts_by_a_shaped_link_and_cuts_it(hosts):
    stale = f"mrl-{(1 << 22) + 1}-0-t"  # a harness killed before its teardown (that pid cannot exist)
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    h = hosts(1, rate="200mbit")
    assert stale not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    srv = h.popen(h.trainer, [sys.executable, "-c", (
        "import socket,time\ns=socket.create_server(('10.77.0.1',5001))\nc,_=s.accept()\nn,t=0,time.monotonic()\n"
        "while b:=c.recv(1<<20): n+=len(b)\nprint(n, n*8/(time.monotonic()-t))")],
        stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.5)
    send = "import socket\ns=socket.create_connection(('10.77.0.1',5001),timeout=10)\ns.sendall(b'x'*20_000_000)"
    h.run(h.worker_ns[0], [sys.executable, "-c", send], timeout=30, check=True)
    n, bps = srv.communicate(timeout=30)[0].split()
    assert int(n) == 20_000_000 and 100e6 < float(bps) < 230e6  # the link is shaped to 200 Mbit/s
    # the hosts' addresses exist only inside their namespaces, not in this (the root) one
    assert "10.77.0." not in subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True, timeout=10).stdout
    routes = h.run(h.worker_ns[0], ["ip", "route"], timeout=10, capture_output=True, text=True).stdout
    assert "default" not in routes and "10.77.0.0/24" in routes  # and they reach nothing else
    h.link(False)
    probe = "import socket\nsocket.create_connection(('10.77.0.1',5002),timeout=2)"
    cut = h.run(h.worker_ns[0], [sys.executable, "-c", probe], timeout=30, capture_output=True, text=True)
    assert cut.returncode != 0 and ("timed out" in cut.stderr or "unreachable" in cut.stderr), cut.stderr


def _readme_config(steps: int) -> str:
    """docs/multi-host.md's config as pasted, on the harness's addresses, with a short run of the tiny model."""
    data = yaml.safe_load(
        doc_blocks.block("Workers on other hosts", "yaml", MULTI_HOST).replace("10.0.0.1", two_hosts.TRAINER)
    )
    assert data["rollout"]["rendezvous"] == f"{two_hosts.TRAINER}:{two_hosts.RENDEZVOUS_PORT}"
    data["rollout"].update(local_warmup=False, engine_threads=1, trainer_threads=1)
    data["train"] = {"model": "tiny", "steps": steps}
    return yaml.safe_dump(data)


@require_trl
def test_grpo_trains_across_hosts_with_weights_broadcast_over_the_link(hosts, tmp_path):
    h = hosts(1, rate="1gbit")
    (tmp_path / "run.yaml").write_text(_readme_config(STEPS))
    assert f"mrl worker --connect 10.0.0.1:{two_hosts.RENDEZVOUS_PORT} --index 0" in doc_blocks.text(MULTI_HOST)
    wdir = tmp_path / "worker"  # the worker's own folder: nothing shared with the trainer's
    wdir.mkdir()
    env = two_hosts.child_env(PYTHONFAULTHANDLER="1")
    trainer = h.popen(
        h.trainer, two_hosts.mrl("run", "--config", str(tmp_path / "run.yaml"), "--json", str(tmp_path / "r.json")),
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    worker = h.popen(
        h.worker_ns[0],
        two_hosts.mrl("worker", "--connect", f"10.77.0.1:{two_hosts.RENDEZVOUS_PORT}", "--index", "0",
                      "--threads", "1", "--timeout", "120"),
        cwd=wdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        tout, _ = trainer.communicate(timeout=300)
        try:
            wout, _ = worker.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            worker.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack into its output
            pytest.fail(f"the worker did not leave after the run: {worker.communicate(timeout=10)[0][-3000:]}")
    finally:
        for p in (trainer, worker):
            if p.poll() is None:
                p.kill()
    assert trainer.returncode == 0, tout[-3000:]
    assert worker.returncode == 0, wout[-3000:]  # it took its stop and left
    res = json.loads((tmp_path / "r.json").read_text())
    m = res["mrl_metrics"]
    assert res["steps"] == STEPS and m["mrl/comm/frames"] == STEPS and m["mrl/comm/corrupt"] == 0
    assert m["mrl/weights/version"] == STEPS - 1  # a version per step, published over the link
    # the worker switched to every version in order, each a full copy of the weights
    found = re.findall(r"switch model_id=policy (-?\d+) -> (\d+) bytes=(\d+)", wout)
    switches = [(int(a), int(b), int(n)) for a, b, n in found]
    assert [b for _, b, _ in switches] == sorted({b for _, b, _ in switches}) and switches[-1][1] >= STEPS - 2
    assert len({n for *_, n in switches}) == 1 and switches[0][2] > 100_000
    logs = [ast.literal_eval(line) for line in tout.splitlines() if line.startswith("{'loss'")]
    assert len(logs) == STEPS and max(float(g["mrl/rollout/staleness"]) for g in logs) <= 1  # version tags right
    r = res["rewards"]
    assert sum(r[-5:]) / 5 > sum(r[:5]) / 5 + 0.05, r  # the reward learns, as on one host
