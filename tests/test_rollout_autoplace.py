"""``rollout.placement: auto``: the decision rule as pure functions, the controller's cadence and hysteresis, the
config's refusals, and a real TRL GRPO run that switches between the split and taking turns on all cores."""

from __future__ import annotations

import os
import time

import pytest

from mrl_plugins.rollout.autoplace import (
    SPLIT,
    TURNS,
    PlacementController,
    Sample,
    Scaling,
    decide,
    default_scaling,
    project_split,
    project_turns,
)
from tests.marks import require_trl

TWO = Scaling(train=1.7, generate=1.06)  # 1 -> 2 threads, as measured on the development machine
#: generations left: too few to repay exploring (< EXPLORE_PAYBACK x (probe + 1)), enough to switch (> probe + 1)
SHORT = 11


def test_default_scaling_follows_the_measured_speedups_per_doubling():
    s = default_scaling(trainer_threads=1, all_threads=2, engine_threads=1)
    assert s.train == pytest.approx(1.7) and s.generate == pytest.approx(1.06)
    four = default_scaling(1, 4, 1)
    assert four.train == pytest.approx(1.7**2) and four.generate == pytest.approx(1.06**2)
    assert default_scaling(2, 2, 2) == Scaling(1.0, 1.0)  # nothing to gain: no speed-up assumed


def test_projections():
    # split -> turns: both stages run one after the other, each on all cores
    assert project_turns(0.34, 0.106, TWO) == pytest.approx(0.2 + 0.1)
    # turns -> split: the slower side sets the pace, plus the pipeline's overhead
    assert project_split(0.2, 0.1, TWO, overhead=0.0) == pytest.approx(0.34)
    assert project_split(0.1, 0.5, TWO, overhead=0.1) == pytest.approx(0.5 * 1.06 * 1.1)


def _samples(arr, step, train, gen, n=3):
    return [Sample(arr, step, train, gen) for _ in range(n)]


def test_short_generation_keeps_taking_turns():
    """The issue's compare_small shape: generation a small share, a one-core trainer would starve."""
    d = decide(TURNS, _samples(TURNS, 0.3, 0.2, 0.1), TWO, margin=0.1)
    assert d.chosen == TURNS and not d.switch
    assert d.measured_steps_per_s == pytest.approx(1 / 0.3)
    assert d.projected_steps_per_s[SPLIT] == pytest.approx(1 / (0.34 * 1.05))


def test_balanced_or_generation_bound_run_goes_to_the_split():
    d = decide(TURNS, _samples(TURNS, 0.6, 0.15, 0.45), TWO, margin=0.1)
    assert d.switch and d.chosen == SPLIT
    assert "switch turns -> split" in d.line() and "projected steps/s: split" in d.line()


def test_trainer_bound_split_goes_back_to_taking_turns():
    # measured split: 0.4 s per step set by a 0.4 s one-core trainer, the worker generates 0.1 s of it
    d = decide(SPLIT, _samples(SPLIT, 0.4, 0.4, 0.1), TWO, margin=0.1)
    assert d.switch and d.chosen == TURNS
    assert d.projected_steps_per_s[TURNS] == pytest.approx(1 / (0.4 / 1.7 + 0.1 / 1.06))


def test_within_the_margin_nothing_switches():
    # turns projected ~5 % faster than the measured split: below the 10 % margin
    step = (0.3 / 1.7 + 0.1 / 1.06) * 1.05
    assert not decide(SPLIT, _samples(SPLIT, step, 0.3, 0.1), TWO, margin=0.1).switch
    assert decide(SPLIT, _samples(SPLIT, step, 0.3, 0.1), TWO, margin=0.0).switch


def test_median_ignores_one_slow_step():
    samples = _samples(TURNS, 0.3, 0.2, 0.1) + [Sample(TURNS, 5.0, 0.2, 4.8)]
    assert decide(TURNS, samples, TWO, margin=0.1).chosen == TURNS


