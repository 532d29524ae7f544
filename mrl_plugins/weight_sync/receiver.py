"""Double-buffered receiver: ``active`` weights serve requests while the next version loads into ``staging``.

Memory cost (``W`` = bytes of the module's parameters):

* ``staging="device"``: ``2 W`` on the device. Both copies are flat buffers with one view per
  parameter; the switch re-points every parameter at the other buffer (``param.data = view``), which
  is O(#params) attribute sets and moves no bytes (well under 10 ms for hundreds of parameters).
* ``staging="host"``: ``W`` on the device + ``W`` in host memory (pinned when CUDA is present). The
  switch is one host->device copy of ``W`` (bandwidth-bound), done while requests are held.

Atomicity: ``with receiver.active() as model:`` marks a request in flight. ``switch()`` stops new
requests from entering, waits (with a timeout) until the in-flight ones drained, flips, and lets
requests in again: no forward pass inside ``active()`` ever sees two versions.

Versions are monotonic per ``model_id``: a version older than (or equal to) the active or staged one is
ignored and logged once; a version that failed verification leaves ``staging`` invalid and the active version
untouched.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from mrl_plugins.errors import ConfigError, StageTimeoutError, choices
from mrl_plugins.hookspecs import SwitchReport

from .shards import VersionGoneError, WeightSyncError, align

LOG = logging.getLogger("mrl_plugins.weight_sync")
GONE_RETRIES = 8  # versions a poll may lose to a faster writer in a row before it gives up (VersionGoneError)


class _MappedDest(Mapping):
    """Published name -> staging view, through ``name_map``; remembers which local names were written."""

    def __init__(self, views: dict[str, torch.Tensor], name_map: Callable[[str], str] | None) -> None:
        self.views, self.name_map, self.touched = views, name_map, set()

    def _local(self, name: str) -> str:
        return self.name_map(name) if self.name_map is not None else name

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        local = self._local(name)
        t = self.views.get(local)
        if t is None:
            return default
        self.touched.add(local)
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self.get(name)
        if t is None:
            raise KeyError(name)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.views)

    def __len__(self) -> int:
        return len(self.views)


class _FlatSet:
    """One flat ``uint8`` buffer per device with a 64-byte aligned view per parameter."""

    def __init__(self, specs: list[tuple[str, torch.dtype, tuple[int, ...], torch.device]], where: str) -> None:
        sizes: dict[torch.device, int] = {}
        place: list[tuple[torch.device, int, int]] = []  # device, offset, bytes
        for _, dtype, shape, dev in specs:
            nb = torch.Size(shape).numel() * dtype.itemsize
            off = sizes.get(dev, 0)
            place.append((dev, off, nb))
            sizes[dev] = align(off + nb)
        pin = where == "host" and torch.cuda.is_available()
        self.flats: dict[torch.device, torch.Tensor] = {}
        for dev, size in sizes.items():
            target = torch.device("cpu") if where == "host" else dev
            self.flats[dev] = torch.empty(max(size, 1), dtype=torch.uint8, device=target, pin_memory=pin)
        self.views: dict[str, torch.Tensor] = {}
        for (name, dtype, shape, _), (dev, off, nb) in zip(specs, place):
            self.views[name] = self.flats[dev][off : off + nb].view(dtype).view(shape)
        self.nbytes = sum(sizes.values())


class DoubleBufferedReceiver:
    """Inference-side holder of a module's weights with an active and a staging copy.

    :param model: the served module; its parameters are moved (once) into a flat active buffer.
    :param transport_receiver: from ``sender.receiver_handle().attach()`` (``latest_version`` and
        ``fetch_into``).
    :param staging: ``"device"`` or ``"host"`` (see the module docstring for the memory cost).
    :param name_map: published parameter name -> this module's parameter name.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        transport_receiver: Any,
        *,
        model_id: str = "policy",
        staging: str = "device",
        name_map: Callable[[str], str] | None = None,
    ) -> None:
        if staging not in ("device", "host"):
            raise ConfigError(f"staging must be {choices(('device', 'host'))}, got {staging!r}")
        self.model, self.tr, self.model_id, self.staging_kind = model, transport_receiver, model_id, staging
        self.name_map = name_map
        self._params = list(model.named_parameters())  # tied parameters once
        self._aliases = {n: p for n, p in model.named_parameters(remove_duplicate=False)}
        specs = [(n, p.dtype, tuple(p.shape), p.device) for n, p in self._params]
        with torch.no_grad():
            self._a = _FlatSet(specs, "device")
            for n, p in self._params:
                self._a.views[n].copy_(p.data)
                p.data = self._a.views[n]
        self._b = _FlatSet(specs, staging)
        self._by_param = {id(p): n for n, p in self._params}
        self.version = -1
        self._staged: int | None = None
        self._cv = threading.Condition()
        self._fetch_lock = threading.Lock()
        self._inflight = 0
        self._switching = False
        self._ignored: set[int] = set()
        self._last_fetch = (0, 0.0)
        self._last_switch_ms = 0.0

    # ------------------------------------------------------------------ staging

    def _staging_views(self) -> dict[str, torch.Tensor]:
        views = dict(self._b.views)
        for alias, p in self._aliases.items():  # tied names point at the same staging view
            views.setdefault(alias, views[self._by_param[id(p)]])
        return views

    def poll(self, timeout: float | None = None) -> int | None:
        """Fetch the newest version into staging if it is newer than active and staged; return it, else ``None``.

        A version replaced by a newer one while it was fetched (a slow reader; :class:`VersionGoneError`) is given
        up for the newer one, up to ``GONE_RETRIES`` times in a row.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        for lost in range(GONE_RETRIES + 1):
            v = self.tr.latest_version()
            if v is None or v in (self.version, self._staged):
                return None  # nothing new
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                return self.stage(v, left)
            except VersionGoneError:
                newer = self.tr.latest_version()
                out_of_time = deadline is not None and deadline - time.monotonic() <= 0
                if newer is None or newer <= v or out_of_time or lost == GONE_RETRIES:
                    raise
                LOG.info("model_id=%s version %d was replaced by %d while it was fetched", self.model_id, v, newer)
        return None  # not reached: the last lost version raises

    def _not_newer(self, version: int, log: bool = True) -> bool:
        """True when ``version`` is not newer than the active or staged one (logged once per version)."""
        held = self.version if self._staged is None else max(self.version, self._staged)
        if version > held:
            return False
        if log and version not in self._ignored:
            self._ignored.add(version)
            what = "older than" if version < held else "repeats"
            staged = "" if self._staged is None else f", staged {self._staged}"
            LOG.info(
                "ignored model_id=%s version %d (%s active %d%s)", self.model_id, version, what, self.version, staged
            )
        return True

    def stage(self, version: int, timeout: float | None = None) -> int | None:
        """Fetch ``version`` into staging (e.g. on a control-channel notice); older/repeated ones are ignored."""
        if self._not_newer(version):
            return None
        if not self._fetch_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise StageTimeoutError(f"model_id={self.model_id}: another fetch into staging is still running")
        try:
            if self._not_newer(version, log=False):  # another thread staged it (or a newer one) meanwhile
                return None
            self._staged = None
            dest = _MappedDest(self._staging_views(), self.name_map)
            t0 = time.perf_counter()
            nbytes = self.tr.fetch_into(version, dest, timeout)
            dt = time.perf_counter() - t0
            missing = [n for n, _ in self._params if n not in dest.touched]
            if missing:
                raise WeightSyncError(
                    f"model_id={self.model_id} version {version}: {len(missing)} parameter(s) not received, e.g. "
                    f"{missing[:3]} (check name_map or the mrl_weight_sync_map_name hook)"
                )
            self._staged = version
            self._last_fetch = (nbytes, dt)
            LOG.debug("staged model_id=%s version %d bytes=%d seconds=%.4f", self.model_id, version, nbytes, dt)
            return version
        finally:
            self._fetch_lock.release()

    # ------------------------------------------------------------------ serving and switching

    @contextmanager
    def active(self, timeout: float | None = None) -> Iterator[torch.nn.Module]:
        """Mark one request in flight on the active weights; blocks while a switch is under way."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._switching:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise StageTimeoutError(f"model_id={self.model_id}: a weight switch did not finish in {timeout}s")
                self._cv.wait(left)
            self._inflight += 1
        try:
            yield self.model
        finally:
            with self._cv:
                self._inflight -= 1
                if self._inflight == 0:
                    self._cv.notify_all()

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        """Make the staged version active once in-flight requests drained; ``None`` if nothing is staged."""
        timeout = 60.0 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        if not self._fetch_lock.acquire(timeout=timeout):
            raise StageTimeoutError(f"model_id={self.model_id}: a fetch into staging still runs after {timeout}s")
        try:
            if self._staged is None:
                return None
            with self._cv:
                self._switching = True
                try:
                    while self._inflight:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise StageTimeoutError(
                                f"model_id={self.model_id}: {self._inflight} request(s) still in flight after "
                                f"{timeout}s; switch to version {self._staged} not done"
                            )
                        self._cv.wait(left)
                    t0 = time.perf_counter()
                    self._flip()
                    sw = time.perf_counter() - t0
                finally:
                    self._switching = False
                    self._cv.notify_all()
            old, new = self.version, self._staged
            self.version, self._staged = new, None
            self._last_switch_ms = sw * 1e3
            nbytes, fetch_s = self._last_fetch
            LOG.info(
                "switch model_id=%s %d -> %d bytes=%d seconds=%.4f", self.model_id, old, new, nbytes, fetch_s + sw
            )
            return SwitchReport(self.model_id, old, new, nbytes, fetch_s + sw)
        finally:
            self._fetch_lock.release()

    def _flip(self) -> None:
        with torch.no_grad():
            if self.staging_kind == "device":
                for n, p in self._params:
                    p.data = self._b.views[n]
                self._a, self._b = self._b, self._a
            else:
                for dev, flat in self._a.flats.items():
                    flat.copy_(self._b.flats[dev])

    # ------------------------------------------------------------------ reporting

    def stats(self) -> dict[str, float]:
        """``ignored_versions`` (since creation), ``switch_ms`` and ``fetch_gbps`` (of the last switch and fetch): the
        gauges of :func:`mrl_plugins.metrics.record_switch` (bytes and seconds come from the switch reports)."""
        return {
            "ignored_versions": float(len(self._ignored)),
            "switch_ms": self._last_switch_ms,
            "fetch_gbps": (self._last_fetch[0] / self._last_fetch[1] / 1e9) if self._last_fetch[1] else 0.0,
        }

    def close(self) -> None:
        close = getattr(self.tr, "close", None)
        if close is not None:
            close()


