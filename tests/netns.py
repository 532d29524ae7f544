"""Two-host harness for the tests: network namespaces from :mod:`benchmarks.netns`, always torn down.

``hosts`` is a fixture factory: ``hosts(workers=1, rate="1gbit")`` makes a trainer namespace and worker
namespaces on a veth bridge (10.77.0.0/24, nothing else is ever addressed) and deletes them when the test
ends, passed or failed (also under ``pytest -x``). Tests using it skip, saying why, where namespaces cannot
be made (not root). The child processes get this environment minus torch.distributed's rendezvous
variables and with one thread each.
"""

from __future__ import annotations

import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from benchmarks import netns

TRAINER = netns.TRAINER_ADDR
RENDEZVOUS_PORT = 29555  # inside the trainer's own namespace: nothing else listens there
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def mrl(*args: str) -> list[str]:
    """The ``mrl`` CLI as a command line (this interpreter)."""
    return [sys.executable, "-m", "mrl_plugins.cli.main", *args]


@pytest.fixture
def hosts() -> Iterator[Callable[..., netns.Hosts]]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two-host tests need network namespaces: {why}")
    made: list[netns.Hosts] = []

    def make(workers: int = 1, **shaping: Any) -> netns.Hosts:
        h = netns.Hosts(workers, **shaping)
        made.append(h)
        return h

    try:
        yield make
    finally:
        for h in made:
            h.close()
        assert not netns.leftover(), f"namespaces left behind: {netns.leftover()}"


class ScriptDriver:
    """A script started in a namespace (``tests/scripts/netns_pool.py``) speaking JSON lines: one command in on its
    stdin, one answer out on its stdout (other output goes to ``log``)."""

    def __init__(self, proc: Any, log: Any, ready_timeout: float) -> None:
        self.proc, self.log = proc, log
        self.lines: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        got = self.answer(ready_timeout)
        assert "ready" in got, got

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))

    def answer(self, timeout: float) -> dict:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the trainer did not answer within {timeout} s (it hangs)") from None

    def send(self, op: str, **kw: Any) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def __call__(self, op: str, timeout: float = 60, **kw: Any) -> dict:
        self.send(op, **kw)
        return self.answer(timeout)

    def close_script(self, timeout: float) -> float:
        """Ask the script to close its pool; seconds until its process was gone."""
        t0 = time.monotonic()
        got = self("close", timeout=timeout)
        assert got["ok"], got
        self.proc.wait(timeout)
        self.reader.join(10)
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.log.close()
        return time.monotonic() - t0