def test_controller_probes_then_checks_every_interval_and_reports(metrics_sink):
    c = PlacementController(TWO, initial=TURNS, interval=4, probe=2, margin=0.1, metrics=metrics_sink)
    c.observe(Sample(TURNS, 9.0, 0.2, 8.8))  # the first interval is a transition: skipped
    c.observe(Sample(TURNS, 0.3, 0.2, 0.1))
    assert c.check(SHORT) == TURNS and not c.decisions  # one sample < probe
    c.observe(Sample(TURNS, 0.3, 0.2, 0.1))
    assert c.check(SHORT) == TURNS and len(c.decisions) == 1  # the probe decision (not explored: SHORT)
    assert metrics_sink.gauges["rollout/placement_measured_steps_per_s"] == pytest.approx(1 / 0.3)
    assert "rollout/placement_projected_split_steps_per_s" in metrics_sink.gauges
    for _ in range(3):
        c.observe(Sample(TURNS, 0.3, 0.2, 0.1))
        assert c.check(SHORT) == TURNS and len(c.decisions) == 1  # next check after `interval` samples
    c.observe(Sample(TURNS, 0.3, 0.2, 0.1))
    c.check(SHORT)
    assert len(c.decisions) == 2 and metrics_sink.sums.get("rollout/placement_switches", 0) == 0
    c.report()
    assert metrics_sink.gauges["rollout/placement"] == 1


def test_controller_switches_measures_afresh_and_calibrates(metrics_sink):
    c = PlacementController(TWO, initial=TURNS, interval=3, probe=3, margin=0.1, metrics=metrics_sink)
    c.observe(None)  # warm-up interval: not a measurement
    for _ in range(4):  # generation-bound in turns: split projected at max(0.25, 0.53) x 1.05 = 0.56 s
        c.observe(Sample(TURNS, 0.65, 0.15, 0.5))
    assert c.check() == SPLIT
    assert metrics_sink.sums["rollout/placement_switches"] == 1 and metrics_sink.gauges["rollout/placement"] == 0
    projected = c.decisions[-1].raw_projection_s
    c.observe(Sample(TURNS, 0.3, 0.2, 0.1))  # a late sample of the old arrangement is ignored
    c.observe(Sample(SPLIT, 3.0, 0.3, 0.5))  # the transition after the switch is skipped
    for _ in range(3):  # the split measures 20 % slower than projected
        c.observe(Sample(SPLIT, projected * 1.2, 0.25, 0.5))
    assert c.check() == SPLIT  # turns projected at 0.25 / 1.7 + 0.5 / 1.06 = 0.62 s: slower, kept
    assert c.calibration[SPLIT] == pytest.approx(1.2)


def test_alternating_noise_near_a_tie_does_not_flap(metrics_sink):
    c = PlacementController(TWO, initial=SPLIT, interval=3, probe=3, margin=0.1, metrics=metrics_sink)
    tie = (0.3 / 1.7 + 0.1 / 1.06) * 1.03  # split about as fast as turns would be
    for i in range(60):
        c.observe(Sample(SPLIT, tie * (1.04 if i % 2 else 0.96), 0.3, 0.1))
        c.check(SHORT)  # not explored
    assert metrics_sink.sums.get("rollout/placement_switches", 0) == 0
    assert len(c.decisions) == (60 - 1) // 3  # the first interval is a transition


@pytest.mark.parametrize(("split_step", "kept"), [(0.4, SPLIT), (0.6, TURNS)])
def test_first_decision_explores_and_keeps_the_faster_measurement(split_step, kept):
    """Turns measured at 0.5 s/step, the split projected a little slower: tried anyway, then the faster of the
    two measurements wins (no margin between two measurements)."""
    c = PlacementController(TWO, initial=TURNS, interval=10, probe=3, margin=0.1)
    for _ in range(4):
        c.observe(Sample(TURNS, 0.5, 0.3, 0.2))  # split projected max(0.51, 0.21) x 1.05 = 0.54 s
    assert c.check() == SPLIT and c.decisions[-1].reason == "explore"
    assert "explore split" in c.decisions[-1].line()
    for _ in range(4):
        c.observe(Sample(SPLIT, split_step, split_step, 0.2))
    assert c.check() == kept and c.decisions[-1].reason == "measured"
    assert c.decisions[-1].projected_steps_per_s[TURNS] == pytest.approx(2.0)  # the turns measurement
    raw_turns = split_step / 1.7 + 0.2 / 1.06  # turns projected from the split's stage times
    assert c.calibration[TURNS] == pytest.approx(min(2.0, 0.5 / raw_turns))  # calibrated by that measurement
    for _ in range(12):  # later decisions project (calibrated), every `interval` samples, no more exploring
        c.observe(Sample(kept, 0.5, 0.3, 0.2))
        c.check()
    assert len(c.decisions) == 3 and c.decisions[-1].reason == "projected"


