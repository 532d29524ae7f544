"""Rollout workers on other hosts: they join the trainer's pool through a ``TCPStore`` rendezvous.

The trainer (``rollout.remote_workers: N``, ``rollout.rendezvous: HOST:PORT``) owns a ``torch.distributed``
``TCPStore`` on that address and publishes there, per remote worker ``i``, the pickled
:class:`~mrl_plugins.rollout.worker.WorkerSpec` (config, model architectures, engine, and the handles of
the experience and weight paths). On the other host::

    mrl worker --connect HOST:PORT --index i [--device auto] [--cores 0,1] [--threads 4]

(:mod:`mrl_plugins.cli.worker`: its options checked before it connects) fetches its spec and runs the same worker
loop as a local worker. The trainer lists its remote workers' indices as its store opens, so an index it does not
have fails at once, naming them; a failure of the worker loop goes to the trainer and is raised here too
(:class:`WorkerFailed`). Requests travel through the store
(:class:`StoreQueue`: small pickled prompt lists); experience and weights through the cross-host transports
(``docs/multi-host.md``). The remote worker stamps a heartbeat in the store every second; a worker whose
heartbeat stops for ``rollout.timeout_s`` (killed, or its link cut) is reported as dead with
:class:`~mrl_plugins.rollout.pool.WorkerDiedError` naming it; a link restored before that goes on (TCP resends
what was in flight).

Every process that connects as worker ``i`` is a new *incarnation* (``joins/<i>`` in the store) with request
queue and ready flag of its own, so a restarted worker -- Ray restarting its actor (``rollout.ray_address``,
:mod:`.ray_launcher`), or ``mrl worker`` started again -- never reads requests meant for its predecessor; the pool
sees the new incarnation, hands it the predecessor's unanswered requests and counts a restart, where the transports
are rejoinable and ``rollout.restart_workers`` allows (else one WorkerDiedError saying why). With ``broadcast`` a
new process cannot join the weights' group. When the trainer goes away its store goes with it and the worker
exits.
"""

from __future__ import annotations

import json
import pickle
import queue
import socket
import time
from typing import Any

from mrl_plugins._net import td
from mrl_plugins._proc import wait_until
from mrl_plugins.comm.base import Heartbeat
from mrl_plugins.errors import ConfigError, MrlError, StageTimeoutError, choices

from .config import parse_address

PREFIX = "mrl/pool"
HEARTBEAT_S = 1.0  # a remote worker stamps its heartbeat this often
SILENT_S = 2.5  # at close: a worker whose heartbeat stood still this long is not waited for
INDICES = f"{PREFIX}/indices"  # the remote workers' indices (JSON), set as the trainer's store opens


class StoreQueue:
    """A FIFO queue in a ``TCPStore`` (any number of producers, one consumer), with ``mp.Queue``'s calls.

    ``put`` takes a slot number with the store's atomic ``add`` and writes the pickled item under it;
    ``get`` waits for the next slot's key, reads and deletes it.
    """

    def __init__(self, store: Any, name: str) -> None:
        self.store, self.name = store, name
        self._head = 0

    def _key(self, n: int) -> str:
        return f"{PREFIX}/{self.name}/{n}"

    def put(self, obj: Any, timeout: float | None = None) -> None:
        n = self.store.add(f"{PREFIX}/{self.name}/tail", 1) - 1
        self.store.set(self._key(n), pickle.dumps(obj))

    def get(self, timeout: float | None = None) -> Any:
        key = self._key(self._head)
        if not self.store.check([key]):
            if not timeout:
                raise queue.Empty
            try:
                self.store.wait([key], td(timeout))
            except Exception as exc:  # the store's timeout (or a lost connection, which the caller re-checks)
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    raise queue.Empty from None
                raise
        item = pickle.loads(self.store.get(key))
        self.store.delete_key(key)
        self._head += 1
        return item

    def get_nowait(self) -> Any:
        return self.get(timeout=0)


class StoreFlag:
    """A one-way flag in the store (``mp.Event``'s ``set``/``is_set``)."""

    def __init__(self, store: Any, name: str) -> None:
        self.store, self.key = store, f"{PREFIX}/{name}"

    def set(self) -> None:
        self.store.set(self.key, b"1")

    def is_set(self) -> bool:
        return bool(self.store.check([self.key]))


