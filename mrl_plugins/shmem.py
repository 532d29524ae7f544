"""Shared-memory segments for every stage: one naming scheme, one stale sweep, one cleanup registry.

Segments are plain files in ``/dev/shm`` (the temp dir where there is none) mapped with ``mmap``. Owning the
files ourselves (instead of ``multiprocessing.shared_memory``) keeps Python's ``resource_tracker`` out of the
picture: no leak warnings, and no tracker unlinking a segment behind a live reader.

* **Names**: ``mrl-<stage>-<run_id>-p<owner pid>n<its pid namespace>-<8 hex>[.<role>...]`` (:func:`new_path`),
  e.g. ``mrl-comm-run1-p4242n4026531836-0a1b2c3d.ring``; without ``/proc`` the ``n<...>`` part is left out.
* **Stale sweep**: :func:`remove_stale` unlinks the segments of crashed runs: those whose owner pid, in this
  process's pid namespace, no longer exists. A segment of another namespace (a container sharing ``/dev/shm``)
  is never judged: its pid means nothing here.
* **Cleanup**: a process's own segments (:func:`register`) are removed on normal interpreter exit (``atexit``) and
  on SIGTERM/SIGINT. The handlers are installed once per process, from the main thread, and chain to the
  handlers that were there before (a previous Python handler is called; the default action is re-raised after the
  cleanup). The registry is per process because exit and signals are.
* :class:`Segment`: one mapped file, created (optionally pre-faulted), attached, grown and re-mapped. Its pages are
  reserved when it is created or grown (``posix_fallocate``): a full ``/dev/shm`` is a
  :class:`SharedMemoryFullError` then, never a SIGBUS on a later write into a page the filesystem cannot give.
"""

from __future__ import annotations

import atexit
import errno
import mmap
import os
import re
import secrets
import signal
import struct
import tempfile
import threading
from typing import Any

from mrl_plugins._proc import pid_alive, pid_namespace
from mrl_plugins.errors import ConfigError, MrlError

