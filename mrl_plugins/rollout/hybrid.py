"""Hybrid mode: move rollout workers between the colocated and the dedicated pool with the load.

The two pools (``mode: hybrid``):

* **colocated** -- the worker shares the trainer's device (NPU/CUDA: the trainer's card; CPU: the
  trainer's cores). Inference borrows training capacity.
* **dedicated** -- the worker has a device (CPU: cores) of its own. Training keeps all of its capacity.

First policy (``rollout.rebalance: true``), driven by one signal the trainer measures anyway, the
**wait share**: the fraction of wall time between two generations that the trainer spent waiting for
rollouts (``mrl/time/wait_s`` over the step interval). Over the last ``rebalance_window`` generations:

* mean wait share **above** ``rebalance_high``: generation is the bottleneck and the training side
  idles -- move one dedicated worker into the colocated pool (inference borrows the training device);
* mean wait share **below** ``rebalance_low`` while a worker is colocated: the trainer does not wait, so
  the colocated worker only slows training down -- move it back to a dedicated slot;
* otherwise keep the placement. After a move the window starts over (the move itself and the new
  placement need to show in fresh measurements), which together with the gap between the two
  thresholds keeps the policy from oscillating.

At most one worker moves per decision, and always through
:meth:`~mrl_plugins.rollout.pool.WorkerPool.move_worker` without waiting: the worker's unanswered
requests go to the other workers first, the others keep serving while it restarts in its new place
(the service never stops), and it takes requests again once it reports ready; until then no decision is made
(the generations meanwhile are not measured: they judge neither placement). One worker always stays
dedicated so that a move never leaves the pool without a worker on its own device. Not yet: moving whole
training ranks (the launcher fixes the training world size), signals other than the wait share (queue depth, p99).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mrl_plugins.rollout")

COLOCATED, DEDICATED = "colocated", "dedicated"


@dataclass(frozen=True)
class Move:
    """One decision: worker ``worker`` goes to pool ``to`` (``"colocated"`` or ``"dedicated"``)."""

    worker: int
    to: str
    wait_share: float


def decide(shares: list[float], pools: list[str], *, window: int, high: float, low: float) -> Move | None:
    """The policy as a pure function: ``shares`` are the recent wait shares (oldest first), ``pools`` the
    current pool of each worker. Returns the move to make now, or ``None``."""
    if len(shares) < window:
        return None
    mean = statistics.fmean(shares[-window:])
    dedicated = [i for i, p in enumerate(pools) if p == DEDICATED]
    colocated = [i for i, p in enumerate(pools) if p == COLOCATED]
    if mean > high and len(dedicated) > 1:
        return Move(dedicated[-1], COLOCATED, mean)
    if mean < low and colocated:
        return Move(colocated[-1], DEDICATED, mean)
    return None


class HybridBalancer:
    """Applies :func:`decide` to a live :class:`~mrl_plugins.rollout.pool.WorkerPool`.

    :param placements: the current placement of each worker (as the adapter builds them);
    :param pools: ``"colocated"``/``"dedicated"`` per worker;
    :param colocated: the placement of a colocated worker (the trainer's device/cores).
    """

    def __init__(
        self,
        pool: Any,
        placements: list[dict],
        pools: list[str],
        colocated: dict,
        *,
        window: int = 5,
        high: float = 0.25,
        low: float = 0.05,
        metrics: Any = None,
    ) -> None:
        self.pool = pool
        self.placements = [dict(p) for p in placements]
        self.pools = list(pools)
        self.colocated = dict(colocated)
        # dedicated slots: the dedicated placements at start; a worker returning takes the least used one
        self.slots = [dict(p) for p, kind in zip(placements, pools) if kind == DEDICATED] or [dict(placements[-1])]
        self.window, self.high, self.low = window, high, low
        self.metrics = metrics
        self.shares: deque[float] = deque(maxlen=window)
        self._last: float | None = None

    def observe(self, wait_s: float) -> None:
        """Record one generation (the trainer waited ``wait_s`` for it); move a worker when the policy says so."""
        now = time.monotonic()
        last, self._last = self._last, now
        if last is None or now <= last:
            return
        share = min(1.0, max(0.0, wait_s / (now - last)))
        if self.metrics is not None:
            self.metrics.gauge("rollout/hybrid/wait_share", share)
        if self.pool.workers.draining:  # a move in progress (a restart, up to the engine's start): no decision,
            return  # and its generations judge neither placement
        self.shares.append(share)
        move = decide(list(self.shares), self.pools, window=self.window, high=self.high, low=self.low)
        if move is None:
            return
        place = self.colocated if move.to == COLOCATED else self._free_slot()
        log.info(
            "hybrid: worker %d -> %s pool (mean wait share %.2f over %d generations)",
            move.worker,
            move.to,
            move.wait_share,
            self.window,
        )
        self.pool.move_worker(move.worker, place)
        self.pools[move.worker] = move.to
        self.placements[move.worker] = dict(place)
        self.shares.clear()  # judge the new placement on fresh measurements
        if self.metrics is not None:
            self.metrics.add("rollout/hybrid/moves", 1)
            self.metrics.gauge("rollout/hybrid/colocated_workers", self.pools.count(COLOCATED))

    def _free_slot(self) -> dict:
        used = [p for p, kind in zip(self.placements, self.pools) if kind == DEDICATED]
        return min(self.slots, key=lambda s: sum(1 for p in used if p == s))
