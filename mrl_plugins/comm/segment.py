"""The comm stage's shared-memory pieces: segment names under the ``comm`` stage and wake-up FIFOs.

Segments, their naming, the stale sweep and the cleanup at exit/SIGTERM/SIGINT are the one implementation in
:mod:`mrl_plugins.shmem` (shared with the weight-sync stage); this module names comm's segments
``mrl-comm-<run_id>-p<pid>-<8 hex>[.<role>]`` and adds the FIFOs the shm ring sleeps on.
"""

from __future__ import annotations

import os
import select

from mrl_plugins.shmem import Segment, check_run_id, register, remove_stale, shm_dir, unlink  # noqa: F401 - re-exported
from mrl_plugins.shmem import new_path as _new_path

STAGE = "comm"


def new_path(run_id: str, role: str = "") -> str:
    """A fresh comm segment path owned by this process."""
    return _new_path(STAGE, run_id, role)


def make_fifo(path: str) -> int:
    """Create a FIFO owned by this process (registered for cleanup) and open it read-write, non-blocking."""
    os.mkfifo(path, 0o600)
    register(path)
    return open_fifo(path)


def open_fifo(path: str) -> int:
    """Open an existing FIFO read-write and non-blocking (never blocks, never gets EPIPE)."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK)


def kick(fd: int) -> None:
    """Wake whoever waits on the FIFO ``fd`` (a full FIFO is readable already, so EAGAIN is fine)."""
    try:
        os.write(fd, b"\0")
    except (BlockingIOError, OSError):
        pass


def wait_fd(fd: int, timeout: float) -> None:
    """Block until the FIFO ``fd`` has bytes or ``timeout`` s passed, then drain it."""
    if timeout > 0:
        r, _, _ = select.select([fd], [], [], timeout)
        if not r:
            return
    try:
        os.read(fd, 65536)
    except (BlockingIOError, OSError):
        pass
