"""Process-liveness helper shared by the shared-memory transports (experience ring and weight segments)."""

from __future__ import annotations

import os


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