class DirectLoader:
    """Upstream weight loading: fetch a new version straight into the live parameters (no staging)."""

    def __init__(self, model: Any, transport_receiver: Any, model_id: str = "policy") -> None:
        self.model = model
        self.tr = transport_receiver
        self.model_id = model_id
        self.version = -1
        self._pending_from = -1
        self._bytes = 0

    def poll(self, timeout: float) -> int | None:
        latest = self.tr.latest_version()
        if latest is None or latest <= self.version:
            return None
        start = time.perf_counter()
        self._bytes = self.tr.fetch_into(latest, dict(self.model.named_parameters()), timeout)
        self._pending_from, self.version = self.version, latest
        self._seconds = time.perf_counter() - start
        return latest

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        if self._pending_from == self.version:
            return None
        rep = SwitchReport(self.model_id, self._pending_from, self.version, self._bytes, self._seconds)
        self._pending_from = self.version
        LOG.info("switch model_id=%s %d -> %d bytes=%d seconds=%.4f (in place, upstream)", *rep.__dict__.values())
        return rep

    @contextmanager
    def active(self) -> Iterator[Any]:
        yield self.model

    def stats(self) -> dict[str, float]:
        return {"version": self.version}

    def close(self) -> None:
        close = getattr(self.tr, "close", None)
        if close is not None:
            close()