@pytest.mark.parametrize(("left", "chosen"), [(None, SPLIT), (16, SPLIT), (15, TURNS), (4, TURNS)])
def test_exploring_needs_a_run_long_enough_to_repay_it(left, chosen):
    """The same first decision as above (split projected a little slower: explored) with the run's remaining
    generations known: under EXPLORE_PAYBACK x (probe + 1) = 16 left, the run keeps what it measured."""
    c = PlacementController(TWO, initial=TURNS, interval=10, probe=3, margin=0.1)
    for _ in range(4):
        c.observe(Sample(TURNS, 0.5, 0.3, 0.2))
    assert c.check(generations_left=left) == chosen
    assert c.decisions[-1].reason == ("explore" if chosen == SPLIT else "projected")


@pytest.mark.parametrize(("left", "switches"), [(5, 1), (4, 0), (1, 0)])
def test_no_switch_in_the_last_generations(left, switches, metrics_sink):
    """Projected faster by far (generation-bound in turns), the switch still needs more than probe + 1 generations
    left: its transition is never repaid in fewer."""
    c = PlacementController(TWO, initial=TURNS, interval=3, probe=3, margin=0.1, metrics=metrics_sink)
    for _ in range(4):
        c.observe(Sample(TURNS, 0.65, 0.15, 0.5))
    c.check(generations_left=left)
    assert metrics_sink.sums.get("rollout/placement_switches", 0) == switches
    assert c.current == (SPLIT if switches else TURNS)


def test_the_horizon_decision_says_why_it_keeps():
    c = PlacementController(TWO, initial=TURNS, interval=3, probe=3, margin=0.1)
    for _ in range(4):
        c.observe(Sample(TURNS, 0.65, 0.15, 0.5))
    c.check(generations_left=3)
    d = c.decisions[-1]
    assert (d.reason, d.chosen, d.left) == ("horizon", TURNS, 3)
    assert d.line().startswith("placement: keep turns (3 generations left: a switch would not be repaid)")
    assert [c.split_possible(n) for n in (8, 9)] == [False, True]


def test_a_hopeless_projection_is_not_explored():
    # generation 10 % of the step: a one-core trainer would take 1.7 x 0.9 s; more than 30 % slower
    d = decide(TURNS, _samples(TURNS, 1.0, 0.9, 0.1), TWO, margin=0.1, explore_band=0.3)
    assert d.chosen == TURNS and d.reason == "projected"
    d = decide(TURNS, _samples(TURNS, 1.0, 0.6, 0.4), TWO, margin=0.1, explore_band=0.3)
    assert d.chosen == SPLIT and d.reason == "explore"


def test_force_switches_at_the_next_check(metrics_sink):
    c = PlacementController(TWO, initial=TURNS, metrics=metrics_sink)
    c.force(SPLIT)
    assert c.check() == SPLIT and metrics_sink.sums["rollout/placement_switches"] == 1 and not c.decisions
    with pytest.raises(Exception, match="valid: 'split' or 'turns'"):
        c.force("both")


def test_bad_placement_settings_are_refused():
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.placement: 'sometimes' invalid; valid: 'auto' or 'fixed'"):
        load_config({"rollout": {"placement": "sometimes"}})
    with pytest.raises(ConfigError, match="rollout.placement_margin: must be in"):
        load_config({"rollout": {"placement_margin": 1.5}})
    with pytest.raises(ConfigError, match="rollout.trainer_cores: an empty list leaves that side with no core"):
        load_config({"rollout": {"trainer_cores": []}})
    with pytest.raises(ConfigError, match="rollout.engine_cores: an empty list"):
        load_config({"rollout": {"engine_cores": []}})
    assert load_config("compare_small").rollout.placement == "auto"
    assert load_config("compare_kl").rollout.placement == "auto"