PREFIX = "mrl-"
_NAME_RE = re.compile(
    r"^mrl-(?P<stage>[a-z]+)-(?P<run>.+)-p(?P<pid>\d+)(n(?P<ns>\d+))?-[0-9a-f]{8}(\.[A-Za-z0-9_]+)*$"
)
_RUN_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def shm_dir() -> str:
    """Directory holding the segments: ``/dev/shm`` where it exists, else the temp dir."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def check_run_id(run_id: str) -> str:
    """Validate a run id used in segment names."""
    if not isinstance(run_id, str) or not _RUN_RE.match(run_id):
        raise ConfigError(f"run_id must be 1-64 characters of [A-Za-z0-9_.-], got {run_id!r}")
    return run_id


def safe_role(text: str) -> str:
    """``text`` reduced to the characters a role part of a name may hold (others become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", str(text))[:48] or "_"


def new_path(stage: str, run_id: str, role: str = "", tag: str | None = None) -> str:
    """A segment path owned by this process (``stage``: lowercase letters; ``role``: dot-separated ``[A-Za-z0-9_]``
    parts, e.g. :func:`safe_role`'s). ``tag`` (8 lowercase hex) defaults to a random one; a fixed tag makes a second
    owner of the same name in this process collide. ``run_id`` is checked (:func:`check_run_id`)."""
    tag = secrets.token_hex(4) if tag is None else tag
    suffix = f".{role}" if role else ""
    ns = pid_namespace()
    owner = f"p{os.getpid()}" if ns is None else f"p{os.getpid()}n{ns}"
    name = f"{PREFIX}{stage}-{check_run_id(run_id)}-{owner}-{tag}{suffix}"
    return os.path.join(shm_dir(), name)


def remove_stale(directory: str | None = None) -> list[str]:
    """Unlink segments (of any stage) whose owner pid in this pid namespace is gone (crashed runs); returns the
    removed paths. A name of another namespace, or one that does not say its namespace, is never judged."""
    directory = directory or shm_dir()
    removed: list[str] = []
    ns = pid_namespace()
    try:
        names = os.listdir(directory) if ns is not None else []
    except OSError:
        return removed
    for name in names:
        m = _NAME_RE.match(name)
        if m is None or m["ns"] is None or int(m["ns"]) != ns or pid_alive(int(m["pid"])):
            continue
        path = os.path.join(directory, name)
        try:
            os.unlink(path)
            removed.append(path)
        except OSError:
            pass
    return removed


# ------------------------------------------------------------------ the cleanup registry (per process)

_owned: set[str] = set()
_lock = threading.Lock()
_exit_hooked = False  # unlink_all registered with atexit
_signals = False  # our SIGTERM/SIGINT handlers installed, chained to _previous
_previous: dict[int, Any] = {}


def register(path: str) -> None:
    """Remember ``path`` for removal at exit and on SIGTERM/SIGINT (installs the handlers once)."""
    with _lock:
        _owned.add(path)
    _install()


def unlink(path: str) -> None:
    """Remove a segment file (missing is fine) and forget it; the last one takes our signal handlers off."""
    with _lock:
        _owned.discard(path)
        last = not _owned
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    if last:
        _handlers_off()


def _handlers_off() -> None:
    """No segment left to remove: our handlers give way to those they chained to, where ours are still the
    process's (on the main thread, the one that may set them; else they stay, harmless)."""
    if not _signals or threading.current_thread() is not threading.main_thread():
        return
    if all(signal.getsignal(sig) is _on_signal for sig in _previous):
        for sig, prev in _previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        forget_signal_handlers()


def unlink_all() -> None:
    """Remove every segment this process owns (mappings stay valid until they are dropped)."""
    with _lock:
        paths = list(_owned)
        _owned.clear()
    for p in paths:
        try:
            os.unlink(p)
        except OSError:
            pass


def _install() -> None:
    global _exit_hooked, _signals
    with _lock:
        if not _exit_hooked:
            _exit_hooked = True
            atexit.register(unlink_all)
        if _signals or threading.current_thread() is not threading.main_thread():
            return
        _signals = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            prev = signal.getsignal(sig)
            if prev is signal.SIG_IGN:
                continue  # the process chose to ignore it (e.g. a worker during start-up): keep that
            _previous[sig] = prev
            signal.signal(sig, _on_signal)
        except (ValueError, OSError):  # not allowed here (embedded interpreter)
            _previous.pop(sig, None)


def forget_signal_handlers() -> None:
    """Ours were taken off and the handlers before them put back (``train()`` ended:
    :func:`~mrl_plugins.adapters.trl_lifetime.train_process_state`): forget what ours chained to (a handler of that
    ``train()``, holding its trainer, which would stay alive until exit); the next segment installs ours again. Where
    ours are still installed (they were before ``train()``), their chain stays."""
    global _signals
    if any(signal.getsignal(sig) is _on_signal for sig in _previous):
        return
    with _lock:
        _previous.clear()
        _signals = False


def _on_signal(signum: int, frame: object) -> None:
    unlink_all()
    prev = _previous.get(signum, signal.SIG_DFL)
    if callable(prev):
        prev(signum, frame)
    elif prev is None or prev == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# ------------------------------------------------------------------ one mapped file


class SharedMemoryFullError(MrlError, OSError):
    """The shared-memory filesystem has no room for a segment (errno ``ENOSPC``)."""


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _allocate(fd: int, path: str, start: int, end: int) -> None:
    """Allocate the file's pages in ``[start, end)`` now (a full filesystem is :class:`SharedMemoryFullError` here,
    not SIGBUS at the first write); a platform or filesystem without ``posix_fallocate`` leaves them sparse."""
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None or end <= start:
        return
    try:
        fallocate(fd, start, end - start)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # a filesystem without it: sparse
            return
        if exc.errno != errno.ENOSPC:
            raise
        folder = os.path.dirname(path) or "."
        try:
            st = os.statvfs(folder)
            free = f"{_mib(st.f_bavail * st.f_frsize)} free of {_mib(st.f_blocks * st.f_frsize)}"
        except OSError:
            free = "free space unknown"
        raise SharedMemoryFullError(
            errno.ENOSPC,
            f"no room in {folder} for shared-memory segment {os.path.basename(path)}: it needs {_mib(end - start)} "
            f"more ({_mib(end)} in all), {free}. Give the container more shared memory (docker run --shm-size=..., "
            "a Kubernetes emptyDir with medium: Memory) or use smaller sizes (comm.slot_bytes / comm.ring_slots, "
            "fewer rollout workers)",
        ) from None


class Segment:
    """A mapped shared-memory file: ``buf`` (memoryview) and ``tensor`` (torch uint8 view) of its bytes.

    :meth:`create` makes it (registered for cleanup; ``prefault`` touches every page once, so the hot path
    does not pay the page faults; its pages are allocated either way); :meth:`attach` maps an existing one;
    :meth:`grow` extends it and :meth:`refresh` re-maps after another process grew it (old mappings stay
    valid until :meth:`close`, for views still handed out). The file descriptor stays open (``flock``).
    """

    def __init__(self, path: str, fd: int, owner: bool, populate: bool) -> None:
        self.path, self.fd, self.owner, self._populate = path, fd, owner, populate
        self._old: list[mmap.mmap] = []
        self.allocated = 0  # bytes known allocated (a writer's: create, allocate)
        self.buf: memoryview | None = None
        self._tensor: Any = None
        self._map(os.fstat(fd).st_size)

    @classmethod
    def create(cls, path: str, size: int, *, prefault: bool = True) -> Segment:
        """Create ``path`` with ``size`` bytes (allocated: :class:`SharedMemoryFullError` when they do not fit) and
        register it for cleanup (``prefault``: every page mapped now)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        register(path)
        try:
            os.ftruncate(fd, size)
            _allocate(fd, path, 0, size)
            seg = cls(path, fd, owner=True, populate=prefault)
            seg.allocated = size
        except BaseException:
            os.close(fd)
            unlink(path)
            raise
        if prefault:
            seg.tensor.zero_()  # first touch now, not on the hot path
        return seg

    @classmethod
    def attach(cls, path: str, *, populate: bool = True) -> Segment:
        """Map an existing segment (raises ``FileNotFoundError`` naming the path if it is gone); ``populate``
        maps every page now (``MAP_POPULATE``), else pages map on first touch (sparse files stay sparse)."""
        fd = os.open(path, os.O_RDWR)
        try:
            return cls(path, fd, owner=False, populate=populate)
        except BaseException:
            os.close(fd)
            raise

    def _map(self, size: int) -> None:
        self.size = size
        populate = getattr(mmap, "MAP_POPULATE", 0) if self._populate else 0
        self.mm = mmap.mmap(self.fd, size, flags=mmap.MAP_SHARED | populate)
        self.buf = memoryview(self.mm)
        self._tensor = None

    @property
    def tensor(self) -> Any:
        """The bytes as a torch ``uint8`` tensor sharing the mapping."""
        if self._tensor is None:
            import torch

            self._tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        return self._tensor

    def grow(self, size: int) -> None:
        """Extend the file to ``size`` bytes (the new pages sparse until :meth:`allocate`) and map it again."""
        os.ftruncate(self.fd, max(size, os.fstat(self.fd).st_size))
        self.refresh()

    def allocate(self, end: int) -> None:
        """Allocate the pages up to byte ``end`` before they are written (:class:`SharedMemoryFullError` when they
        do not fit); a writer calls it for what it is about to write, so a grown segment holds only what is used."""
        if end > self.allocated:
            _allocate(self.fd, self.path, self.allocated, end)
            self.allocated = end

    def refresh(self) -> None:
        """Map again if the file's size changed (another process extended it)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self._old.append(self.mm)
            try:
                if self.buf is not None:
                    self.buf.release()
            except BufferError:  # slices of it are still alive: it goes with them
                pass
            self._map(size)

    def read(self, fmt: str, off: int = 0) -> tuple:
        return struct.unpack_from(fmt, self.mm, off)

    def write(self, fmt: str, off: int, *vals: Any) -> None:
        struct.pack_into(fmt, self.mm, off, *vals)

    def close(self, unlink_file: bool = False) -> None:
        """Let go of the mapping and optionally remove the file.

        The mapping is not unmapped here but dropped: views of it handed out (numpy arrays and tensors over
        ``buf``, which keep the mapping referenced but do not always hold a buffer export that would stop
        ``mmap.close``) stay valid, and the mapping goes with the last of them (reading a view after an
        explicit unmap would be a segfault).
        """
        self.buf, self._tensor, self.mm, self._old = None, None, None, []
        if self.fd >= 0:
            try:
                os.close(self.fd)
            except OSError:
                pass
            self.fd = -1
        if unlink_file:
            unlink(self.path)
