"""Corruption on the wire between two network hosts (namespaces): bytes flipped after the sender checksummed them,
as a link that slipped past TCP's checksum would deliver. Experience frames so damaged are counted and dropped,
the rest arrive intact; a weight version so damaged is never switched in, the next one is (the ends of
tests/test_comm_dist.py and tests/test_weight_sync_broadcast.py, here on two hosts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import netns as two_hosts

pytestmark = pytest.mark.slow
hosts = two_hosts.hosts  # the fixture

SCRIPT = str(Path(__file__).parent / "scripts" / "netns_corrupt.py")


def _pair(h, first: str, second: str, key: str) -> tuple[dict, dict]:
    """``first`` in the trainer's namespace, ``second`` in the worker's with ``first``'s handshake ``key``."""
    args = {"host": "10.77.0.1"}
    env = two_hosts.child_env()
    a = h.popen(h.trainer, [sys.executable, SCRIPT, first, json.dumps(args)], env=env, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True)  # fmt: skip
    hello = json.loads(a.stdout.readline() or "{}")
    assert key in hello, a.communicate(timeout=30)[1][-3000:]
    b = h.run(h.worker_ns[0], [sys.executable, SCRIPT, second, json.dumps({**args, key: hello[key]})], timeout=120,
              env=env, capture_output=True, text=True)  # fmt: skip
    assert b.returncode == 0, b.stderr[-3000:]
    out, err = a.communicate(timeout=60)
    assert a.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), json.loads(b.stdout.strip().splitlines()[-1])


def test_corrupted_frames_are_counted_and_dropped_and_corrupted_weights_never_switched_in(hosts):
    h = hosts(1, rate="1gbit")
    cons, prod = _pair(h, "frames-consumer", "frames-producer", "port")
    assert prod["sent"] == 9
    assert cons["good"] == [0, 2, 3, 5, 6, 8] and cons["wrong"] == []  # every intact frame, in order, exact
    assert cons["corrupt"] == 3 and len(cons["refused"]) == 3  # seq 1, 4, 7: counted and dropped
    assert all("torch_distributed producer 0: frame dropped" in e for e in cons["refused"]), cons["refused"]
    sender, receiver = _pair(h, "weights-sender", "weights-receiver", "handle")
    assert all(n > 3 for n in sender["shards"])  # several messages per version
    status, err, unchanged, no_switch, v3 = receiver["report"]
    assert status == "done", receiver
    assert "checksum mismatch in message 2" in err and "version 2" in err and "model_id=policy" in err
    assert unchanged and no_switch  # version 1 stays active, nothing of version 2 switched in
    assert set(v3.values()) == {3.0}  # the stream stayed in step: version 3 arrived whole