def _channels(store: Any, index: int, incarnation: int) -> tuple[StoreQueue, StoreFlag]:
    """Incarnation ``incarnation`` of worker ``index``: its (requests, ready) channels."""
    return StoreQueue(store, f"req/{index}/{incarnation}"), StoreFlag(store, f"ready/{index}/{incarnation}")


class RemoteSlots:
    """Trainer side: the rendezvous store and, per remote worker, its queues, ready flag, heartbeat and the
    incarnation the pool serves (1 until a restarted process joins)."""

    def __init__(self, address: str, first_index: int, count: int, timeout: float) -> None:
        import torch.distributed as dist

        host, port = parse_address(address)
        self.store = dist.TCPStore(host, port, None, True, timeout=td(timeout), wait_for_workers=False)
        self.host, self.port = host, int(self.store.port)
        self.indices = list(range(first_index, first_index + count))
        self.store.set(INDICES, json.dumps(self.indices))  # `mrl worker --index` must name one of them
        self.timeout = timeout
        self._beats: dict[int, tuple[int, float]] = {}
        self.incarnation = dict.fromkeys(self.indices, 1)
        self._ready: dict[int, StoreFlag] = {}

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def offer(self, index: int, spec: Any) -> tuple[StoreQueue, StoreQueue, StoreQueue, StoreFlag]:
        """Publish worker ``index``'s spec; returns its (requests, errors, events, ready) channels (those of its
        first incarnation: :meth:`rejoin` hands out a restarted one's)."""
        self.store.set(f"{PREFIX}/spec/{index}", pickle.dumps(spec))
        self._beats[index] = (-1, time.monotonic())
        requests, self._ready[index] = _channels(self.store, index, 1)
        errors, events = StoreQueue(self.store, f"err/{index}"), StoreQueue(self.store, f"ev/{index}")
        return requests, errors, events, self._ready[index]

    def joined(self, index: int) -> int:
        """The latest incarnation of worker ``index`` that connected (0: none yet)."""
        return int(self.store.add(f"{PREFIX}/joins/{index}", 0))

    def rejoined(self, index: int) -> int | None:
        """A newer incarnation of worker ``index`` than the one served connected (a restarted process): its
        number, else None."""
        latest = self.joined(index)
        return latest if latest > self.incarnation[index] else None

    def rejoin(self, index: int, incarnation: int) -> tuple[StoreQueue, StoreFlag]:
        """Serve incarnation ``incarnation`` of worker ``index`` from now on: its (requests, ready) channels."""
        self.incarnation[index] = incarnation
        self._beats[index] = (-1, time.monotonic())
        requests, self._ready[index] = _channels(self.store, index, incarnation)
        return requests, self._ready[index]

    def wait_stopped(self, deadline: float) -> None:
        """Until every connected remote worker acknowledged its stop (or ``deadline``, monotonic). A worker whose
        heartbeat stands still for ``SILENT_S`` (dead, or its link cut) is not waited for."""
        waiting = {i: StoreFlag(self.store, f"stopped/{i}") for i in self.indices}
        waiting = {i: f for i, f in waiting.items() if i in self._ready and self._ready[i].is_set()}
        beats = {i: (int(self.store.add(f"{PREFIX}/hb/{i}", 0)), time.monotonic()) for i in waiting}
        while waiting and time.monotonic() < deadline:
            for i in list(waiting):
                beat, now = int(self.store.add(f"{PREFIX}/hb/{i}", 0)), time.monotonic()
                if waiting[i].is_set() or (beat == beats[i][0] and now - beats[i][1] > SILENT_S):
                    del waiting[i]
                elif beat != beats[i][0]:
                    beats[i] = (beat, now)
            time.sleep(0.05)

    def silent_s(self, index: int) -> float:
        """Seconds since worker ``index``'s heartbeat last changed (since its slot was offered or its latest
        incarnation taken, before the first beat)."""
        beat = int(self.store.add(f"{PREFIX}/hb/{index}", 0))
        last, since = self._beats[index]
        now = time.monotonic()
        if beat != last:
            self._beats[index] = (beat, now)
            return 0.0
        return now - since

    def check_alive(self, index: int, ready: bool) -> str | None:
        """Why worker ``index`` counts as dead (its heartbeat stopped for ``timeout`` s once ready), or None."""
        silent = self.silent_s(index)
        if ready and silent > self.timeout:
            return f"remote rollout worker {index} stopped heartbeating {silent:.0f} s ago"
        return None


