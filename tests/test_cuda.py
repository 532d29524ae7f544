"""The CUDA paths on a real GPU: device selection, streams, the memory cap, staging, the worker and a GRPO run.

Marked ``cuda`` and skipped without a CUDA GPU (CI has none: they are collected there and skipped).
``benchmarks/gpu/run.sh`` runs them on a GPU machine (``pytest -m cuda``) and commits what they found under
``benchmarks/gpu/<date>/``. Nothing here is faked: real CUDA streams, the real caching allocator, real spawned
worker processes on the GPU, a real TRL trainer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.marks import require_cuda, require_trl

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11], [12, 5, 6]]


def _child_cuda_count(env_update: dict[str, str]) -> int:
    """``torch.cuda.device_count()`` in a fresh interpreter with ``env_update`` on top of this environment."""
    env = dict(os.environ, **env_update)
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[-1])


@require_cuda
def test_device_selection_and_visible_devices(monkeypatch):
    import torch

    from mrl_plugins.config import load_config
    from mrl_plugins.device import CudaDevice, collective_backend, get_device, visible_devices_env
    from mrl_plugins.device.placement import worker_placements
    from mrl_plugins.errors import ConfigError, DeviceError

    count = torch.cuda.device_count()
    auto = get_device("auto")
    assert auto.type == "cuda" and auto.index == 0 and auto.torch_device == torch.device("cuda", 0)
    assert get_device("cuda:0") == CudaDevice(index=0)
    assert collective_backend("cuda") == "nccl" and visible_devices_env(auto.type) == "CUDA_VISIBLE_DEVICES"
    with pytest.raises(DeviceError, match=rf"'cuda:{count}' is not present \({count} CUDA visible\).*cuda:0"):
        get_device(f"cuda:{count}")
    stats = auto.memory_stats()
    assert stats["total_bytes"] == torch.cuda.get_device_properties(0).total_memory > 0

    env = {visible_devices_env(auto.type): "0"}
    assert _child_cuda_count(env) == 1  # the variable a worker gets selects the GPU in its process
    assert _child_cuda_count({"CUDA_VISIBLE_DEVICES": ""}) == 0

    # colocate: the worker shares the trainer's GPU, seen as cuda:0 inside its process
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    places, trainer_cores, shared = worker_placements(load_config({"mode": "colocate"}), CudaDevice(index=0))
    assert trainer_cores is None
    assert places == [{"env": {"CUDA_VISIBLE_DEVICES": "0"}, "device": "cuda:0", "threads": 1}]
    # a visible list is honoured: the worker's entry is the parent's physical id
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    places, _, _ = worker_placements(load_config({"mode": "colocate"}), CudaDevice(index=0))
    assert places[0]["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    if count == 1:  # a dedicated worker needs a second GPU: one clear error
        with pytest.raises(ConfigError, match="needs device 1 but CUDA_VISIBLE_DEVICES=0 lists only 1"):
            worker_placements(load_config({"mode": "disaggregated"}), CudaDevice(index=0))


@require_cuda
def test_high_priority_stream_and_budget():
    import torch

    from mrl_plugins.device import ComputeBudget, apply_compute_budget, get_device

    dev = get_device("cuda:0")
    least, greatest = max(torch.cuda.Stream.priority_range()), min(torch.cuda.Stream.priority_range())
    assert greatest < least  # CUDA has a real priority range on this GPU
    high = dev.new_stream("high")
    assert high.priority_honoured and high.raw.priority == greatest
    assert dev.new_stream("normal").raw.priority == least
    applied = apply_compute_budget(ComputeBudget(threads=1, stream_priority="high"), dev)
    try:
        assert applied.stream is not None and applied.stream.raw.priority == greatest and applied.priority_honoured
        with dev.stream_context(applied.stream):
            assert torch.cuda.current_stream() == applied.stream.raw
            x = torch.randn(512, 512, device="cuda")
            y = x @ x
        applied.stream.synchronize()
        assert torch.cuda.current_stream() == torch.cuda.default_stream()
        assert torch.allclose(y, (x @ x), atol=1e-3, rtol=1e-3)
    finally:
        applied.restore()


def _logprob_errors(model, prompts, completions, logprobs, temperature=1.0, pad_id=0):
    """Mean |engine - exact| and mean |teacher-forced in the model's dtype - exact|, exact = the same weights in
    fp32, per completion token."""
    import copy

    import torch

    from mrl_plugins.rollout.engine import teacher_forced_logps

    same = teacher_forced_logps(model, prompts, completions, temperature=temperature, pad_id=pad_id)
    exact_model = copy.deepcopy(model).float()
    exact = teacher_forced_logps(exact_model, prompts, completions, temperature=temperature, pad_id=pad_id)
    del exact_model
    torch.cuda.empty_cache()
    flat = [(a, b, c) for lp, tf, ex in zip(logprobs, same, exact) for a, b, c in zip(lp, tf, ex)]
    engine_err = sum(abs(a - c) for a, _, c in flat) / len(flat)
    trainer_err = sum(abs(b - c) for _, b, c in flat) / len(flat)
    return engine_err, trainer_err, max(abs(a - c) for a, _, c in flat)


@require_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_on_cuda_logprobs_equal_teacher_forcing(dtype):
    """In-process on the GPU. fp32: the sampling loop's logprobs equal a teacher-forced forward (1e-3: two
    kernel orders of the same fp32 math). bf16: no fixed bound is right for every model, so the engine is held to
    the trainer's own precision: its logprobs must be as close to the exact (fp32, same weights) value as TRL's
    bf16 teacher-forced recomputation is, within 2x + 0.01 (KV-cache decoding rounds other partial sums)."""
    import torch

    from mrl_plugins.demo.models import build_model
    from mrl_plugins.rollout.engine import SamplingParams, TransformersEngine, teacher_forced_logps

    model, tok = build_model("qwen2-tiny")
    model = model.to(device="cuda", dtype=getattr(torch, dtype))
    params = SamplingParams(max_new_tokens=12, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    engine = TransformersEngine(model, tok, device="cuda:0", params=params, seed=3)
    out = engine.generate(PROMPTS, num_generations=4)
    assert all(len(c) == 12 for c in out.completion_ids)  # the preset never samples EOS: full length
    assert next(engine.model.parameters()).device.type == "cuda"
    if dtype == "float32":
        tf = teacher_forced_logps(model, out.prompt_ids, out.completion_ids, temperature=1.0, pad_id=tok.pad_token_id)
        for a, b in zip(out.logprobs, tf):
            assert a == pytest.approx(b, abs=1e-3)
        return
    engine_err, trainer_err, worst = _logprob_errors(
        model, out.prompt_ids, out.completion_ids, out.logprobs, pad_id=tok.pad_token_id
    )
    print(f"bf16 logprob error vs fp32: engine {engine_err:.4f} (max {worst:.4f}), trainer {trainer_err:.4f}")
    assert engine_err <= 2 * trainer_err + 0.01, (engine_err, trainer_err)


def _cuda_pool(config: dict, model, sampling, factory):
    import dataclasses

    from mrl_plugins.config import load_config
    from mrl_plugins.device import CudaDevice
    from mrl_plugins.device.placement import worker_placements
    from mrl_plugins.hookspecs import StageContext
    from mrl_plugins.manager import get_plugin_manager
    from mrl_plugins.metrics import StageMetrics
    from mrl_plugins.rollout.pool import WorkerPool

    pm = get_plugin_manager(load_config(config))
    cfg = pm.config  # as the manager resolved it (the engine's registration read into rollout)
    ctx = StageContext(config=cfg, metrics=StageMetrics())
    places, _, _ = worker_placements(cfg, CudaDevice(index=0))
    engine = dataclasses.replace(pm.backend("mrl_rollout_register_engines", "transformers"), factory=factory)
    return WorkerPool(pm, ctx, model, sampling, placements=places, engine=engine, seed=0)


@require_cuda
@require_trl
@pytest.mark.slow
@pytest.mark.parametrize("staging", ["device", "host"])
def test_worker_on_cuda_stream_memory_cap_and_versions(tmp_path, monkeypatch, staging):
    """A real spawned worker on the trainer's GPU: it generates on its high-priority stream with the trainer's bf16
    weights on the GPU, caps its allocator after the first generation (an allocation past the cap is refused),
    and switches versions between requests with device or host staging (the answers follow the weights)."""
    import torch

    from mrl_plugins.demo.models import build_model
    from mrl_plugins.rollout.engine import SamplingParams
    from tests.pool_helpers import DeviceRecordingEngine

    log_path = tmp_path / "engine.jsonl"
    monkeypatch.setenv("MRL_TEST_ENGINE_LOG", str(log_path))
    model, tok = build_model("qwen2-tiny")
    model = model.to("cuda")
    sampling = SamplingParams(max_new_tokens=8, pad_token_id=tok.pad_token_id, eos_token_ids=[tok.eos_token_id])
    config = {
        "mode": "colocate",
        "rollout": {"engine_budget": {"stream_priority": "high"}, "memory_headroom": 0.5},
        "weight_sync": {"staging": staging},
    }
    pool = _cuda_pool(config, model, sampling, DeviceRecordingEngine)
    try:
        pool.publish(0, list(model.named_parameters()))
        first = pool.collect(pool.submit(PROMPTS, 2, min_version=0))
        assert first.weight_version == 0 and all(len(c) == 8 for c in first.completion_ids)
        with torch.no_grad():  # a new version the worker must switch to before the next request
            for p in model.parameters():
                p.mul_(-1.0)
        pool.publish(1, list(model.named_parameters()))
        second = pool.collect(pool.submit(PROMPTS, 2, min_version=1))
        assert second.weight_version == 1
        stats = pool.stats()
    finally:
        pool.close()
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(records) == 2
    greatest = min(records[0]["priority_range"])
    for r in records:
        assert r["param_device"] == "cuda:0" and r["dtype"] == "torch.bfloat16"
        assert r["stream_priority"] == greatest and r["stream_id"] != r["default_stream_id"]
    fraction = stats["rollout/budget_memory_fraction/0"]
    assert 0 < fraction < 0.5  # peak x 1.5 of a few-MB model: a small share of the GPU
    if records[1]["memory_fraction"] is not None:
        assert records[1]["memory_fraction"] == pytest.approx(fraction)
        assert records[1]["over_cap_refused"] is True
    # the answers of version 1 are the negated weights' logprobs: they differ from version 0's
    assert first.logprobs != second.logprobs


@require_cuda
@require_trl
@pytest.mark.slow
def test_grpo_trainer_on_cuda_every_batch_from_the_worker(tmp_path):
    """The user's GRPOTrainer on the GPU, switched by ``enable(trainer, "colocate")``: trainer and worker share the
    GPU, training runs to the end, every batch comes from the worker, versions advance, the worker capped its
    memory (it ran on the GPU), and the trainer's own generation never ran."""
    import mrl_plugins
    from mrl_plugins.config import load_config, load_yaml
    from mrl_plugins.run import build_trainer

    steps = 6
    cfg = load_config({"train": {"model": "qwen2-tiny", "steps": steps, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    assert trainer.model.device.type == "cuda"
    plugin_cfg = load_yaml("colocate")
    plugin_cfg.setdefault("rollout", {})
    plugin_cfg["rollout"].update(local_warmup=False, placement="fixed")  # every batch from the worker process
    mrl_plugins.enable(trainer, load_config(plugin_cfg))
    pids = list(trainer._mrl_state.runtime.pool.pids)
    assert pids
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == steps
    assert sum(h.get("mrl/rollout/worker_batches", 0) for h in history) == steps
    assert max(h["mrl/weights/version"] for h in history) >= steps - 1
    assert max(h.get("mrl/rollout/staleness", 0) for h in history) <= 1
    key = "mrl/rollout/budget_memory_fraction/0"
    fractions = [h[key] for h in history if key in h]
    assert fractions and 0 < fractions[-1] < 1
    assert all(h["completions/mean_length"] == 16 for h in history)  # qwen2-tiny: full-length completions
    import psutil

    for pid in pids:  # released with train()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@require_cuda
@require_trl
@pytest.mark.slow
def test_grpo_trainer_on_cuda_with_placement_auto_the_default(tmp_path):
    """``enable(trainer, "colocate")`` with placement auto (the default) on the GPU: the run takes turns with the
    trainer's own model first (on the GPU), starts its worker in the background, decides from measured stage times
    (every step logs the arrangement, at least one decision is logged) and trains to the end whichever it keeps."""
    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer
    from tests.pool_helpers import record_sources

    steps = 16  # long enough for the controller to explore the split (4 x (probe + 1) generations)
    cfg = load_config({"train": {"model": "qwen2-tiny", "steps": steps, "output_dir": str(tmp_path)}})
    trainer = build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))
    assert trainer.model.device.type == "cuda"
    mrl_plugins.enable(trainer, "colocate")
    runtime = trainer._mrl_state.runtime
    assert runtime.where.controller is not None and runtime.where.arrangement == "turns"
    sources = record_sources(runtime)
    trainer.train()
    history = [h for h in trainer.state.log_history if "reward" in h]
    assert len(history) == steps
    assert all(h["mrl/rollout/placement"] in (0, 1) for h in history)
    assert sum(h.get("mrl/rollout/turns_batches", 0) for h in history) >= 4  # the first steps: turns, on the GPU
    assert runtime.where.controller.decisions  # measured and decided at least once
    assert len(sources) == steps, sources
