"""Separate network hosts on one machine: Linux network namespaces joined by veth links shaped with ``tc``.

:class:`Hosts` makes a *trainer* namespace and ``workers`` worker namespaces. The trainer side holds a
bridge with ``10.77.0.1/24``; worker ``i`` gets ``10.77.0.(2 + i)/24`` on its end of a veth pair whose
other end hangs on that bridge (``subnet`` picks another ``/24``, e.g. the Ray tests' ``10.79.0``). Only addresses of
that subnet are used, and only inside the namespaces made here; nothing is routed anywhere else (the namespaces have
no default route). Each link
can be shaped in both directions (:meth:`Hosts.shape`: ``tbf`` for a rate and a queue length, ``netem`` for
delay or loss where the kernel has it), cut and restored (:meth:`Hosts.link`).

Teardown always runs (context manager, also on errors): processes still running inside the namespaces
are killed (everything in them was started through this harness), then the namespaces are deleted, which
deletes their interfaces. Names are unique per process and harness: ``<prefix>-<pid>-<n>-t`` / ``-w<i>`` (prefix
``mrl`` unless given); those of a harness whose process was killed before its teardown are deleted when the next one
with that prefix starts (:func:`sweep_stale`).
Needs root (``CAP_NET_ADMIN``) and the ``ip`` and ``tc`` tools; :func:`unavailable` says why not.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import shutil
import signal
import subprocess
import time
from typing import Any

SUBNET = "10.77.0"
TRAINER_ADDR = f"{SUBNET}.1"
_COUNTER = itertools.count()
_CMD_TIMEOUT = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=_CMD_TIMEOUT)


def _tc(ns: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["ip", "netns", "exec", ns, "tc", *args], capture_output=True, text=True, check=check, timeout=_CMD_TIMEOUT
    )


@functools.cache
def netem_available() -> bool:
    """Whether ``tc qdisc ... netem`` works in this kernel (probed once in a throwaway namespace)."""
    probe = f"mrl-{os.getpid()}-netem{next(_COUNTER)}"
    try:
        if _ip("netns", "add", probe, check=False).returncode != 0:
            return False
        _ip("-n", probe, "link", "set", "lo", "up", check=False)
        return _tc(probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms", check=False).returncode == 0
    finally:
        _ip("netns", "del", probe, check=False)


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can): not root, no ``ip``/``tc``, or ``ip netns add`` fails."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root (CI does)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the {tool!r} tool (iproute2) is not installed"
    probe = f"mrl-{os.getpid()}-probe{next(_COUNTER)}"
    try:
        got = _ip("netns", "add", probe, check=False)
        if got.returncode != 0:
            return f"`ip netns add` failed: {got.stderr.strip()}"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


class Hosts:
    """A trainer namespace and ``workers`` worker namespaces on a shaped bridge (see the module docstring).

    :param rate: link rate for ``tc`` (e.g. ``"1gbit"``, ``"100mbit"``; None: unshaped veth); the rest of
        :meth:`shape`'s arguments may follow.
    :param subnet: the first three octets of the ``/24`` the hosts take (default ``10.77.0``).
    :param prefix: the namespaces' name prefix (default ``mrl``; letters and digits).
    """

    def __init__(
        self, workers: int = 1, *, rate: str | None = None, subnet: str = SUBNET, prefix: str = "mrl", **shaping: Any
    ) -> None:
        if not 1 <= workers <= 200:
            raise ValueError(f"workers must be in 1..200, got {workers}")
        if not re.fullmatch(r"[a-z][a-z0-9]*", prefix) or not re.fullmatch(r"10\.\d{1,3}\.\d{1,3}", subnet):
            raise ValueError(f"prefix {prefix!r} (lowercase letters and digits) / subnet {subnet!r} (10.x.y)")
        sweep_stale(prefix)
        self.prefix, self.subnet = prefix, subnet
        tag = f"{prefix}-{os.getpid()}-{next(_COUNTER)}"
        self.trainer = f"{tag}-t"
        self.worker_ns = [f"{tag}-w{i}" for i in range(workers)]
        self.trainer_addr = f"{subnet}.1"
        self.worker_addrs = [f"{subnet}.{2 + i}" for i in range(workers)]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []
        try:
            self._build()
            if rate or shaping:
                self.shape(rate=rate, **shaping)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ set-up
    def _build(self) -> None:
        for ns in (self.trainer, *self.worker_ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        t = self.trainer
        _ip("-n", t, "link", "add", "br0", "type", "bridge")
        _ip("-n", t, "addr", "add", f"{self.trainer_addr}/24", "dev", "br0")
        _ip("-n", t, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.worker_ns, self.worker_addrs)):
            # created straight inside the namespaces (no name ever exists in the root namespace)
            _ip("-n", t, "link", "add", f"vw{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", t, "link", "set", f"vw{i}", "master", "br0")
            _ip("-n", t, "link", "set", f"vw{i}", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def _ends(self, worker: int | None) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of worker ``worker``'s link (None: every worker's)."""
        idx = range(len(self.worker_ns)) if worker is None else [worker]
        return [e for i in idx for e in ((self.trainer, f"vw{i}"), (self.worker_ns[i], "eth0"))]

    def shape(
        self,
        *,
        rate: str | None = None,
        burst: str = "256kb",
        queue: str = "1mb",
        delay_ms: float = 0.0,
        loss_pct: float = 0.0,
        worker: int | None = None,
    ) -> None:
        """Replace the shaping of the link(s), both directions.

        ``rate``: a ``tbf`` at that rate (bucket ``burst``) whose queue holds ``queue`` bytes; what does not fit is
        dropped, so a short queue on a slow link is a lossy link (TCP retransmits; :meth:`drops` counts them)
        and a long one adds queueing delay. The defaults carry TCP at ~93% of 1 Gbit/s here without drops (a
        64 KiB bucket and 256 KiB queue: ~82%, thousands of drops). ``delay_ms``/``loss_pct`` need ``netem``,
        which some kernels lack (this machine's: :func:`netem_available`); asking for them there raises
        ``RuntimeError``.
        """
        netem = [*(["delay", f"{delay_ms}ms"] if delay_ms else []), *(["loss", f"{loss_pct}%"] if loss_pct else [])]
        if netem and not netem_available():
            raise RuntimeError("tc netem is not available in this kernel (sch_netem): shape with rate/queue only")
        for ns, dev in self._ends(worker):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
            tbf = ["tbf", "rate", rate, "burst", burst, "limit", queue] if rate else []
            if netem:
                _tc(ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "limit", "100000", *netem)
                if tbf:
                    _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
            elif tbf:
                _tc(ns, "qdisc", "add", "dev", dev, "root", *tbf)

    def drops(self, worker: int | None = None) -> int:
        """Packets the links' qdiscs dropped so far (both directions)."""
        total = 0
        for ns, dev in self._ends(worker):
            out = _tc(ns, "-s", "qdisc", "show", "dev", dev, check=False).stdout
            total += sum(int(n) for n in re.findall(r"dropped (\d+)", out))
        return total

    def link(self, up: bool, worker: int = 0) -> None:
        """Cut (``up=False``) or restore worker ``worker``'s link (its veth end in the trainer namespace)."""
        _ip("-n", self.trainer, "link", "set", f"vw{worker}", "up" if up else "down")

    # ------------------------------------------------------------------ processes
    def argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``ns``."""
        return ["ip", "netns", "exec", ns, *argv]

    def popen(self, ns: str, argv: list[str], **kwargs: Any) -> subprocess.Popen:
        """Start ``argv`` inside ``ns`` (``ip netns exec`` execs it, so the pid is the command's); killed at close."""
        proc = subprocess.Popen(self.argv(ns, argv), **kwargs)
        self._procs.append(proc)
        return proc

    def run(self, ns: str, argv: list[str], timeout: float, **kwargs: Any) -> subprocess.CompletedProcess:
        """Run ``argv`` inside ``ns`` to its end (at most ``timeout`` s)."""
        return subprocess.run(self.argv(ns, argv), timeout=timeout, **kwargs)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Kill what still runs in the namespaces, delete them (and with them their links). Idempotent."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    try:
                        stream.close()
                    except (OSError, ValueError):  # a reader thread of the caller's may hold it
                        pass
        self._procs = []
        for ns in reversed(self._made):
            got = _ip("netns", "pids", ns, check=False)
            for pid in got.stdout.split():  # only processes started inside our own namespace
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        deadline = time.monotonic() + 10
        for ns in reversed(self._made):
            while _ip("netns", "pids", ns, check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.05)
            _ip("netns", "del", ns, check=False)
        self._made = []

    def __enter__(self) -> Hosts:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def sweep_stale(prefix: str = "mrl") -> list[str]:
    """Delete the namespaces of harnesses whose process is gone (killed before its teardown); returns their names.
    Only names this module makes (``<prefix>-<pid>-<n>-t`` / ``-w<i>``) whose ``<pid>`` no longer runs."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.fullmatch(rf"({re.escape(prefix)}-(\d+)-\d+-(?:t|w\d+))(?: \(id: \d+\))?", line.strip())
        if m is None or int(m.group(2)) == os.getpid():
            continue
        try:
            os.kill(int(m.group(2)), 0)
        except ProcessLookupError:
            _ip("netns", "del", m.group(1), check=False)
            gone.append(m.group(1))
        except PermissionError:
            pass
    return gone


def leftover(prefix: str = "mrl") -> list[str]:
    """Namespaces of this process that still exist (a test asserts none after teardown)."""
    got = _ip("netns", "list", check=False)
    mine = f"{prefix}-{os.getpid()}-"
    return [line.split()[0] for line in got.stdout.splitlines() if line.startswith(mine)]


__all__ = ["SUBNET", "TRAINER_ADDR", "Hosts", "leftover", "netem_available", "sweep_stale", "unavailable"]
