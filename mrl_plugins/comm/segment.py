"""Shared-memory segments as plain files in ``/dev/shm``, mapped with ``mmap``.

Owning our own files (instead of ``multiprocessing.shared_memory``) keeps Python's
``resource_tracker`` out of the picture: no leak warnings, and no tracker unlinking a segment
behind a live consumer. Names are ``mrl-comm-<run_id>-p<owner pid>-<8 hex>[.<role>]``, so a later
start can remove the segments of crashed runs whose owner pid no longer exists
(:func:`remove_stale`). Owners are unlinked on normal interpreter exit (``atexit``) and on
SIGTERM/SIGINT (handlers installed once, from the main thread, chaining to the previous handler).
"""

from __future__ import annotations

import atexit
import mmap
import os
import re
import secrets
import select
import signal
import tempfile
import threading

import torch

from mrl_plugins.errors import ConfigError

from .base import pid_alive

PREFIX = "mrl-comm-"
_NAME_RE = re.compile(r"^mrl-comm-(?P<run>.+)-p(?P<pid>\d+)-[0-9a-f]{8}(\.[a-z0-9]+)*$")
_RUN_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

_owned: set[str] = set()
_lock = threading.Lock()
_installed = False
_previous: dict[int, object] = {}


def shm_dir() -> str:
    """Directory holding the segments: ``/dev/shm`` where it exists, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def check_run_id(run_id: str) -> str:
    """Validate a run id used in segment names."""
    if not isinstance(run_id, str) or not _RUN_RE.match(run_id):
        raise ConfigError(f"run_id must be 1-64 characters of [A-Za-z0-9_.-], got {run_id!r}")
    return run_id


def new_path(run_id: str, role: str = "") -> str:
    """A fresh segment path owned by this process."""
    suffix = f".{role}" if role else ""
    name = f"{PREFIX}{check_run_id(run_id)}-p{os.getpid()}-{secrets.token_hex(4)}{suffix}"
    return os.path.join(shm_dir(), name)


def remove_stale(directory: str | None = None) -> list[str]:
    """Unlink segments whose owner pid is gone (crashed runs); returns the removed paths."""
    directory = directory or shm_dir()
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m and not pid_alive(int(m.group("pid"))):
            path = os.path.join(directory, name)
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


class Segment:
    """A mapped shared-memory file. ``create`` makes and pre-faults it; ``attach`` maps an existing one."""

    def __init__(self, path: str, mm: mmap.mmap, owner: bool) -> None:
        self.path = path
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self.buf = memoryview(mm)

    @classmethod
    def create(cls, path: str, size: int) -> Segment:
        """Create ``path`` with ``size`` bytes, touch every page once, register it for cleanup."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        register(path)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=_flags())
        except BaseException:
            os.close(fd)
            unlink(path)
            raise
        os.close(fd)
        seg = cls(path, mm, owner=True)
        torch.frombuffer(seg.buf, dtype=torch.uint8).zero_()  # first touch now, not on the hot path
        return seg

    @classmethod
    def attach(cls, path: str) -> Segment:
        """Map an existing segment (raises ``FileNotFoundError`` naming the path if it is gone)."""
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            mm = mmap.mmap(fd, size, flags=_flags())
        finally:
            os.close(fd)
        return cls(path, mm, owner=False)

    def close(self, unlink_file: bool = False) -> None:
        """Unmap (if no view is still exported) and optionally remove the file."""
        buf, self.buf = self.buf, None
        if buf is not None:
            try:
                buf.release()
                self.mm.close()
            except BufferError:
                pass  # views handed out are still alive; the mapping goes with the last of them
        if unlink_file:
            unlink(self.path)


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


def _flags() -> int:
    return mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def unlink(path: str) -> None:
    """Remove a segment file (missing is fine) and forget it."""
    with _lock:
        _owned.discard(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def register(path: str) -> None:
    """Remember ``path`` for removal at exit and on SIGTERM/SIGINT (installs the handlers once)."""
    global _installed
    with _lock:
        _owned.add(path)
        if _installed:
            return
        _installed = True
    atexit.register(unlink_all)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                _previous[sig] = signal.getsignal(sig)
                signal.signal(sig, _on_signal)
            except (ValueError, OSError):  # not allowed here (embedded interpreter)
                _previous.pop(sig, None)


def unlink_all() -> None:
    """Remove every segment this process owns."""
    with _lock:
        paths = list(_owned)
        _owned.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _on_signal(signum: int, frame: object) -> None:
    unlink_all()
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev is None or prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
