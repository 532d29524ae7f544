"""``rollout.placement: auto``: choose, from measured stage times, between the two ways a run can use its cores.

* **split** (``mrl/rollout/placement`` 0) -- the arrangement as configured: the rollout workers generate on their
  own cores (one batch ahead with ``pipeline: async``) while the trainer trains on the cores left to it
  (``rollout.trainer_cores`` / ``trainer_threads``).
* **turns** (``mrl/rollout/placement`` 1) -- generation and training take turns on *all* of the trainer process's
  cores (the trainer's and its workers'): the trainer's own model generates in the trainer process (no staleness,
  no weight publish), torch threads = every core, the workers (if started) get no request and no weight version,
  so they sleep instead of computing on cores the trainer now uses.

Why: a fixed split starves the trainer whenever generation is the shorter side (measured on 2 CPU cores:
``compare_small`` 0.69x vanilla TRL, the worker idle ~75 % of the time); it pays when the two sides are
balanced or generation dominates.

The policy (pure functions below, :class:`PlacementController` applies them to a running pipeline):

* every generation interval gives one :class:`Sample`: wall seconds per optimizer step, the trainer's own
  time per step (everything but generating and waiting for a batch) and the engine's generation time per step;
* the current arrangement is *measured* (median of its recent samples); the other one is *projected* from the
  same samples: turns from split = ``train / s_train + generate / s_gen``, split from turns =
  ``max(train x s_train, generate x s_gen) x (1 + overhead)``, where ``s_train`` / ``s_gen`` are the speed-ups
  of training / generating on all cores over the split's share (:func:`default_scaling`: x1.7 per doubling of
  threads for training, x1.06 for decode-bound generation, as measured on this kind of machine);
* the run starts in ``rollout.placement_start``: taking turns (the workers start in the background at the lowest
  CPU priority) or the split (the workers start at full speed on their cores; the trainer's own model answers on
  the trainer's cores until they are ready: those warm-up steps are not a measurement of either arrangement);
* the first decision comes after ``probe`` measured steps; the projection is a guess until both arrangements
  have run, so unless the other one is projected hopeless (slower by more than ``EXPLORE_BAND``) the run
  *explores* it for ``probe`` steps and then keeps whichever of the two *measured* faster, as an autotuner does;
* once an arrangement has been measured after a switch, the projection that led to it is calibrated by the
  measurement (``calibration[arr] = measured / projected``), so a wrong scaling guess is corrected from then on;
* exploring is for runs long enough to repay it: with fewer than ``EXPLORE_PAYBACK x (probe + 1)`` generations
  left (the host says how many steps remain) the run keeps its arrangement unless the projection says the other is
  faster by more than ``margin``, and with ``probe + 1`` or fewer left it switches no more (a switch's transition
  would not be repaid);
* later decisions come every ``interval`` steps (completion lengths change as the policy learns) and switch only
  when the other arrangement is projected faster by more than ``margin`` (hysteresis); every switch starts the
  measurement over, skipping the first sample after it (the transition), so the policy cannot flap on one
  noisy step.

Each decision is logged in one line and reported as metrics (``docs/metrics.md``).
"""

from __future__ import annotations

import logging
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

log = logging.getLogger("mrl_plugins.rollout")

SPLIT, TURNS = "split", "turns"
ARRANGEMENTS = (SPLIT, TURNS)
#: ``mrl/rollout/placement`` codes
CODES = {SPLIT: 0, TURNS: 1}
#: speed-up per doubling of torch threads (measured, 2-core CPU: forward+backward x1.67-1.74, decode-like x1.06)
TRAIN_SPEEDUP_PER_DOUBLING = 1.7
GENERATE_SPEEDUP_PER_DOUBLING = 1.06
#: the async split's own cost over max(train, generate): lookahead bookkeeping, transfer, publishing
SPLIT_OVERHEAD = 0.05
CALIBRATION_RANGE = (0.5, 2.0)
#: the other arrangement is explored at the first decision unless projected slower than this share of the measured
EXPLORE_BAND = 0.3
#: exploring costs up to ``probe + 1`` generations in a possibly slower arrangement: it is tried only while at least
#: this many times as many generations are left (a short run keeps what it measured and projected)
EXPLORE_PAYBACK = 4


@dataclass(frozen=True)
class Sample:
    """One generation interval of a run, per optimizer step (seconds)."""

    arrangement: str  # SPLIT or TURNS
    step_s: float  # wall time per optimizer step
    train_s: float  # the trainer's own time per step: all but generating / waiting for the batch
    generate_s: float  # generation per step: the workers' engine time (split) or the trainer's own (turns)