def test_auto_is_the_default_and_decides_wherever_the_run_can_choose():
    """placement 'auto' (the default) decides for one training process with local workers whose engine the
    trainer's own model stands in for; elsewhere the run keeps the configured split and the reason is named."""
    from mrl_plugins.config import load_config
    from mrl_plugins.hookspecs import RolloutEngine
    from mrl_plugins.rollout.plugin import engine_registrations

    engines = {r.name: r for r in engine_registrations()}
    rc = load_config({}).rollout
    assert rc.placement == "auto" and rc.fixed_by("colocate", 1, engines["transformers"]) is None
    assert rc.fixed_by("disaggregated") is None
    assert rc.fixed_by("colocate", 2) == "2 training processes"
    assert rc.fixed_by("hybrid") == "mode hybrid"
    assert rc.fixed_by("colocate", 1, engines["vllm"]) == "the trainer's own model does not stand in for engine 'vllm'"
    assert rc.fixed_by("colocate", 1, RolloutEngine(name="x", factory=dict)).endswith("engine 'x'")
    assert load_config({"rollout": {"workers": 0}}).rollout.fixed_by("colocate") == "no local rollout workers"
    remote = load_config({"rollout": {"workers": 0, "remote_workers": 1}}).rollout
    assert remote.fixed_by("colocate") == "no local rollout workers"
    assert load_config({"rollout": {"remote_workers": 1}}).rollout.fixed_by("colocate") == "remote workers"
    hybrid = load_config({"mode": "hybrid", "rollout": {"workers": 2, "colocated_workers": 1, "rebalance": True}})
    assert hybrid.rollout.fixed_by("hybrid") == "rollout.rebalance moves the workers instead"
    assert load_config({"rollout": {"placement": "fixed"}}).rollout.fixed_by("colocate") == "placement: fixed"


class _Sink:
    def __init__(self) -> None:
        self.gauges: dict[str, float] = {}
        self.sums: dict[str, float] = {}

    def gauge(self, key: str, value: float) -> None:
        self.gauges[key] = value

    def add(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + value


@pytest.fixture
def metrics_sink() -> _Sink:
    return _Sink()


def _slow_reward(completions, **kwargs):
    from mrl_plugins.demo.models import count_reward

    time.sleep(0.15)
    return count_reward(completions)


def _cpu_s(pid: int) -> float:
    import psutil

    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def placement_run(tmp_path, steps: int, rollout: dict, *, slow_reward: bool = False):
    """A ``tiny`` GRPO trainer with the plugins enabled in colocate mode with ``rollout`` (1 torch thread; skipped
    below 2 cores). ``slow_reward``: the worker's lookahead is answered before the loss forward pass."""
    import torch

    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": "tiny", "steps": steps, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    if slow_reward:
        trainer.reward_funcs = [_slow_reward]
    mrl_plugins.enable(trainer, {"mode": "colocate", "rollout": rollout})
    return trainer


@pytest.mark.slow
@require_trl
def test_a_default_run_measures_its_placement_and_a_hybrid_one_says_why_it_keeps_the_split(tmp_path, capfd):
    """No placement key: the run takes turns first under the controller (a 4-step run: every batch from the
    trainer's own model, no worker started, the arrangement on every log line); a run where auto has nothing to
    choose (mode hybrid with rebalance) keeps its split and enable()'s line says why."""
    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer
    from tests.pool_helpers import record_sources

    trainer = placement_run(tmp_path, 4, {"workers": 1})
    assert "placement auto: this split or taking turns" in capfd.readouterr().err
    runtime = trainer._mrl_state.runtime
    sources = record_sources(runtime)
    trainer.train()
    assert runtime.where.controller is not None and sources == ["turns"] * 4
    assert runtime._pool is None  # no pool started
    codes = [h["mrl/rollout/placement"] for h in trainer.state.log_history if "loss" in h]
    assert codes == [1, 1, 1, 1]

    cfg = load_config({"train": {"model": "tiny", "steps": 2, "output_dir": str(tmp_path / "h")}})
    hybrid = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path / "h"))
    rollout = {"workers": 2, "colocated_workers": 1, "rebalance": True, "oversubscribe": True}
    mrl_plugins.enable(hybrid, {"mode": "hybrid", "rollout": rollout})
    assert "placement: this split (rollout.rebalance moves the workers instead)" in capfd.readouterr().err
    assert hybrid._mrl_state.runtime.where.controller is None
    mrl_plugins.disable(hybrid)


