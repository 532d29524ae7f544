"""Faults on the wire between two network hosts (namespaces): a trainer-side WorkerPool
(tests/scripts/netns_pool.py) in one, `mrl worker --connect` in the other, weights over broadcast and
experience over torch_distributed. Each case names the behaviour: a slow lossy link is slower, never wrong;
a brief cut is ridden out; a cut past rollout.timeout_s is one clear error naming the worker, within the
timeout, and nothing hangs. A SIGKILLed remote worker (its connections reset, as over loopback) is the same
error: tests/test_rollout_remote.py::test_dead_remote_worker_is_a_clear_error_within_the_timeout; one pool
start per case costs ~15 s of CI here, so this file starts one."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import netns as two_hosts
from tests.marks import require_trl

pytestmark = [require_trl, pytest.mark.slow]
hosts = two_hosts.hosts  # the fixture

SCRIPT = str(Path(__file__).parent / "scripts" / "netns_pool.py")
TIMEOUT_S = 8.0  # rollout.timeout_s: the remote worker's heartbeat may stop this long


class Trainer(two_hosts.ScriptDriver):
    """The trainer-side script in its namespace: one JSON command in, one JSON answer out."""

    def __init__(self, h, tmp_path) -> None:
        cfg = {
            "rollout": {"remote_workers": 1, "rendezvous": f"10.77.0.1:{two_hosts.RENDEZVOUS_PORT}",
                        "timeout_s": TIMEOUT_S},
            "comm": {"transport": "torch_distributed", "host": "10.77.0.1", "codec": "raw",
                     "heartbeat_timeout_s": 30.0},
            "weight_sync": {"transport": "broadcast", "timeout_s": 30.0},
        }  # fmt: skip
        log = open(tmp_path / "trainer.log", "w")  # noqa: SIM115 - closed in stop()
        proc = h.popen(h.trainer, [sys.executable, SCRIPT, json.dumps(cfg)], env=two_hosts.child_env(),
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True)  # fmt: skip
        super().__init__(proc, log, ready_timeout=120)
        self.worker = h.popen(
            h.worker_ns[0],
            two_hosts.mrl("worker", "--connect", f"10.77.0.1:{two_hosts.RENDEZVOUS_PORT}", "--index", "0",
                          "--threads", "1", "--timeout", "60"),
            env=two_hosts.child_env(), stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def stop(self) -> float:
        """Close the pool; seconds until the trainer process was gone."""
        return self.close_script(30)


def _good(got: dict, version: int) -> None:
    assert got["ok"], got
    assert got["version"] == version and got["n"] == 6
    assert got["max_err"] < 1e-4, got  # the worker's logprobs are the published version's, exactly


def test_lossy_link_brief_cut_then_a_cut_past_the_timeout(hosts, tmp_path):
    h = hosts(1, rate="20mbit", burst="16kb", queue="16kb")  # a slow link whose short queue drops packets
    t = Trainer(h, tmp_path)
    assert t("publish", v=1)["ok"]
    _good(t("collect", v=1, timeout=120), 1)  # the first answer includes the worker's start
    for v in (2, 3):  # slower, never wrong: every version's weights and batches cross the lossy link intact
        assert t("publish", v=v)["ok"]
        _good(t("collect", v=v), v)
    assert h.drops() > 0  # the link did drop packets (TCP resent them)
    h.shape()  # unshaped again
    assert t("publish", v=4)["ok"]
    t.send("collect", v=4, timeout=30)  # in flight while the link is cut for 2 s, well within the 8 s timeout
    h.link(False)
    time.sleep(2.0)
    h.link(True)
    got = t.answer(60)
    _good(got, 4)
    assert got["s"] > 1.5  # it waited for the link, then went on
    h.link(False)  # and now it stays down
    got = t("collect", v=4, timeout=60)
    assert not got["ok"] and "WorkerDiedError: remote rollout worker 0 stopped heartbeating" in got["error"], got
    assert TIMEOUT_S - 1 < got["s"] < TIMEOUT_S + 4  # at rollout.timeout_s, not at the 60 s of the call
    assert t.stop() < 10  # nothing hangs: the pool closes with its worker unreachable
