"""``mrl/<stage>/...`` metrics: stages add numbers, the adapter flushes them into TRL's logs."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager


class StageMetrics:
    """Thread-safe accumulator. Counters and timers sum between flushes; gauges keep the last value.

    ``totals`` keeps run-long sums (for reports); ``flush()`` returns and clears the per-log-step view.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, float] = defaultdict(float)
        self._gauges: dict[str, float] = {}
        self.totals: dict[str, float] = defaultdict(float)
        #: set to a list to record every ``time/<kind>_s`` addition as ``(kind, start, end)`` on ``time.monotonic()``
        #: (the interval is taken to end at the addition: each is added as the timed section ends); ``mrl compare``'s
        #: time plot draws them
        self.spans: list[tuple[str, float, float]] | None = None

    def add(self, key: str, value: float) -> None:
        with self._lock:
            self._sums[key] += float(value)
            self.totals[key] += float(value)
            if self.spans is not None and key.startswith("time/") and key.endswith("_s"):
                now = time.monotonic()
                self.spans.append((key[len("time/") : -len("_s")], now - float(value), now))

    def gauge(self, key: str, value: float) -> None:
        with self._lock:
            self._gauges[key] = float(value)
            self.totals[key] = float(value)

    def update(
        self, prefix: str | Mapping[str, float], values: Mapping[str, float] | None = None, *, gauge: bool = False
    ) -> None:
        """Add every number of ``values`` under ``prefix/`` (``update(values)``: keys used as they are)."""
        if not isinstance(prefix, str):
            prefix, values = "", prefix
        for k, v in (values or {}).items():
            if isinstance(v, int | float) and not isinstance(v, bool):
                key = f"{prefix}/{k}" if prefix else k
                (self.gauge if gauge else self.add)(key, v)

    @contextmanager
    def timer(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(key, time.perf_counter() - start)

    def flush(self) -> dict[str, float]:
        with self._lock:
            out = dict(self._sums) | dict(self._gauges)
            self._sums.clear()
            return {k if k.startswith("mrl/") else f"mrl/{k}": v for k, v in out.items()}

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {k if k.startswith("mrl/") else f"mrl/{k}": v for k, v in self.totals.items()}


def record_publish(metrics: StageMetrics | None, report: object) -> None:
    """Counter ``mrl/weights/publish_seconds``: a weight sender's own time for one version (any plugin's report)."""
    if report is not None and metrics is not None:
        metrics.add("mrl/weights/publish_seconds", float(getattr(report, "seconds", 0.0)))


def record_switch(metrics: StageMetrics | None, report: object, stats: Mapping[str, float] | None = None) -> None:
    """One switch of a weight receiver: counters ``mrl/weights/received_bytes``, ``receive_seconds`` (fetch +
    switch), ``switches``; gauges ``active_version``, ``switch_ms``, ``fetch_gbps``, ``ignored_versions``."""
    if report is None or metrics is None:
        return
    metrics.add("mrl/weights/received_bytes", float(report.nbytes))
    metrics.add("mrl/weights/receive_seconds", float(report.seconds))
    metrics.add("mrl/weights/switches", 1.0)
    metrics.gauge("mrl/weights/active_version", float(report.to_version))
    for key in ("switch_ms", "fetch_gbps", "ignored_versions"):
        metrics.gauge(f"mrl/weights/{key}", float((stats or {}).get(key, 0.0)))