@pytest.mark.slow
@require_trl
@pytest.mark.parametrize(("steps", "starts"), [(8, False), (12, True)])
def test_a_run_too_short_for_the_split_never_starts_its_workers(tmp_path, caplog, keep_arrangement, steps, starts):
    """Taking turns from the start, the workers start at the first generation only when the run has enough
    generations left for the controller ever to choose the split (more than 2 x probe + 2 = 8): an 8-step run
    generates every batch with the trainer's own model and never spawns them; a 12-step one starts them."""
    import logging

    trainer = placement_run(tmp_path, steps, {"workers": 1, "placement": "auto"})
    from tests.pool_helpers import record_sources

    runtime = trainer._mrl_state.runtime
    sources = record_sources(runtime)
    started: list[int] = []
    real_start = runtime._start_pool
    runtime._start_pool = lambda: (started.append(sources.count("turns")), real_start())[1]
    with caplog.at_level(logging.INFO, logger="mrl_plugins.rollout"):
        trainer.train()
    # kept (keep_arrangement): every batch from the trainer's own model
    assert sources.count("turns") == steps
    assert started == ([0] if starts else [])  # at the first generation, before it is generated
    said = [r.getMessage() for r in caplog.records if "too few for the split" in r.getMessage()]
    assert said == ([] if starts else [f"mrl-plugins placement: {steps} generations left: too few for the split to "
                                       "be chosen; the rollout workers are not started (the trainer's own model "
                                       "generates, on all cores)"])  # fmt: skip


@pytest.mark.slow
@require_trl
def test_grpo_run_switches_arrangement_without_losing_samples(tmp_path, monkeypatch, keep_arrangement):
    """A real GRPO run with placement auto, switched turns -> split -> turns by force: every batch is answered
    once with the prompts asked for, versions stay within the bound (0 while taking turns), the trainer gets the
    worker's core while taking turns and the idle worker does not compute, and the decisions are logged."""
    import psutil
    import torch
    from transformers import TrainerCallback

    from tests.pool_helpers import record_sources

    steps = 16
    trainer = placement_run(tmp_path, steps, {"workers": 1, "placement": "auto", "local_warmup": True})
    state = trainer._mrl_state
    runtime = state.runtime
    # this run switches by force only (keep_arrangement: its decisions are taken, logged and reported)
    runtime.where.share.lend_cpu = False  # the split keeps the trainer on its own core here (lending: the next test)
    gen = trainer.vllm_generation
    calls: list[dict] = []
    sources = record_sources(runtime)
    orig_generate = runtime.generate

    def generate(prompts, num_generations, model_id):
        result = orig_generate(prompts, num_generations, model_id)
        calls.append(
            {
                "arr": sources[-1],
                "asked": [list(p) for p in prompts],
                "got": [list(p) for p in result.prompt_ids],
                "n": len(result.completion_ids),
                "version": result.weight_version,
                "current": gen.version,
            }
        )
        return result

    runtime.generate = generate
    seen: dict[int, dict] = {}

    class Steer(TrainerCallback):
        def on_step_end(self, args, st, control, **kw):
            step = int(st.global_step)
            pid = runtime.pool.pids[0]
            seen[step] = {
                "arr": runtime.where.arrangement,
                "cores": sorted(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads(),
                "nice": psutil.Process(pid).nice(),
                "ready": runtime.pool.ready,
                "worker_cores": psutil.Process(pid).cpu_affinity(),
            }
            if step == 2:
                runtime.where.controller.force("split")
            if step == 4:  # let the workers finish starting so the split phase is served by them
                deadline = time.monotonic() + 120
                while not runtime.pool.ready and time.monotonic() < deadline:
                    time.sleep(0.05)
            if step == 8:
                runtime.where.controller.force("turns")
            if step == 10:  # the lookahead held at the switch is used by now: the worker has nothing to do
                seen["worker_cpu_0"] = _cpu_s(runtime.pool.pids[0])
                time.sleep(1.0)
            if step == steps:
                seen["worker_cpu_1"] = _cpu_s(runtime.pool.pids[0])

    trainer.add_callback(Steer())
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hist) == steps
    # arrangement per step: turns, then the split (after the forced switch), then turns again
    assert seen[1]["arr"] == "turns" and seen[1]["cores"] == [0, 1] and seen[1]["threads"] == 2
    # the workers start meanwhile, spawned on their own core, at the lowest priority until they are ready
    assert seen[1]["worker_cores"] == [1] and (seen[1]["ready"] or seen[1]["nice"] == 19)
    if os.geteuid() == 0:  # lowering the nice value back needs the privilege
        assert seen[steps]["nice"] == 0
    assert all(seen[s]["arr"] == "split" and seen[s]["cores"] == [0] and seen[s]["threads"] == 1 for s in (5, 6, 7))
    trace = [(s, seen[s]["arr"], seen[s]["cores"], seen[s]["threads"]) for s in range(1, steps + 1)]
    assert all(seen[s]["arr"] == "turns" and seen[s]["cores"] == [0, 1] for s in range(10, steps + 1)), trace
    assert all(seen[s]["threads"] == 2 for s in range(10, steps + 1))
    # every generation answered exactly the prompts it asked for, once, with one completion each
    assert len(calls) == steps
    for c in calls:
        assert c["got"] == c["asked"] and c["n"] == len(c["asked"])
    assert len({tuple(map(tuple, c["asked"])) for c in calls}) == steps  # no batch served twice
    split = [c for c in calls if c["arr"] == "split"]
    assert sources.count("split") >= 3 and sources.count("turns") >= 2 + (steps - 9)
    assert all(0 <= c["current"] - c["version"] <= 1 for c in split)
    assert all(c["version"] == c["current"] for c in calls if c["arr"] == "turns")
    totals = state.ctx.metrics.totals
    assert totals.get("rollout/discarded_batches", 0) == 0  # the lookahead held at the switch was used
    assert totals["rollout/placement_switches"] == 2
    # the idle worker computed nothing while the trainer used its core (1 s sleep included in the window)
    assert seen["worker_cpu_1"] - seen["worker_cpu_0"] < 0.15
    # decisions: placement on every log line, 1 / 0 / 1; a decision with both projections in the last phase
    codes = [h["mrl/rollout/placement"] for h in hist]
    assert codes[0] == 1 and 0 in codes and codes[-1] == 1
    assert any("mrl/rollout/placement_projected_split_steps_per_s" in h for h in hist)
    assert any("mrl/rollout/placement_measured_steps_per_s" in h for h in hist)
    decisions = runtime.where.controller.decisions
    assert decisions and all(d.chosen == d.current for d in decisions)