class WorkerFailed(MrlError):
    """The worker loop failed after joining the pool; the trainer got the same report (``mrl worker``: exit 3).
    ``details``: the report's lines after its first (the traceback)."""

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message)
        self.details = details


class _Reported:
    """The worker's error queue to the trainer, keeping the last report (the worker says it too)."""

    def __init__(self, inner: StoreQueue) -> None:
        self.inner, self.text = inner, None

    def put(self, item: Any, timeout: float | None = None) -> None:
        self.text = getattr(item, "text", str(item))
        self.inner.put(item, timeout)


def serve(address: str, index: int, *, device: str | None = None, cores: list[int] | None = None,
          threads: int | None = None, timeout: float = 600.0) -> None:  # fmt: skip
    """Run remote worker ``index`` of the pool at ``address`` until the trainer stops it (``mrl worker``, Ray's
    actors). Each wait for the trainer (to listen, to publish this worker's spec) ends within ``timeout`` s in one
    error saying what is missing; a failure of the worker loop raises :class:`WorkerFailed` with its report."""
    import torch.distributed as dist

    from .worker import worker_main

    host, port = parse_address(address, "mrl worker --connect")
    key, deadline = f"{PREFIX}/spec/{index}", time.monotonic() + timeout
    why = ["not tried"]

    def listening() -> bool | None:  # a plain connect first: the store client's own failure is pages of C++ frames
        try:
            socket.create_connection((host, port), timeout=min(5.0, timeout)).close()
            return True
        except socket.gaierror as exc:
            raise ConfigError(f"trainer address {address}: {host!r} does not resolve ({exc.strerror})") from None
        except OSError as exc:
            why[0] = exc.strerror or str(exc)
            return None

    wait_until(
        listening,
        deadline,
        lambda: (
            f"no trainer answering at {address} within {timeout:g} s ({why[0]}); start the trainer (is its "
            f"rollout.rendezvous {address}?) or wait longer (mrl worker --timeout)"
        ),
        sleep=0.5,
    )
    store = dist.TCPStore(host, port, None, False, timeout=td(timeout), wait_for_workers=False)
    while not store.check([key]):
        if store.check([INDICES]) and index not in (have := json.loads(store.get(INDICES))):
            raise ConfigError(
                f"worker index {index}: the trainer at {address} has remote workers {choices(have)} only"
            )
        if time.monotonic() > deadline:
            raise StageTimeoutError(f"mrl worker: no spec for worker {index} at {address} within {timeout:g} s")
        time.sleep(0.1)
    spec = pickle.loads(store.get(key))
    incarnation = int(store.add(f"{PREFIX}/joins/{index}", 1))  # a restarted process: the next one
    requests, ready = _channels(store, index, incarnation)
    if device is not None:
        spec.device = device
    spec.cores = cores
    if threads is not None:
        spec.threads = threads
    # beats once now, then every HEARTBEAT_S; stops when the trainer (and its store) is gone: the worker loop notices
    hb = Heartbeat(lambda: store.add(f"{PREFIX}/hb/{index}", 1), HEARTBEAT_S, "mrl-remote-heartbeat")
    errors = _Reported(StoreQueue(store, f"err/{index}"))
    try:
        worker_main(spec, requests, errors, None, ready, StoreQueue(store, f"ev/{index}"))
        StoreFlag(store, f"stopped/{index}").set()
    except SystemExit:  # worker_main reported its error to the trainer and exits non-zero
        if errors.text is None:
            raise
        first, _, rest = errors.text.strip().partition("\n")
        raise WorkerFailed(f"worker {index} failed: {first}", rest) from None
    finally:
        hb.stop()