class PollInterval:
    """Seconds between version polls: ``fixed``, or automatic.

    Automatic is 3/8 of the mean gap between the last 8 new versions (the middle of the
    quarter-to-half-of-the-update-interval rule), or of the time since the last one once that is longer (no
    version comes while the run takes turns: an idle worker then wakes ever more rarely instead of taking the
    trainer's cores from it every few ms; a publish's notice still wakes it at once), ``initial`` until two versions
    were seen, clamped to [``lo``, ``hi``].
    """

    def __init__(self, fixed: float | None = None, *, initial: float = 0.5, lo: float = 0.01, hi: float = 60.0):
        self.fixed, self.initial, self.lo, self.hi = fixed, initial, lo, hi
        self._seen: list[float] = []

    def arrived(self, when: float | None = None) -> None:
        """A new version arrived (``time.monotonic()`` by default)."""
        self._seen = [*self._seen[-8:], time.monotonic() if when is None else when]

    @property
    def seconds(self) -> float:
        if self.fixed is not None:
            return self.fixed
        if len(self._seen) < 2:
            return self.initial
        gaps = [b - a for a, b in zip(self._seen, self._seen[1:])]
        gap = max(sum(gaps) / len(gaps), time.monotonic() - self._seen[-1])
        return min(self.hi, max(self.lo, 0.375 * gap))


__all__ = ["DirectLoader", "DoubleBufferedReceiver", "PollInterval"]