@pytest.mark.slow
@require_trl
def test_split_lends_the_idle_workers_core_to_the_trainer(tmp_path, monkeypatch, keep_arrangement):
    """In the split, once the worker has answered the lookahead the trainer borrows its core between its layers and
    gives it back before the next request; while lent the worker computes nothing (no oversubscription)."""

    import torch

    from tests.pool_helpers import steer_placement

    steps = 14
    trainer = placement_run(tmp_path, steps, {"workers": 1, "placement": "auto"}, slow_reward=True)
    state = trainer._mrl_state
    runtime = state.runtime
    lent: list[dict] = []  # per lend: trainer cores while lent, worker CPU seconds and wall seconds while lent
    share = runtime.where.share
    orig_check, orig_apply = share.check, share.apply

    def lend_check(*a):
        was = share.now
        orig_check(*a)
        if was == "split" and share.now == "lent":
            pid = runtime.pool.pids[0]
            lent.append({"cores": sorted(os.sched_getaffinity(0)), "threads": torch.get_num_threads(), "pid": pid})
            lent[-1]["cpu0"], lent[-1]["t0"] = _cpu_s(pid), time.perf_counter()

    def apply_budget(arr):
        if share.now == "lent" and lent and "cpu1" not in lent[-1]:
            lent[-1]["cpu1"], lent[-1]["t1"] = _cpu_s(lent[-1]["pid"]), time.perf_counter()
        orig_apply(arr)

    share.check, share.apply = lend_check, apply_budget
    for hook in share.hooks:  # none yet: they are installed at the first split batch
        hook.remove()

    trainer.add_callback(steer_placement(runtime, {1: "split"}))
    submitted_while_lent = []
    orig_submit = None

    def watch_submit(*a, **k):
        submitted_while_lent.append(share.now == "lent")
        return orig_submit(*a, **k)

    def on_first_split(*a, **k):
        nonlocal orig_submit
        if orig_submit is None and runtime._pool is not None:
            orig_submit = runtime.pool.submit
            runtime.pool.submit = watch_submit

    orig_generate = runtime.generate

    def generate(*a, **k):
        on_first_split()
        return orig_generate(*a, **k)

    runtime.generate = generate
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(hist) == steps
    done = [x for x in lent if "cpu1" in x]
    assert len(done) >= 3, lent  # lent in most split steps (the tiny model's generation is short)
    assert all(x["cores"] == [0, 1] and x["threads"] == 2 for x in done)
    busy = sum(x["cpu1"] - x["cpu0"] for x in done)
    wall = sum(x["t1"] - x["t0"] for x in done)
    assert busy <= 0.1 * wall + 0.02, (busy, wall)  # the idle worker did not compute on the lent core
    assert submitted_while_lent and not any(submitted_while_lent)  # every request went out after giving back
    totals = state.ctx.metrics.totals
    assert totals["rollout/lends"] >= len(done) and totals["rollout/lent_s"] > 0
    assert any("mrl/rollout/lends" in h for h in hist)


