"""Shared fixtures: a fresh plugin manager per call, and a shared-memory leak check over the whole session."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# TRL's experimental modules warn on import; with ``filterwarnings = error`` that would fail tests.
os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
# The tests set internal config values (derived or constant for users: mrl_plugins.config_fields) in their configs,
# in this process and in the runs they start; the tests of what a user's config may set remove it
# (``user_config`` fixture).
os.environ["MRL_ALLOW_INTERNAL_KEYS"] = "1"

REPO_ROOT = Path(__file__).resolve().parents[1]


def benchmarks_command(*args: str) -> list[str]:
    """``python -m benchmarks ARGS``: the lab of this checkout (never installed) as a command line; run it with
    ``env=benchmarks_env()`` (the checkout on ``PYTHONPATH``, whatever the working directory)."""
    return [sys.executable, "-m", "benchmarks", *args]


def benchmarks_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this environment) with the checkout first on ``PYTHONPATH`` (what ``python -m benchmarks``
    needs)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def pytest_configure(config: pytest.Config) -> None:
    """Ctrl-C as in a terminal's foreground job, even when the tests run as a background job (a shell starts those
    with SIGINT ignored, and every process they start, spawned workers and the Ctrl-C tests' trainers included,
    would inherit it: the plugin rightly respects a signal its process chose to ignore)."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


SHM_DIR = Path("/dev/shm")
SHM_PREFIXES = ("mrl", "psm_")

#: environment variables that change what a plugin manager loads; cleared for every ``fresh_pm`` test
PLUGIN_ENV_VARS = ("MRL_PLUGINS", "MRL_DISABLED_PLUGINS", "MRL_DISABLE_PLUGIN_AUTOLOAD")


def _shm_names() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(SHM_PREFIXES)}


def _shm_in_use_elsewhere(names: set[str]) -> set[str]:
    """Those of ``names`` that a live process outside this one maps or holds open (another test session's)."""
    me = os.getpid()
    wanted = {str(SHM_DIR / n): n for n in names}
    used: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == me:
            continue
        try:
            with open(proc / "maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    path = line.rstrip("\n").split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                    if path in wanted:
                        used.add(wanted[path])
            for fd in (proc / "fd").iterdir():
                target = os.readlink(fd)
                if target in wanted:
                    used.add(wanted[target])
        except OSError:
            continue
    return used


@pytest.fixture(scope="session", autouse=True)
def no_leaked_shared_memory() -> Iterator[None]:
    """Fail the session if /dev/shm gained ``mrl*`` / ``psm_*`` entries that the tests did not unlink.

    Not counted: segments that disappear within a second of the end (a peer still unlinking) and
    segments that a live process outside this session maps or holds open (another test run on the
    same machine). Every process this session started has been joined by then.
    """
    before = _shm_names()
    yield
    leaked = _shm_names() - before
    if leaked:
        time.sleep(1.0)
        leaked &= _shm_names()
        leaked -= _shm_in_use_elsewhere(leaked)
    if leaked:
        pytest.fail(f"shared memory left in {SHM_DIR} by the test session: {', '.join(sorted(leaked))}")


@pytest.fixture
def user_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Configs load as a user's do: internal values are refused (``MRL_ALLOW_INTERNAL_KEYS`` unset)."""
    monkeypatch.delenv("MRL_ALLOW_INTERNAL_KEYS", raising=False)


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


@pytest.fixture
def install_dist(tmp_path, monkeypatch):
    """Install a real distribution with ``mrl_plugins`` entry points on a temporary ``sys.path`` entry.

    ``install_dist(name, {ep_name: "module:attr"}, {module: source})``; modules are removed from
    ``sys.modules`` afterwards.
    """
    modules: list[str] = []

    def install(dist: str, entry_points: dict[str, str], sources: dict[str, str]) -> Path:
        root = tmp_path / f"site-{dist}"
        info = root / f"{dist}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n", encoding="utf-8")
        lines = "".join(f"{k} = {v}\n" for k, v in entry_points.items())
        (info / "entry_points.txt").write_text(f"[mrl_plugins]\n{lines}", encoding="utf-8")
        for module, source in sources.items():
            (root / f"{module}.py").write_text(textwrap.dedent(source), encoding="utf-8")
            modules.append(module)
        monkeypatch.syspath_prepend(str(root))
        importlib.invalidate_caches()
        return root

    yield install
    for module in modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()


@pytest.fixture
def keep_arrangement(monkeypatch: pytest.MonkeyPatch) -> None:
    """``rollout.placement: auto`` takes, logs and reports its decisions but keeps the current arrangement: for runs
    that switch only by ``PlacementController.force`` (on a busy host the controller would rightly move them)."""
    import dataclasses

    from mrl_plugins.rollout import autoplace

    real = autoplace.decide
    monkeypatch.setattr(autoplace, "decide", lambda cur, *a, **k: dataclasses.replace(real(cur, *a, **k), chosen=cur))
