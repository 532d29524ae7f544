"""``rollout.start_method``: local workers are forked where that is safe (they inherit the trainer's imported torch
and transformers instead of importing them again), spawned elsewhere; an unsafe fork is refused up front."""

from __future__ import annotations

import pytest

from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.lifecycle import start_method
from mrl_plugins.rollout.plugin import engine_registrations
from tests.marks import require_trl
from tests.pool_helpers import make_pool

PROMPTS = [[3, 4, 5], [6, 7]]
ENGINES = {r.name: r for r in engine_registrations()}


def test_auto_forks_only_a_one_thread_cpu_worker_of_an_engine_registered_fork_safe():
    from mrl_plugins.hookspecs import RolloutEngine

    transformers, vllm = ENGINES["transformers"], ENGINES["vllm"]
    assert transformers.fork_safe and vllm.fork_safe  # both built-ins declare it
    assert start_method("auto", device="cpu", threads=1, engine=transformers)[0] == "fork"
    assert start_method("auto", device="cpu", threads=1, engine=vllm)[0] == "fork"
    method, why = start_method("auto", device="cpu", threads=2, engine=transformers)
    assert method == "spawn" and "OpenMP" in why
    method, why = start_method("auto", device="cuda:1", threads=1, engine=transformers)
    assert method == "spawn" and "CUDA" in why
    method, why = start_method("auto", device="cpu", threads=1, engine=RolloutEngine(name="sglang", factory=dict))
    assert method == "spawn" and "'sglang'" in why and "fork_safe" in why
    method, why = start_method("auto", device="cpu", threads=2, engine=vllm)
    assert method == "spawn" and "OpenMP" in why


def test_no_worker_is_forked_from_a_process_where_a_vllm_engine_ran(monkeypatch):
    """A vLLM worker forked from a trainer in which TRL's use_vllm=True engine had run hung at its first request."""
    import sys
    import types

    monkeypatch.setitem(sys.modules, "vllm.v1.worker.cpu_model_runner", types.ModuleType("runner"))  # as after a build
    method, why = start_method("auto", device="cpu", threads=1, engine=ENGINES["vllm"])
    assert method == "spawn" and "a vLLM engine ran in the trainer process" in why
    # no engine's worker is forked from there (only the vLLM one was seen to hang; nothing is known of the others)
    assert start_method("auto", device="cpu", threads=1, engine=ENGINES["transformers"])[0] == "spawn"
    assert start_method("spawn", device="cpu", threads=1, engine=ENGINES["transformers"]) == ("spawn", "asked")


def test_an_unknown_start_method_is_refused_by_the_config():
    from mrl_plugins.config import load_config

    with pytest.raises(ConfigError, match=r"rollout.start_method: 'thread' invalid; valid: .*fork"):
        load_config({"rollout": {"start_method": "thread"}})


@require_trl
def test_an_unsafe_fork_is_refused_before_any_process_starts():
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. multiprocessing's resource tracker
    with pytest.raises(ConfigError, match="start_method 'fork' is unsafe here .*OpenMP"):
        make_pool({"rollout": {"start_method": "fork"}}, placements=[{"cores": [0, 1], "threads": 2}])
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


@require_trl
@pytest.mark.slow
@pytest.mark.parametrize(("asked", "expect"), [("auto", "fork"), ("spawn", "spawn"), ("fork", "fork")])
def test_a_worker_started_either_way_serves_the_published_version(asked, expect):
    """The trainer has used a 2-thread OpenMP team before the fork (as a training step does): the forked worker,
    on its one thread, still generates, with the weights of the version it reports."""
    import psutil
    import torch

    from mrl_plugins.rollout.engine import TransformersEngine

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        a = torch.randn(256, 256)
        for _ in range(5):
            a = (a @ a).tanh()  # the parent's OpenMP team exists now
        pool, model, tok, sampling, _pm, _ctx = make_pool({"rollout": {"start_method": asked}})
    finally:
        torch.set_num_threads(threads)
    try:
        (pid,) = pool.pids
        spawned = "--multiprocessing-fork" in psutil.Process(pid).cmdline()  # spawn's child re-executes Python
        assert ("spawn" if spawned else "fork") == expect
        gen = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
        pool.publish(7, list(model.named_parameters()))
        res = pool.collect(pool.submit(PROMPTS, 2, min_version=7), timeout=120)
        assert res.weight_version == 7
        local = TransformersEngine(model, tok, params=sampling, seed=0).generate(PROMPTS, 2)
        assert res.completion_ids == local.completion_ids  # same seed, same weights: the same samples
        assert psutil.Process(pid).cpu_affinity() == [1] and psutil.Process(pid).num_threads() >= 1
    finally:
        pool.close()


@require_trl
@pytest.mark.slow
def test_a_forked_worker_does_not_keep_the_trainers_sigterm_handler():
    """A trainer that ignores SIGTERM (frameworks install handlers) still gets its forked worker terminated."""
    import signal

    import psutil

    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        pool, *_ = make_pool({"rollout": {"start_method": "fork"}})
        (pid,) = pool.pids
        proc = psutil.Process(pid)
        proc.terminate()
        proc.wait(timeout=10)  # psutil.TimeoutExpired if the inherited handler swallowed it
        pool.close(timeout=2)
    finally:
        signal.signal(signal.SIGTERM, previous)