@dataclass(frozen=True)
class Scaling:
    """Speed-ups of the turns arrangement over the split's share of the cores."""

    train: float  # training on all cores vs on the trainer's threads
    generate: float  # generating on all cores vs on a worker's engine threads


def default_scaling(trainer_threads: int, all_threads: int, engine_threads: int) -> Scaling:
    """The speed-ups measured on this kind of machine, per doubling of threads (never below 1)."""

    def speedup(per_doubling: float, base: int) -> float:
        ratio = max(1.0, all_threads / max(1, base))
        return per_doubling ** math.log2(ratio)

    return Scaling(
        speedup(TRAIN_SPEEDUP_PER_DOUBLING, trainer_threads), speedup(GENERATE_SPEEDUP_PER_DOUBLING, engine_threads)
    )


def project_turns(train_s: float, generate_s: float, scaling: Scaling) -> float:
    """Seconds per step taking turns on all cores, from a split measurement (trainer time, worker generation)."""
    return train_s / scaling.train + generate_s / scaling.generate


def project_split(train_s: float, generate_s: float, scaling: Scaling, overhead: float = SPLIT_OVERHEAD) -> float:
    """Seconds per step of the async split, from a turns measurement: the slower side sets the pace."""
    return max(train_s * scaling.train, generate_s * scaling.generate) * (1.0 + overhead)


def other(arrangement: str) -> str:
    return TURNS if arrangement == SPLIT else SPLIT


@dataclass(frozen=True)
class Decision:
    """One check: the arrangement to use from now on, and the figures it was taken from."""

    current: str
    chosen: str
    measured_steps_per_s: float
    projected_steps_per_s: dict[str, float]  # per arrangement: the measured one for `current`
    raw_projection_s: float  # the uncalibrated projection of the other arrangement (seconds per step)
    steps: int  # samples the measurement is the median of
    #: "projected", "measured" (both arrangements measured just now), "explore", or "horizon" (a switch was due but
    #: too few generations are left to repay it)
    reason: str = "projected"
    left: int | None = None  # generations left in the run, when the host knows

    @property
    def switch(self) -> bool:
        return self.chosen != self.current

    def line(self) -> str:
        """The one log line of this decision."""
        verb = f"switch {self.current} -> {self.chosen}" if self.switch else f"keep {self.current}"
        if self.reason == "explore":
            verb = f"explore {self.chosen}"
        elif self.reason == "horizon":
            verb = f"keep {self.current} ({self.left} generations left: a switch would not be repaid)"
        kind = "measured" if self.reason == "measured" else "projected"
        proj = ", ".join(f"{a} {self.projected_steps_per_s[a]:.2f}" for a in ARRANGEMENTS)
        return (
            f"placement: {verb} (measured {self.measured_steps_per_s:.2f} steps/s over {self.steps} steps in "
            f"{self.current}; {kind} steps/s: {proj})"
        )


def decide(
    current: str,
    samples: list[Sample],
    scaling: Scaling,
    *,
    margin: float,
    calibration: float = 1.0,
    other_measured: float | None = None,
    explore_band: float | None = None,
) -> Decision:
    """The policy as a pure function: measure ``current`` (median of ``samples``) and switch when the other
    arrangement is faster by more than ``margin``: its projection (times ``calibration``), or, given
    ``other_measured`` (its steps/s measured just before), that measurement with no margin (the faster of two
    measurements wins). ``explore_band``: the other one was never measured; it is tried unless projected slower
    than ``(1 - explore_band)`` x the measured."""
    step = statistics.median(s.step_s for s in samples)
    train = statistics.median(s.train_s for s in samples)
    gen = statistics.median(s.generate_s for s in samples)
    project = project_turns if current == SPLIT else project_split  # the other arrangement, from current's times
    raw = project(train, gen, scaling)
    projected_other_s = raw * calibration
    measured = 1.0 / step if step > 0 else math.inf
    rate = 1.0 / projected_other_s if projected_other_s > 0 else math.inf
    reason = "projected"
    if other_measured is not None:
        rate, margin, reason = other_measured, 0.0, "measured"
    chosen = other(current) if rate > measured * (1.0 + margin) else current
    if chosen == current and explore_band is not None and rate >= measured * (1.0 - explore_band):
        chosen, reason = other(current), "explore"
    return Decision(current, chosen, measured, {current: measured, other(current): rate}, raw, len(samples), reason)


