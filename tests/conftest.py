"""Shared fixtures: a fresh plugin manager per call, and a shared-memory leak check over the whole session."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# TRL's experimental modules warn on import; with ``filterwarnings = error`` that would fail tests.
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("mrl", "psm_")

#: environment variables that change what a plugin manager loads; cleared for every ``fresh_pm`` test
PLUGIN_ENV_VARS = ("MRL_PLUGINS", "MRL_DISABLED_PLUGINS", "MRL_DISABLE_PLUGIN_AUTOLOAD")


def _shm_names() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIXES)}


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    """Fail the session if /dev/shm gained ``mrl*`` / ``psm_*`` entries that the tests did not unlink.

    Segments that disappear within a second of the end are not counted (a peer still unlinking).
    """
    before = _shm_names()
    yield
    leaked = _shm_names() - before
    if leaked:
        time.sleep(1.0)
        leaked &= _shm_names()
    if leaked:
        pytest.fail(f"shared memory left in {SHM_DIR} by the test session: {', '.join(sorted(leaked))}")


@pytest.fixture
def fresh_pm(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """Factory ``fresh_pm(config=None, **kw)``: a NEW :func:`~mrl_plugins.manager.get_plugin_manager` per call.

    The ``MRL_*`` plugin variables of the outer environment are removed first, so a test sees only
    what it sets itself (with ``monkeypatch.setenv`` after requesting this fixture).
    """
    for var in PLUGIN_ENV_VARS:
        monkeypatch.delenv(var, raising=False)

    def make(config: Any = None, **kw: Any) -> Any:
        from mrl_plugins.manager import get_plugin_manager

        return get_plugin_manager(config, **kw)

    return make
