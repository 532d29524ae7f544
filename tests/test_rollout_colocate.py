"""Colocated engine server: binding applied inside the process, timeouts, dead server, OOM mapping, reservation.

All multi-process tests use real spawned processes on this machine's CPU cores. The out-of-memory tests
*simulate* the error: the model's forward is wrapped (in the server process, via a picklable factory below) to
raise ``torch.OutOfMemoryError`` for batches above a size -- there is no device here whose allocator we could fill.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from benchmarks.engine_server import (
    EngineOutOfMemoryError,
    EngineServer,
    EngineServerError,
    MemoryReservation,
    guard_oom,
    is_out_of_memory,
    profile_engine_memory,
    reserve_memory,
)
from mrl_plugins.demo.models import build_model
from mrl_plugins.device import CpuDevice
from mrl_plugins.errors import ConfigError, StageTimeoutError
from mrl_plugins.rollout.engine import SamplingParams, TransformersEngine

PARAMS = SamplingParams(max_new_tokens=6)
N_CORES = len(os.sched_getaffinity(0))


class _OomAboveBatch(torch.nn.Module):
    """Wraps a causal LM; raises torch.OutOfMemoryError when the batch is larger than ``limit`` (simulated OOM)."""

    def __init__(self, inner: torch.nn.Module, limit: int) -> None:
        super().__init__()
        self.inner = inner
        self.limit = limit

    def forward(self, input_ids=None, **kwargs):
        if input_ids.shape[0] > self.limit:
            raise torch.OutOfMemoryError(f"simulated: out of memory allocating batch {input_ids.shape[0]}")
        return self.inner(input_ids=input_ids, **kwargs)

    def get_output_embeddings(self):
        return self.inner.get_output_embeddings()


def oom_model_factory():
    """Picklable factory for the server process: tiny model that 'runs out of memory' above batch 2."""
    model, tok = build_model("tiny", seed=0)
    return _OomAboveBatch(model, limit=2), tok


def crashing_factory():
    raise ValueError("checkpoint is corrupt (test)")


def test_guard_oom_maps_in_process():
    """In-process: an engine whose model raises torch.OutOfMemoryError (simulated) -> EngineOutOfMemoryError."""
    model, tok = oom_model_factory()
    eng = TransformersEngine(model, tok, params=PARAMS, seed=0)
    res = MemoryReservation("cpu", 100, 0.2, 120, 1000, 0.12, False)
    with pytest.raises(EngineOutOfMemoryError, match=r"reserved fraction 0\.1200") as info:
        with guard_oom(res):
            eng.generate([[3, 4, 5]], num_generations=4)
    assert isinstance(info.value.__cause__, torch.OutOfMemoryError)
    with guard_oom(res):  # the same engine still serves a batch that fits
        assert len(eng.generate([[3, 4, 5]], num_generations=2).completion_ids) == 2
    with pytest.raises(ValueError, match="other"):
        with guard_oom(res):
            raise ValueError("other")
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_reserve_memory_cpu_measures_and_records():
    model, tok = build_model("tiny", seed=0)
    eng = TransformersEngine(model, tok, params=PARAMS, seed=0)
    dev = CpuDevice()
    res = profile_engine_memory(eng, [[3, 4, 5]] * 2, 2, dev, headroom=0.2)
    assert res.peak_bytes > 0 and res.total_bytes > res.peak_bytes
    assert res.reserved_bytes == int(res.peak_bytes * 1.2)
    assert res.fraction == pytest.approx(res.peak_bytes * 1.2 / res.total_bytes)
    assert dev.memory_fraction == pytest.approx(res.fraction)
    assert res.enforced is False and "not enforced" in res.describe()
    with pytest.raises(ConfigError, match="does not fit"):
        reserve_memory(lambda: None, dev, headroom=4.0 * 10**9)  # absurd headroom -> reservation > device


@pytest.mark.slow
def test_server_binding_applied_and_generates():
    cores = [N_CORES - 1]
    with EngineServer("tiny", params=PARAMS, cores=cores, threads=1, seed=0, profile_prompts=[[3, 4]]) as srv:
        assert srv.info["affinity"] == cores and srv.info["threads"] == 1
        live = srv.binding()
        assert live["affinity"] == cores and live["threads"] == 1 and live["pid"] == srv.pid != os.getpid()
        # the trainer side (this process) keeps its own affinity
        assert len(os.sched_getaffinity(0)) == N_CORES
        out = srv.request([[3, 4, 5], [6, 7]], num_generations=2, timeout=30)
        assert out.prompt_ids == [[3, 4, 5]] * 2 + [[6, 7]] * 2
        assert all(len(c) == len(lp) >= 1 for c, lp in zip(out.completion_ids, out.logprobs))
        # same seed in-process gives the same completions: the server runs the same engine
        model, tok = build_model("tiny", seed=0)
        local = TransformersEngine(model, tok, params=PARAMS, seed=0)
        local.generate([[3, 4]], 1)  # the server's profiling round consumed one round of its generator
        ref = local.generate([[3, 4, 5], [6, 7]], 2)
        assert ref.completion_ids == out.completion_ids
        res = srv.reservation
        assert res is not None and res.peak_bytes > 0 and not res.enforced
        # weights pushed to the server change its outputs to those of the pushed model
        other, _ = build_model("tiny", seed=5)
        assert srv.update_weights(other.state_dict().items()) > 0
        out2 = srv.request([[3, 4, 5]], 1)
        with torch.no_grad():
            ids = torch.tensor([out2.prompt_ids[0] + out2.completion_ids[0]])
            logits = other(ids).logits[0, 2:-1]
        ref_lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(out2.completion_ids[0])[:, None]).squeeze(1)
        assert (ref_lp - torch.tensor(out2.logprobs[0])).abs().max() < 1e-4
    assert not srv.is_alive()


@pytest.mark.slow
def test_server_unbound_keeps_defaults():
    import subprocess
    import sys

    # torch's default thread count in a fresh process, measured alongside the server's start
    fresh = subprocess.Popen(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"], stdout=subprocess.PIPE, text=True
    )
    try:
        with EngineServer("tiny", params=PARAMS) as srv:
            live = srv.binding()
        default_threads = int(fresh.communicate(timeout=60)[0])
    finally:
        fresh.kill()
        fresh.wait(timeout=10)
        fresh.stdout.close()
    assert live["affinity"] == sorted(os.sched_getaffinity(0))
    assert live["threads"] == default_threads


@pytest.mark.slow
def test_slow_server_times_out_recovers_then_dead_server_raises_within_timeout():
    srv = EngineServer("tiny", params=PARAMS, threads=1)
    try:
        start = time.monotonic()
        with pytest.raises(StageTimeoutError, match="no reply to 'sleep' within 0.3 s"):
            srv._call("sleep", 1.0, timeout=0.3)
        assert time.monotonic() - start < 1.5
        out = srv.request([[3]], 1, timeout=30)  # the late 'sleep' reply is discarded, not mistaken for this one
        assert out.prompt_ids == [[3]]
        os.kill(srv.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(StageTimeoutError, match=r"died during 'generate' \(exit code -9\)"):
            srv.request([[3, 4]], 1, timeout=20)
        assert time.monotonic() - start < 3.0  # detected by polling, not by waiting the full timeout
    finally:
        srv.close(timeout=5)
    assert not srv.is_alive()


@pytest.mark.slow
def test_server_oom_is_clear_and_training_unharmed():
    """Simulated OOM inside the server process (model wrapper raises torch.OutOfMemoryError above batch 2)."""
    with EngineServer(
        params=PARAMS, model_factory=oom_model_factory, threads=1, profile_prompts=[[3, 4]], headroom=0.2
    ) as srv:
        frac = srv.reservation.fraction
        with pytest.raises(EngineOutOfMemoryError, match=f"reserved fraction {frac:.4f}"):
            srv.request([[3, 4, 5]], num_generations=4, timeout=30)
        # training side unharmed: a real optimizer step still works here, and the server still serves
        model, _ = build_model("tiny", seed=0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.tensor([[3, 4, 5, 6]])
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss)
        assert srv.is_alive()
        assert len(srv.request([[3, 4, 5]], num_generations=2, timeout=30).completion_ids) == 2


@pytest.mark.slow
def test_server_start_failure_reported():
    with pytest.raises(EngineServerError, match="checkpoint is corrupt"):
        EngineServer(params=PARAMS, model_factory=crashing_factory, start_timeout=60)


@pytest.mark.slow
def test_bad_core_reported_from_server():
    with pytest.raises(EngineServerError, match="not on this machine"):
        EngineServer("tiny", params=PARAMS, cores=[N_CORES + 7], threads=1, start_timeout=60)


@pytest.mark.slow
def test_server_with_compute_budget():
    """A full ComputeBudget (CPU part: cores + threads; a 'high' stream is a no-op stream on CPU)."""
    from mrl_plugins.device import ComputeBudget

    budget = ComputeBudget(cores=[0], threads=1, stream_priority="high")
    with EngineServer("tiny", params=PARAMS, budget=budget, seed=0) as srv:
        assert srv.binding()["affinity"] == [0] and srv.info["threads"] == 1
        assert srv.info["budget"]["cores"] == [0] and srv.info["budget"]["stream_priority"] == "high"
        assert len(srv.request([[3, 4]], 2, timeout=30).completion_ids) == 2


def test_bad_arguments_rejected_before_start():
    from mrl_plugins.device import ComputeBudget

    with pytest.raises(ConfigError, match="either budget or cores/threads"):
        EngineServer("tiny", params=PARAMS, threads=1, budget=ComputeBudget(threads=1))
    with pytest.raises(ConfigError, match="threads"):
        EngineServer("tiny", params=PARAMS, threads=0)
    with pytest.raises(ConfigError, match="cores"):
        EngineServer("tiny", params=PARAMS, cores=[])
    with pytest.raises(ConfigError, match="headroom"):
        EngineServer("tiny", params=PARAMS, headroom=-1)
