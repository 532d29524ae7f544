"""What ``enable()`` does to the process over time, on real TRL trainers, real worker processes and /dev/shm.

- nothing process-wide (affinity, torch threads, signal handlers) changes before ``train()``, and all of it is
  restored after; nothing is started before ``train()`` (or a first use);
- the workers and their shared memory go away with ``train()``'s end, garbage collection of an untrained
  trainer, a second ``enable()``, Ctrl-C and SIGTERM (exit 130 / 143 with one line, no traceback, no leaked
  semaphores);
- short runs: the workers deliver batches in a 20-step run, report ``mrl/rollout/worker_ready_s``, and a run that
  ends before they are ready says so once and returns without waiting for them.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tests.marks import require_trl

pytestmark = [require_trl]

TWO_CORES = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPU cores (trainer + worker)")


def _trainer(tmp_path, steps=4, model="tiny", **train):
    import torch

    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": model, "steps": steps, "output_dir": str(tmp_path), **train}})
    return build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))


def _colocate(**rollout):
    from mrl_plugins.config import load_config, load_yaml

    data = load_yaml("colocate")
    data.setdefault("rollout", {})
    data["rollout"]["placement"] = "fixed"  # these tests follow the workers' lifetime: the split from the start
    data["rollout"].update(rollout)
    data.pop("train", None)
    return load_config(data)


def _shm(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if run_id in n]


def _gone(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def fresh_shm_process(monkeypatch):
    """This process as a fresh one for the shared-memory module: no segment owned, no handler of it installed (the
    signal handlers at their defaults; earlier tests' segments and handlers are put back afterwards)."""
    from mrl_plugins import shmem

    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    monkeypatch.setattr(shmem, "_signals", False)
    monkeypatch.setattr(shmem, "_previous", {})
    monkeypatch.setattr(shmem, "_owned", set())
    for sig in saved:
        signal.signal(sig, signal.SIG_DFL)
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _process_state():
    import torch

    return os.sched_getaffinity(0), torch.get_num_threads(), signal.getsignal(signal.SIGTERM)


@TWO_CORES
@pytest.mark.slow
def test_process_state_changes_only_while_training(tmp_path, capsys):
    """enable() pins nothing and starts nothing; during train() the trainer runs on its cores with the SIGTERM
    handler installed; afterwards everything is as before and the workers and their shared memory are gone."""
    import psutil
    from transformers import TrainerCallback

    import mrl_plugins

    trainer = _trainer(tmp_path, steps=3)
    before = _process_state()
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    capsys.readouterr()
    mrl_plugins.enable(trainer, _colocate(local_warmup=False))
    err = capsys.readouterr().err
    line = (
        "mrl-plugins: rollout=mrl (1 worker, cores [1]; trainer cores [0]; until ready: the first generation waits "
        "(at most 180 s)), weight_sync=shm, comm=shm/raw"
    )
    assert line in err, err
    assert _process_state() == before
    runtime = trainer._mrl_state.runtime
    assert runtime._pool is None  # no pool started
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children  # nothing spawned yet

    seen = {}

    class Probe(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            import torch

            pool = runtime.pool
            seen.update(
                affinity=os.sched_getaffinity(0),
                threads=torch.get_num_threads(),
                sigterm=signal.getsignal(signal.SIGTERM),
                pids=list(pool.pids),
                run_id=pool.run_id,
                shm=_shm(pool.run_id),
            )

    trainer.add_callback(Probe())
    trainer.train()
    assert seen["affinity"] == {0} and seen["threads"] == 1
    assert seen["sigterm"] is not before[2]  # ours while training
    assert seen["pids"] and seen["shm"]
    assert _process_state() == before  # restored
    assert all(_gone(p) for p in seen["pids"])
    assert _shm(seen["run_id"]) == []


def test_a_trained_trainer_is_not_kept_alive(tmp_path, fresh_shm_process):
    """After train() nothing of the plugins' holds the trainer: it and its model go when the caller drops them (the
    shared-memory cleanup handlers, installed with train()'s first segment, chained to train()'s SIGTERM handler and
    kept it, so every trained trainer lived until exit)."""
    import weakref

    import mrl_plugins

    trainer = _trainer(tmp_path, steps=2)
    mrl_plugins.enable(trainer, {"mode": "colocate", "rollout": {"workers": 0}})  # weights over shared memory
    trainer.train()
    assert trainer.vllm_generation.version == 1
    trainer_ref, model_ref = weakref.ref(trainer), weakref.ref(trainer.model)
    del trainer
    gc.collect()
    assert trainer_ref() is None and model_ref() is None


@TWO_CORES
@pytest.mark.slow
def test_untrained_trainer_releases_workers_when_collected(tmp_path, fresh_shm_process):
    """A pool started by a first use (no train()) goes with the trainer when it is garbage-collected."""
    import mrl_plugins

    trainer = _trainer(tmp_path)
    before = _process_state()
    mrl_plugins.enable(trainer, _colocate())
    pool = trainer._mrl_state.runtime.pool  # first use: starts it
    pids, run_id = list(pool.pids), pool.run_id
    assert pids and _shm(run_id)
    del pool, trainer
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    assert all(_gone(p) for p in pids)
    assert _shm(run_id) == []
    assert _process_state() == before


@TWO_CORES
@pytest.mark.slow
def test_second_enable_stops_the_first_pool(tmp_path):
    """A second enable() (another trainer, or the same one again) stops the live pool of the first; the first
    trainer's own methods come back when it is enabled again."""
    import mrl_plugins

    first = _trainer(tmp_path / "a")
    original_train = first.train
    mrl_plugins.enable(first, _colocate())
    pool = first._mrl_state.runtime.pool
    pids, run_id = list(pool.pids), pool.run_id
    second = _trainer(tmp_path / "b")
    mrl_plugins.enable(second, _colocate())
    assert all(_gone(p) for p in pids) and _shm(run_id) == []
    assert first._mrl_state.runtime._pool is None
    again = second._mrl_state.runtime.pool
    pids, run_id = list(again.pids), again.run_id
    mrl_plugins.enable(second, _colocate())  # the same trainer again (a notebook cell run twice)
    assert all(_gone(p) for p in pids) and _shm(run_id) == []
    mrl_plugins.disable(first)
    assert first.train == original_train and getattr(first, "_mrl_state", None) is None
    assert first.use_vllm is False


@TWO_CORES
@pytest.mark.slow
def test_short_run_gets_batches_from_the_worker(tmp_path):
    """A 20-step GRPO run with the local warm-up: the worker takes over once ready (frames arrive, its start-up
    time is reported) and no request is queued for it while it starts."""
    import mrl_plugins

    trainer = _trainer(tmp_path, steps=20, model="small")
    mrl_plugins.enable(trainer, _colocate(start_method="spawn"))  # a worker that takes seconds to start
    trainer.train()
    ready = _history(trainer, "mrl/rollout/worker_ready_s")
    assert ready and ready[0] > 0
    assert max(_history(trainer, "mrl/comm/frames")) > 0  # batches the worker delivered
    local = sum(_history(trainer, "mrl/rollout/local_batches"))
    assert 1 <= local < 20
    assert max(_history(trainer, "mrl/rollout/sched/policy/queue_depth")) <= 1  # nothing piled up while starting
    assert not _history(trainer, "mrl/rollout/discarded_batches")


@TWO_CORES
@pytest.mark.slow
def test_without_warm_up_every_batch_is_the_workers_and_the_wait_is_said_on_stderr(tmp_path, capfd):
    """local_warmup false (what 'auto' is for any engine but 'transformers'): enable() says the first generation
    waits; the wait for a worker that takes seconds to start is reported on stderr while it lasts; every batch of
    the run comes from the worker (mrl/rollout/worker_batches), none from the trainer's own model."""
    import mrl_plugins

    trainer = _trainer(tmp_path, steps=6)
    mrl_plugins.enable(trainer, _colocate(start_method="spawn", local_warmup=False))
    assert "until ready: the first generation waits (at most 180 s)" in capfd.readouterr().err
    trainer.train()
    err = capfd.readouterr().err
    assert re.search(r"mrl-plugins: waiting for 1 rollout worker \(transformers engine\) to start: \d+ s so far, "
                     r"at most 180 s \(1.5 x timeout_s\)", err), err[-3000:]  # fmt: skip
    assert re.search(r"mrl-plugins: 1 rollout worker \(transformers engine\) ready [\d.]+ s after the start", err)
    assert sum(_history(trainer, "mrl/rollout/worker_batches")) == 6
    assert not _history(trainer, "mrl/rollout/local_batches")
    assert sum(_history(trainer, "mrl/rollout/start_wait_s")) >= 1.0


@TWO_CORES
@pytest.mark.slow
def test_workers_not_ready_within_start_timeout_is_one_clear_error(tmp_path):
    """A worker slower to start than rollout.start_timeout_s: train() fails with the bound named, nothing hangs."""
    import mrl_plugins
    from mrl_plugins.errors import StageTimeoutError

    trainer = _trainer(tmp_path, steps=2)
    mrl_plugins.enable(trainer, _colocate(start_method="spawn", local_warmup=False, start_timeout_s=0.5))
    t0 = time.monotonic()
    with pytest.raises(StageTimeoutError, match=r"not ready \d+ s after they started \(the start bound 0.5 s"):
        trainer.train()
    assert time.monotonic() - t0 < 30


@TWO_CORES
@pytest.mark.slow
def test_run_shorter_than_worker_start_warns_and_does_not_wait(tmp_path, caplog):
    """A 1-step run ends before the worker is ready: one warning says so, and train() returns right after TRL's
    own end instead of waiting for the worker's start-up."""
    from transformers import TrainerCallback

    import mrl_plugins

    trainer = _trainer(tmp_path, steps=1)
    mrl_plugins.enable(trainer, _colocate(start_method="spawn"))  # spawned: still starting after one step
    runtime = trainer._mrl_state.runtime
    seen = {}

    class End(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            seen["end"] = time.monotonic()
            seen["ready"] = runtime.pool.ready
            seen["pids"] = list(runtime.pool.pids)
            seen["run_id"] = runtime.pool.run_id

    trainer.add_callback(End())
    with caplog.at_level(logging.WARNING, logger="mrl_plugins"):
        trainer.train()
    returned = time.monotonic() - seen["end"]
    assert seen["ready"] is False  # the premise: the worker was still starting
    warnings = [r.getMessage() for r in caplog.records if "delivered no batch" in r.getMessage()]
    assert len(warnings) == 1 and "not ready" in warnings[0]
    assert returned < 3.0, returned  # it used to wait up to 10 s for a starting worker to take its stop
    assert all(_gone(p) for p in seen["pids"]) and _shm(seen["run_id"]) == []


@pytest.mark.slow
def test_warmup_engine_is_transformers_whatever_the_rollout_engine(tmp_path, install_dist):
    import mrl_plugins
    from mrl_plugins.rollout.engine import TransformersEngine

    install_dist("slowplug", {"slowplug": "tests.pool_helpers:slow_engine_plugin"}, {})
    trainer = _trainer(tmp_path)
    mrl_plugins.enable(trainer, _colocate(engine="slow"))
    assert trainer._mrl_state.runtime._local_factory is None  # 'auto': no warm-up for an engine but 'transformers'
    mrl_plugins.enable(trainer, _colocate(engine="slow", local_warmup=True))  # asked for: the light engine
    runtime = trainer._mrl_state.runtime
    assert isinstance(runtime._local_factory(), TransformersEngine)
    assert runtime._pool is None  # no pool started


SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    import torch
    from transformers import TrainerCallback
    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": "tiny", "steps": 500, "output_dir": sys.argv[1]}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=sys.argv[1])
    # placement fixed: the worker serves from its start, so the signal finds it running. (Under placement auto a
    # signal can find it still starting in the background at nice 19; it is then terminated at once and, once in
    # two full-suite runs here, multiprocessing's resource tracker warned of a leaked semaphore at exit: a known,
    # open issue, see the 2026-12-05 session note)
    mrl_plugins.enable(trainer, {"rollout": {"local_warmup": False, "placement": "fixed"}})
    runtime = trainer._mrl_state.runtime

    class Report(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pool = runtime.pool
            print("STEP", state.global_step, pool.run_id, *pool.pids, flush=True)

    trainer.add_callback(Report())
    trainer.train()
    print("FINISHED", flush=True)
    """
)


def _run_and_signal(tmp_path, send):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MRL_PLUGINS"}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path / "out")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 240
    step = None
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    break
                continue
            if line.startswith("STEP") and int(line.split()[1]) >= 2:
                step = line.split()
                break
        assert step is not None, proc.stderr.read()[-3000:] if proc.poll() is not None else "no step in 240 s"
        send(proc)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    run_id, pids = step[2], [int(p) for p in step[3:]]
    return proc.returncode, err, run_id, pids


@TWO_CORES
@pytest.mark.slow
def test_ctrl_c_exits_130_with_one_line(tmp_path):
    """SIGINT to the whole process group (a terminal's Ctrl-C): the workers ignore it, the trainer stops them and
    exits 130 with one line; no traceback, no leaked semaphores, nothing left in /dev/shm."""
    rc, err, run_id, pids = _run_and_signal(tmp_path, lambda p: os.killpg(p.pid, signal.SIGINT))
    assert rc == 130, err[-3000:]
    assert len([line for line in err.splitlines() if "mrl-plugins: interrupted (Ctrl-C)" in line]) == 1, err
    assert "Traceback" not in err and "leaked" not in err, err[-3000:]
    assert pids and all(_gone(p) for p in pids)
    assert _shm(run_id) == []


@TWO_CORES
@pytest.mark.slow
def test_sigterm_stops_workers_and_exits_143(tmp_path):
    rc, err, run_id, pids = _run_and_signal(tmp_path, lambda p: os.kill(p.pid, signal.SIGTERM))
    assert rc == 143, err[-3000:]
    assert len([line for line in err.splitlines() if "mrl-plugins: stopped by SIGTERM" in line]) == 1, err
    assert "Traceback" not in err and "leaked" not in err, err[-3000:]
    assert pids and all(_gone(p) for p in pids)
    assert _shm(run_id) == []
