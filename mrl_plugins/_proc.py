"""Waiting on another process: its liveness (shared by the shared-memory transports) and one bounded poll loop."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from mrl_plugins.errors import StageTimeoutError

T = TypeVar("T")


def pid_alive(pid: int) -> bool:
    """True when ``pid`` exists on this host and is not a zombie (an exited, unreaped child counts as dead)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return True


def pid_namespace() -> int | None:
    """The inode of this process's pid namespace: a pid means something only inside it (containers sharing one
    ``/dev/shm`` or one folder each have their own); None where it cannot be known (no ``/proc``)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def wait_until(
    ready: Callable[[], T | None],
    deadline: float,
    what: str | Callable[[], str],
    *,
    check: Callable[[], None] | None = None,
    sleep: float = 0.001,
    max_sleep: float | None = None,
) -> T:
    """Call ``ready()`` until it returns something other than ``None``, and return that.

    After each ``None``: ``check()`` (when given; it raises to stop early, e.g. on a dead peer), then
    :class:`StageTimeoutError` with the message ``what`` (or ``what()``) once ``time.monotonic()`` is past
    ``deadline``, then a sleep of ``sleep`` s, doubling on every round up to ``max_sleep`` (default: ``sleep``).
    """
    most = sleep if max_sleep is None else max_sleep
    while True:
        got = ready()
        if got is not None:
            return got
        if check is not None:
            check()
        if time.monotonic() > deadline:
            raise StageTimeoutError(what() if callable(what) else what)
        time.sleep(sleep)
        sleep = min(sleep * 2, most)
