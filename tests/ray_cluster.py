"""A real two-node Ray cluster across network namespaces, for the Ray tests (``rollout.ray_address``) only.

:class:`RayCluster` makes a trainer namespace and one worker namespace on a veth bridge in ``10.79.0.0/24``
(:class:`benchmarks.netns.Hosts`, names ``mrlray-<pid>-<n>-t`` / ``-w0``; the other two-host tests use
``10.77.0``), starts Ray's head in the trainer's namespace (no CPU of its own: actors can only be placed on the
worker node) and ``ray start --address`` in the worker's, with Ray's session files in a temporary folder of its
own. :meth:`RayCluster.close` kills every process in the two namespaces (Ray's daemons and workers included: they
were all started in them), deletes the namespaces and the folder; it never runs ``ray stop``, which would stop every
Ray process on the machine, not only this cluster's. These are the commands the README quotes ("On a Ray cluster").
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import netns
from tests import netns as two_hosts

SUBNET = "10.79.0"
PREFIX = "mrlray"
HEAD = f"{SUBNET}.1"
GCS_PORT = 6379
RENDEZVOUS_PORT = 29555
OBJECT_STORE_BYTES = 100 << 20  # the workers put nothing in Ray's object store


def ray_cli() -> str:
    """The ``ray`` command of this interpreter's environment."""
    return str(Path(sys.executable).with_name("ray"))


def env(**extra: str) -> dict[str, str]:
    """The processes' environment: one thread each, no Ray usage statistics, no RAY_ADDRESS of the caller's, and no
    token authentication (Ray 2.60 turns it on when ~/.ray/auth_token exists, which another Ray run may have left;
    these clusters live inside namespaces nothing else reaches)."""
    out = two_hosts.child_env(RAY_USAGE_STATS_ENABLED="0", RAY_AUTH_MODE="disabled", **extra)
    out.pop("RAY_ADDRESS", None)
    return out


class RayCluster:
    """Head (0 CPUs) in the trainer's namespace, one worker node (``worker_cpus``) in the worker's; with
    ``ray_cores``, the worker node's Ray processes started on those cores only (``taskset -c``)."""

    def __init__(self, worker_cpus: int = 1, ray_cores: list[int] | None = None) -> None:
        self.hosts = netns.Hosts(1, subnet=SUBNET, prefix=PREFIX)
        self.temp = Path(tempfile.mkdtemp(prefix=f"mrlray{os.getpid()}-", dir="/tmp"))  # short: Ray's socket paths
        self.address = f"{HEAD}:{GCS_PORT}"
        self.worker_addr = self.hosts.worker_addrs[0]
        common = ["--disable-usage-stats", f"--object-store-memory={OBJECT_STORE_BYTES}"]
        try:
            self._ray(self.hosts.trainer, "start", "--head", f"--node-ip-address={HEAD}", f"--port={GCS_PORT}",
                      "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={self.temp}", *common)  # fmt: skip
            pin = ["taskset", "-c", ",".join(map(str, ray_cores))] if ray_cores else []
            self._ray(self.hosts.worker_ns[0], "start", f"--address={self.address}",
                      f"--node-ip-address={self.worker_addr}", f"--num-cpus={worker_cpus}", *common,
                      pin=pin)  # fmt: skip
        except BaseException:
            self.close()
            raise

    def _ray(self, ns: str, *args: str, pin: list[str] | None = None) -> None:
        cmd = [*(pin or []), ray_cli(), *args]
        got = self.hosts.run(ns, cmd, timeout=180, env=env(), capture_output=True, text=True)
        if got.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args[:2])} failed in {ns}: {got.stdout[-2000:]}{got.stderr[-2000:]}")

    @property
    def trainer(self) -> str:
        return self.hosts.trainer

    @property
    def worker(self) -> str:
        return self.hosts.worker_ns[0]

    def pids(self, ns: str) -> list[int]:
        got = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=20, check=False)
        return [int(p) for p in got.stdout.split()]

    def actor_pids(self) -> list[int]:
        """Processes of the worker node that run a rollout worker actor (Ray titles them ``ray::RolloutActor``)."""
        out = []
        for pid in self.pids(self.worker):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if cmd.startswith("ray::RolloutActor"):
                out.append(pid)
        return out

    def wait_actor(self, timeout: float, *, other_than: int | None = None) -> int:
        """The pid of the worker node's rollout actor (one that is not ``other_than``), waiting up to ``timeout``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in self.actor_pids() if p != other_than]
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError(f"no rollout actor on the worker node within {timeout} s")

    def stop_worker_node(self) -> None:
        """The worker node goes away: every process in its namespace (raylet, agents, the actor) is SIGKILLed."""
        for pid in self.pids(self.worker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def worker_logs(self) -> dict[int, str]:
        """Ray's captured stderr of every worker process of the session, by pid (the actors' log lines)."""
        out = {}
        for path in sorted(self.temp.glob("session_*/logs/worker-*.err")):
            pid = int(path.stem.rsplit("-", 1)[1])
            out[pid] = path.read_text(encoding="utf-8", errors="replace")
        return out

    def leftover_processes(self) -> list[str]:
        """Processes anywhere on the machine that belong to this cluster (their command line names its folder)."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(self.temp) in cmd and int(entry.name) != os.getpid():
                found.append(f"{entry.name}: {cmd[:120]}")
        return found

    def close(self) -> None:
        """Every process in the namespaces killed, the namespaces deleted, the session folder removed."""
        self.hosts.close()
        shutil.rmtree(self.temp, ignore_errors=True)


def leftover_namespaces() -> list[str]:
    return netns.leftover(PREFIX)
