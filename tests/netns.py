"""Two-host harness for the tests: network namespaces from :mod:`mrl_plugins.bench.netns`, always torn down.

``hosts`` is a fixture factory: ``hosts(workers=1, rate="1gbit")`` makes a trainer namespace and worker
namespaces on a veth bridge (10.77.0.0/24, nothing else is ever addressed) and deletes them when the test
ends, passed or failed (also under ``pytest -x``). Tests using it skip, saying why, where namespaces cannot
be made (not root). The child processes get this environment minus torch.distributed's rendezvous
variables and with one thread each.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from mrl_plugins.bench import netns

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