@pytest.mark.parametrize(("transport", "lends"), [("shm", True), ("directory", True), ("broadcast", False)])
def test_lending_follows_the_weight_transports_declared_capabilities(tmp_path, transport, lends):
    """Placement auto lends the workers' idle cores unless the weight path's publish is a collective (its
    registration's capabilities: broadcast, per_param, vllm; the upstream weight sync's per-parameter group)."""
    from mrl_plugins.config import load_config
    from mrl_plugins.hookspecs import StageContext
    from mrl_plugins.manager import get_plugin_manager
    from mrl_plugins.metrics import StageMetrics
    from mrl_plugins.rollout.build import placement_kwargs

    ws = {"transport": transport, **({"directory": str(tmp_path)} if transport == "directory" else {})}
    for plugins in ({}, {"plugins": {"weight_sync": "upstream"}}):
        pm = get_plugin_manager(load_config({"weight_sync": ws, **plugins}))
        ctx = StageContext(config=pm.config, plugins=pm, metrics=StageMetrics())
        kwargs = placement_kwargs(ctx, [{"cores": [1], "threads": 1}], [0], "cpu", True)
        assert kwargs["lend"] is (lends and not plugins) and kwargs["budgets"]["turns"] == ([0, 1], 2)
        assert placement_kwargs(ctx, [{"cores": [1], "threads": 1}], [0], "cpu", False) == {
            "spawn_cores": [1], "warmup": True
        }  # fmt: skip


def _task_nices(pid: int) -> dict[int, int]:
    """The nice value of every thread of ``pid`` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat", encoding="ascii") as fh:
            out[int(tid)] = int(fh.read().rpartition(")")[2].split()[16])
    return out


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values: Linux")
def test_foreground_gives_every_worker_thread_its_priority_back():
    """A worker started in the background (nice 19) starts its threads there: foreground() renices all of them,
    not only the main thread."""
    import subprocess
    import sys
    import types

    from mrl_plugins.config import load_config
    from mrl_plugins.hookspecs import StageContext
    from mrl_plugins.metrics import StageMetrics
    from mrl_plugins.rollout.arrangement import Placement

    if os.geteuid() != 0:
        pytest.skip("lowering a nice value back to 0 needs CAP_SYS_NICE")
    code = (
        "import sys, threading, time\n"
        "sys.stdin.readline()\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print('started', flush=True)\n"
        "sys.stdin.readline()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        pool = types.SimpleNamespace(pids=[child.pid], ready=True)
        ctx = StageContext(config=load_config({}), metrics=StageMetrics())
        where = Placement(ctx, lambda: None, controller=None, warmup=False, budgets=None, lend=False,
                          idle=lambda: False, balancer_factory=None, interval=lambda: 1)  # fmt: skip
        where._background_start(None, lambda: pool)
        assert where.background and set(_task_nices(child.pid).values()) == {19}
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "started"
        assert len(_task_nices(child.pid)) == 4 and set(_task_nices(child.pid).values()) == {19}  # inherited
        where.foreground(pool)
        assert not where.background
        assert _task_nices(child.pid) == dict.fromkeys(_task_nices(child.pid), 0)
    finally:
        child.kill()
        child.communicate(timeout=10)  # also closes the pipes
