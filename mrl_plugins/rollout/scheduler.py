"""Multi-model request scheduler: one queue per served model, priorities, throttled intake around weight switches.

Policy (what :meth:`ModelScheduler.next_request` hands out next):

* **Priority, then round-robin, FIFO within a model.** Each model has an integer priority (lower runs first,
  as ``rollout.model_priorities``). Among models with queued requests the lowest *level* wins; models on the
  same level take turns (the one served least recently goes first); within one model requests leave in the order
  they came. So a big model with a long backlog never holds up a small model of the same or a better priority:
  the small one gets every other turn at worst.
* **Aging** (``aging_s``, default 1 s): a queue's level is ``priority - floor(head_wait / aging_s)``, but never
  better than the best configured priority. A low-priority model is therefore not starved -- after waiting it
  joins the round-robin of the top level -- yet it never overtakes a higher-priority model outright.
  ``aging_s=None`` gives strict priorities.

Weight switches (the source document's 10 000 QPS case: a switch costs ~8 ms, during which requests pile up):

* :meth:`begin_switch` marks a model as switching. While it is, **intake for that model is throttled**: a
  :meth:`submit` that finds ``switch_throttle`` or more requests already queued for that model *blocks* until the
  queue drains below the limit or the switch ends, at most ``timeout`` seconds (default ``throttle_timeout_s``), then
  raises :class:`BackpressureError` naming the model, depth and limit. ``timeout=0`` raises at once (callers that
  prefer to shed load). Other models are not affected.
* ``begin_switch(model_id, pause=True)`` also stops handing out that model's requests, so nothing new starts on the
  old weights; :meth:`wait_idle` waits for its in-flight requests to finish; the caller swaps weights and calls
  :meth:`end_switch`, which resumes service and wakes blocked submitters.

Thread-safe: every method may be called from any thread. Statistics (:meth:`stats`, :meth:`metrics`) count
submitted/served/completed/failed/throttled/rejected requests, queue depth and queue waits per model.
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.errors import ConfigError, MrlError, StageTimeoutError, choices

__all__ = ["BackpressureError", "ModelScheduler", "SchedulerClosedError", "Ticket"]

_WAIT_WINDOW = 2048  # recent queue waits kept per model for percentiles


class BackpressureError(MrlError):
    """Intake for a model is throttled (weight switch pending, its queue at ``switch_throttle``) past the timeout."""


class SchedulerClosedError(MrlError):
    """The scheduler was closed; no request is accepted or handed out any more."""


@dataclass
class Ticket:
    """One scheduled request as a worker receives it. Finish it with :meth:`set_result` or :meth:`set_exception`."""

    model_id: str
    request: Any
    future: Future
    seq: int
    enqueued_at: float
    started_at: float | None = None

    @property
    def waited_s(self) -> float:
        """Seconds spent queued (until handed to a worker)."""
        end = self.started_at if self.started_at is not None else time.monotonic()
        return end - self.enqueued_at

    def set_result(self, result: Any) -> None:
        """Complete the request (the submitter's future gets ``result``)."""
        self.future.set_result(result)

    def set_exception(self, exc: BaseException) -> None:
        """Fail the request (the submitter's future raises ``exc``)."""
        self.future.set_exception(exc)


@dataclass
class _ModelState:
    priority: int
    queue: deque = field(default_factory=deque)
    switching: bool = False
    paused: bool = False
    last_served: int = -1
    in_flight: int = 0
    submitted: int = 0
    served: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    throttled: int = 0
    rejected: int = 0
    max_depth: int = 0
    switches: int = 0
    waits: deque = field(default_factory=lambda: deque(maxlen=_WAIT_WINDOW))


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    idx = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[idx]


class ModelScheduler:
    """Per-model queues with priorities, aging and switch throttling (see the module docstring for the policy).

    :param priorities: ``model_id -> priority`` (int, lower runs first).
    :param switch_throttle: max requests queued for a model while its weight switch is pending (>= 0).
    :param aging_s: seconds of head-of-queue wait that improve a queue's level by one (``None``: strict).
    :param throttle_timeout_s: default seconds a throttled :meth:`submit` blocks before BackpressureError.
    """

    def __init__(
        self,
        priorities: Mapping[str, int],
        switch_throttle: int = 64,
        *,
        aging_s: float | None = 1.0,
        throttle_timeout_s: float = 5.0,
    ) -> None:
        if not isinstance(priorities, Mapping) or not priorities:
            raise ConfigError("rollout.model_priorities: a non-empty mapping model_id -> int priority is required")
        for mid, prio in priorities.items():
            if not isinstance(mid, str) or not mid:
                raise ConfigError(f"rollout.model_priorities: model ids must be non-empty strings, got {mid!r}")
            if isinstance(prio, bool) or not isinstance(prio, int):
                raise ConfigError(f"rollout.model_priorities[{mid!r}]: priority must be an int, got {prio!r}")
        if isinstance(switch_throttle, bool) or not isinstance(switch_throttle, int) or switch_throttle < 0:
            raise ConfigError(f"rollout.switch_throttle: must be an int >= 0, got {switch_throttle!r}")
        if aging_s is not None and not aging_s > 0:
            raise ConfigError(f"aging_s: must be > 0 or None (strict priorities), got {aging_s!r}")
        if not throttle_timeout_s >= 0:
            raise ConfigError(f"throttle_timeout_s: must be >= 0, got {throttle_timeout_s!r}")
        self.switch_throttle = switch_throttle
        self.aging_s = aging_s
        self.throttle_timeout_s = float(throttle_timeout_s)
        self._models = {mid: _ModelState(priority=int(p)) for mid, p in priorities.items()}
        self._best = min(st.priority for st in self._models.values())
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._turn = itertools.count()
        self._closed = False

    # ------------------------------------------------------------------------------------------------ helpers
    def _state(self, model_id: str) -> _ModelState:
        try:
            return self._models[model_id]
        except KeyError:
            raise ConfigError(f"model_id {model_id!r} is not served; valid: {choices(self._models)}") from None

    @property
    def model_ids(self) -> list[str]:
        """The served models."""
        return list(self._models)

    def _level(self, st: _ModelState, now: float) -> int:
        if self.aging_s is None:
            return st.priority
        waited = now - st.queue[0].enqueued_at
        return max(self._best, st.priority - int(waited // self.aging_s))

    # ------------------------------------------------------------------------------------------------ intake
    def submit(
        self, model_id: str, request: Any, *, timeout: float | None = None, wait_hook: Callable[[], None] | None = None
    ) -> Future:
        """Queue ``request`` for ``model_id``; returns the future its worker completes.

        While a weight switch of ``model_id`` is pending and ``switch_throttle`` requests are already queued for
        it, blocks up to ``timeout`` seconds (default ``throttle_timeout_s``; 0 = do not block) for room, then
        raises :class:`BackpressureError`. ConfigError for an unknown model; SchedulerClosedError after close.
        ``wait_hook`` (optional) is called repeatedly instead of sleeping while throttled, without the lock held:
        a caller that also dispatches (single-threaded pools) serves requests and ends the switch from it; it
        should return within a fraction of a second.
        """
        wait_s = self.throttle_timeout_s if timeout is None else float(timeout)
        if wait_s < 0:
            raise ConfigError(f"timeout: must be >= 0, got {timeout!r}")
        with self._cond:
            st = self._state(model_id)
            if self._closed:
                raise SchedulerClosedError(f"scheduler is closed; cannot submit for {model_id!r}")
            if st.switching and len(st.queue) >= self.switch_throttle:
                st.throttled += 1
                deadline = time.monotonic() + wait_s
                while st.switching and len(st.queue) >= self.switch_throttle and not self._closed:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        st.rejected += 1
                        raise BackpressureError(
                            f"intake for model {model_id!r} throttled: weight switch pending and {len(st.queue)} "
                            f"requests queued (switch_throttle={self.switch_throttle}); no room within {wait_s:g} s"
                        )
                    if wait_hook is None:
                        self._cond.wait(remaining)
                        continue
                    self._cond.release()
                    try:
                        wait_hook()
                    finally:
                        self._cond.acquire()
                if self._closed:
                    raise SchedulerClosedError(f"scheduler closed while {model_id!r} intake was throttled")
            fut: Future = Future()
            ticket = Ticket(model_id, request, fut, next(self._seq), time.monotonic())
            st.queue.append(ticket)
            st.submitted += 1
            st.max_depth = max(st.max_depth, len(st.queue))
            self._cond.notify_all()
            return fut

    # ------------------------------------------------------------------------------------------------ workers
    def _pick(self, now: float) -> _ModelState | None:
        best: tuple[int, int] | None = None
        chosen = None
        for st in self._models.values():
            if not st.queue or st.paused:
                continue
            key = (self._level(st, now), st.last_served)
            if best is None or key < best:
                best, chosen = key, st
        return chosen

    def next_request(self, timeout: float | None = None) -> Ticket | None:
        """The next request by policy, waiting up to ``timeout`` seconds (``None``: until one comes or close).

        Returns ``None`` on timeout or when the scheduler is closed. Requests whose future was cancelled while
        queued are skipped.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                st = self._pick(now)
                if st is not None:
                    ticket = st.queue.popleft()
                    self._cond.notify_all()  # room for throttled submitters
                    if not ticket.future.set_running_or_notify_cancel():
                        st.cancelled += 1
                        continue
                    ticket.started_at = now
                    st.last_served = next(self._turn)
                    st.served += 1
                    st.in_flight += 1
                    st.waits.append(now - ticket.enqueued_at)
                    ticket.future.add_done_callback(lambda f, s=st: self._finished(s, f))
                    return ticket
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - now
                    if remaining <= 0:
                        return None
                    self._cond.wait(remaining)

    def _finished(self, st: _ModelState, fut: Future) -> None:
        with self._cond:
            st.in_flight -= 1
            if fut.cancelled() or fut.exception() is not None:
                st.failed += 1
            else:
                st.completed += 1
            self._cond.notify_all()

    # ------------------------------------------------------------------------------------------------ switches
    def begin_switch(self, model_id: str, *, pause: bool = False) -> None:
        """Start throttling intake for ``model_id`` (and, with ``pause``, stop handing out its requests)."""
        with self._cond:
            st = self._state(model_id)
            if st.switching:
                raise ConfigError(f"begin_switch({model_id!r}): a switch is already pending; call end_switch first")
            st.switching = True
            st.paused = bool(pause)
            st.switches += 1

    def end_switch(self, model_id: str) -> None:
        """End the switch of ``model_id``: full intake and service resume, blocked submitters wake up."""
        with self._cond:
            st = self._state(model_id)
            if not st.switching:
                raise ConfigError(f"end_switch({model_id!r}): no switch pending (call begin_switch first)")
            st.switching = False
            st.paused = False
            self._cond.notify_all()

    def wait_idle(self, model_id: str, timeout: float) -> None:
        """Wait until ``model_id`` has no request in flight; StageTimeoutError after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            st = self._state(model_id)
            while st.in_flight > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StageTimeoutError(
                        f"model {model_id!r} still has {st.in_flight} request(s) in flight after {timeout:g} s"
                    )
                self._cond.wait(remaining)

    # ------------------------------------------------------------------------------------------------ stats
    def depth(self, model_id: str) -> int:
        """Requests queued (not yet handed out) for ``model_id``."""
        with self._cond:
            return len(self._state(model_id).queue)

    def in_flight(self, model_id: str) -> int:
        """Requests handed out for ``model_id`` and not finished yet."""
        with self._cond:
            return self._state(model_id).in_flight

    def stats(self) -> dict[str, dict[str, float]]:
        """Per model: queue_depth, in_flight, submitted, served, completed, failed, cancelled, throttled,
        rejected, max_depth, switches, switching, and queue waits (wait_mean_ms, wait_p50_ms, wait_p99_ms,
        wait_max_ms) over the last 2048 requests handed out."""
        out: dict[str, dict[str, float]] = {}
        with self._cond:
            for mid, st in self._models.items():
                waits = list(st.waits)
                out[mid] = {
                    "priority": st.priority,
                    "queue_depth": len(st.queue),
                    "in_flight": st.in_flight,
                    "submitted": st.submitted,
                    "served": st.served,
                    "completed": st.completed,
                    "failed": st.failed,
                    "cancelled": st.cancelled,
                    "throttled": st.throttled,
                    "rejected": st.rejected,
                    "max_depth": st.max_depth,
                    "switches": st.switches,
                    "switching": float(st.switching),
                    "wait_mean_ms": 1000 * sum(waits) / len(waits) if waits else 0.0,
                    "wait_p50_ms": 1000 * _percentile(waits, 0.5),
                    "wait_p99_ms": 1000 * _percentile(waits, 0.99),
                    "wait_max_ms": 1000 * max(waits, default=0.0),
                }
        return out

    def metrics(self, prefix: str = "mrl/rollout/sched") -> dict[str, float]:
        """:meth:`stats` flattened to ``{prefix}/{model_id}/{name}`` keys (TRL log format)."""
        return {
            f"{prefix}/{mid}/{name}": float(value) for mid, row in self.stats().items() for name, value in row.items()
        }

    # ------------------------------------------------------------------------------------------------ shutdown
    def close(self) -> int:
        """Stop: cancel every queued request, wake all waiters. Returns how many were cancelled. Idempotent."""
        with self._cond:
            self._closed = True
            n = 0
            for st in self._models.values():
                while st.queue:
                    ticket = st.queue.popleft()
                    if ticket.future.cancel():
                        st.cancelled += 1
                        n += 1
            self._cond.notify_all()
            return n

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed
