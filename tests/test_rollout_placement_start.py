"""``rollout.placement_start``: where a ``placement: auto`` run begins. Starting in the split, the workers start
at full speed on their own cores while the trainer's own model answers on the trainer's core; the first decision
is taken from measured split steps."""

from __future__ import annotations

import os
import time

import pytest

from tests.marks import require_trl


def test_bad_placement_start_is_refused():
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import ConfigError

    with pytest.raises(ConfigError, match="rollout.placement_start: 'middle' invalid; valid: 'split' or 'turns'"):
        load_config({"rollout": {"placement": "auto", "placement_start": "middle"}})
    assert load_config({}).rollout.placement_start == "turns"


@pytest.mark.slow
@require_trl
def test_a_run_starting_in_the_split_warms_up_on_the_trainers_core_and_measures_the_split(tmp_path):
    import psutil
    import torch
    from transformers import TrainerCallback

    from tests.pool_helpers import record_sources
    from tests.test_rollout_autoplace import placement_run

    steps = 10
    # spawned: the behaviour under test is the trainer's warm-up while a worker takes seconds to start (a forked
    # worker is ready within a second, before the first decision)
    rollout = {"workers": 1, "placement": "auto", "placement_start": "split", "local_warmup": True,
               "start_method": "spawn"}  # fmt: skip
    trainer = placement_run(tmp_path, steps, rollout)
    runtime = trainer._mrl_state.runtime
    sources = record_sources(runtime)
    seen: dict[int, dict] = {}

    class Watch(TrainerCallback):
        def on_step_end(self, args, st, control, **kw):
            step = int(st.global_step)
            pid = runtime.pool.pids[0]
            seen[step] = {
                "arr": runtime.where.arrangement,
                "source": sources[-1],
                "cores": sorted(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads(),
                "nice": psutil.Process(pid).nice(),
                "worker_cores": psutil.Process(pid).cpu_affinity(),
            }
            if step == 1:  # let the worker finish starting, so that the next steps are served by it
                deadline = time.monotonic() + 120
                while not runtime.pool.ready and time.monotonic() < deadline:
                    time.sleep(0.05)

    trainer.add_callback(Watch())
    trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == steps
    first = seen[1]
    # the split from the first step: the trainer on its own core, one thread; the worker on the other core at
    # normal priority (never sent to the background)
    assert first["arr"] == "split" and first["cores"] == [0] and first["threads"] == 1, first
    assert first["worker_cores"] == [1] and first["nice"] == 0
    assert first["source"] in ("warmup", "split")  # the trainer's own model answers while the worker starts
    assert seen[2]["source"] == "split" and seen[2]["nice"] == 0  # the ready worker serves from then on
    decisions = runtime.where.controller.decisions
    assert decisions and decisions[0].current == "split", decisions  # measured in the split first
    assert sources.count("split") >= 4