@dataclass
class PlacementController:
    """Applies :func:`decide` to a running pipeline: :meth:`observe` every generation interval, :meth:`check` at
    each generation (returns the arrangement to use for it). ``force(arr)`` switches at the next check (tests)."""

    scaling: Scaling
    initial: str = TURNS
    interval: int = 10
    margin: float = 0.1
    probe: int = 3
    metrics: Any = None
    current: str = field(init=False)
    decisions: list[Decision] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        self.current = self.initial
        self.calibration = {a: 1.0 for a in ARRANGEMENTS}
        self._samples: list[Sample] = []
        self._skip = 1  # the first interval after a switch (or the run's first) is a transition
        self._pending: tuple[str, float] | None = None  # (arrangement, raw projection) awaiting its measurement
        self._forced: str | None = None
        self._checked = False
        self._ever: set[str] = set()  # arrangements measured at least once
        self._explored_from: tuple[str, float] | None = None  # (arrangement, its steps/s) left to explore

    def split_possible(self, generations: int) -> bool:
        """Whether a run of ``generations`` more generations, starting now in turns, can ever choose the split: its
        first decision comes after the transition and ``probe`` samples, and a switch needs more than ``probe + 1``
        generations left then."""
        return generations - (1 + self.probe) > self.probe + 1

    def force(self, arrangement: str) -> None:
        if arrangement not in ARRANGEMENTS:
            from mrl_plugins.errors import ConfigError, choices

            raise ConfigError(f"placement: unknown arrangement {arrangement!r}; valid: {choices(ARRANGEMENTS)}")
        self._forced = arrangement

    def observe(self, sample: Sample | None) -> None:
        """One generation interval (None: a transition or warm-up interval, not a measurement)."""
        if sample is None or sample.arrangement != self.current:
            return
        if self._skip:
            self._skip -= 1
            return
        self._samples.append(sample)

    def check(self, generations_left: int | None = None) -> str:
        """The arrangement for the next generation (a decision is taken, logged and reported when one is due).
        ``generations_left``: how many generations the run has left, when the host knows (None: unbounded)."""
        if self._forced is not None:
            forced, self._forced = self._forced, None
            if forced != self.current:
                self._switch(forced)
            return self.current
        fresh = self._explored_from is not None and self._explored_from[0] != self.current
        need = self.probe if fresh or not self._checked else self.interval
        if len(self._samples) < need:
            return self.current
        samples = self._samples[-need:]
        if self._pending is not None and self._pending[0] == self.current:  # the projection that led here, measured
            self._calibrate(self.current, statistics.median(s.step_s for s in samples) / self._pending[1])
            self._pending = None
        target = other(self.current)
        calibration = self.calibration[target]
        measured_other = self._explored_from[1] if fresh else None
        explore = target not in self._ever and measured_other is None
        if generations_left is not None and generations_left < EXPLORE_PAYBACK * (self.probe + 1):
            explore = False  # too few generations left to repay trying a possibly slower arrangement
        decision = decide(
            self.current, samples, self.scaling, margin=self.margin, calibration=calibration,
            other_measured=measured_other, explore_band=EXPLORE_BAND if explore else None,
        )  # fmt: skip
        if decision.switch and generations_left is not None and generations_left <= self.probe + 1:
            decision = replace(decision, chosen=self.current, reason="horizon")
        decision = replace(decision, left=generations_left)
        self._ever.add(self.current)
        if measured_other is not None and measured_other > 0 and decision.raw_projection_s > 0:
            # both measured just now: the projection of the other one from this one's stage times is calibrated
            self._calibrate(target, (1.0 / measured_other) / decision.raw_projection_s)
        self._explored_from = (self.current, decision.measured_steps_per_s) if decision.reason == "explore" else None
        self._checked = True
        self._samples = []
        self.decisions.append(decision)
        log.info("mrl-plugins %s", decision.line())
        if self.metrics is not None:
            self.metrics.gauge("rollout/placement_measured_steps_per_s", decision.measured_steps_per_s)
            for a, v in decision.projected_steps_per_s.items():
                self.metrics.gauge(f"rollout/placement_projected_{a}_steps_per_s", v)
        if decision.switch:
            self._pending = (target, decision.raw_projection_s)
            self._switch(target)
        return self.current

    def _calibrate(self, arrangement: str, ratio: float) -> None:
        lo, hi = CALIBRATION_RANGE
        self.calibration[arrangement] = min(hi, max(lo, ratio))

    def _switch(self, target: str) -> None:
        self.current = target
        self._samples = []
        self._skip = 1
        if self.metrics is not None:
            self.metrics.add("rollout/placement_switches", 1)
            self.metrics.gauge("rollout/placement", CODES[target])

    def report(self) -> None:
        """The current arrangement as ``mrl/rollout/placement`` (every generation, so every log line has it)."""
        if self.metrics is not None:
            self.metrics.gauge("rollout/placement", CODES[self.current])
