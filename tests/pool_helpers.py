"""Helpers for the rollout worker-pool tests (imported by spawned workers, so module-level and picklable)."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any


class SlowEngine:
    """Wraps the transformers engine; sleeps ``MRL_TEST_ENGINE_DELAY_S`` before each generation (fault injection)."""

    def __init__(self, model: Any, tokenizer: Any, *, params: Any, device: str = "cpu", seed: int | None = None):
        from mrl_plugins.rollout.engine import TransformersEngine

        self.inner = TransformersEngine(model, tokenizer, params=params, device=device, seed=seed)
        self.delay = float(os.environ.get("MRL_TEST_ENGINE_DELAY_S", "0"))

    def generate(self, prompts: list[list[int]], num_generations: int = 1) -> Any:
        time.sleep(self.delay)
        return self.inner.generate(prompts, num_generations)


def make_pool(
    config: dict | None = None,
    *,
    factory: Any = None,
    placements: list[dict] | None = None,
    score_models: dict | None = None,
) -> tuple:
    """A real WorkerPool on the tiny model (plus ``score_models``): returns ``(pool, model, tokenizer, sampling,
    pm, ctx)``."""
    from mrl_plugins.config import load_config
    from mrl_plugins.demo.models import build_model
    from mrl_plugins.hookspecs import StageContext
    from mrl_plugins.manager import get_plugin_manager
    from mrl_plugins.metrics import StageMetrics
    from mrl_plugins.rollout.engine import SamplingParams
    from mrl_plugins.rollout.pool import WorkerPool

    pm = get_plugin_manager(load_config(config or {}))
    cfg = pm.config  # as the manager resolved it (the engine's registration read into rollout)
    ctx = StageContext(config=cfg, metrics=StageMetrics())
    model, tok = build_model("tiny")
    sampling = SamplingParams(max_new_tokens=6, eos_token_ids=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    engine = pm.backend("mrl_rollout_register_engines", cfg.rollout.engine)
    engine = dataclasses.replace(engine, factory=factory) if factory is not None else engine
    pool = WorkerPool(
        pm,
        ctx,
        model,
        sampling,
        placements=[{"cores": [1], "threads": 1}] if placements is None else placements,
        engine=engine,
        seed=0,
        score_models=score_models,
    )
    return pool, model, tok, sampling, pm, ctx


def record_sources(runtime: Any) -> list[str]:
    """Who generated each batch, in order, as the runtime tells its Placement (``served``'s tag: ``split``,
    ``turns`` or ``warmup``; a lookahead of the split taken while taking turns counts as ``split``)."""
    sources: list[str] = []
    served = runtime.where.served

    def record(t0: float, blocked: float, engine_s: float, tag: str | None) -> None:
        sources.append(tag or "split")
        served(t0, blocked, engine_s, tag)

    runtime.where.served = record
    return sources


def steer_placement(runtime: Any, at: dict[int, str]) -> Any:
    """A TrainerCallback forcing placement auto's arrangement at the end of the given steps (``{step: "split" |
    "turns"}``); at the step end after a forced split it waits (at most 120 s) for the workers to be ready."""
    from transformers import TrainerCallback

    class Steer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            step = int(state.global_step)
            if at.get(step - 1) == "split":
                deadline = time.monotonic() + 120
                while not runtime.pool.ready and time.monotonic() < deadline:
                    time.sleep(0.05)
            if step in at:
                runtime.where.controller.force(at[step])

    return Steer()


class SlowEnginePlugin:
    """A third-party-style plugin registering the ``slow`` engine (fault injection for staleness tests)."""

    from mrl_plugins.hookspecs import hookimpl

    @hookimpl
    def mrl_rollout_register_engines(self):
        from mrl_plugins.hookspecs import RolloutEngine

        return [RolloutEngine(name="slow", factory=SlowEngine, description="transformers + injected delay (tests)")]


slow_engine_plugin = SlowEnginePlugin()


class DeviceRecordingEngine:
    """Wraps the transformers engine; appends, per generation, where it ran to the JSON-lines file named by
    ``MRL_TEST_ENGINE_LOG`` (the CUDA tests): the current stream and its priority, the default stream, the
    parameters' device and dtype, the allocator's per-process memory fraction, and from the second generation on
    whether an allocation past that fraction is refused (the worker caps it after its first generation)."""

    def __init__(self, model: Any, tokenizer: Any, *, params: Any, device: str = "cpu", seed: int | None = None):
        from mrl_plugins.rollout.engine import TransformersEngine

        self.inner = TransformersEngine(model, tokenizer, params=params, device=device, seed=seed)
        self.path = os.environ["MRL_TEST_ENGINE_LOG"]
        self.calls = 0

    def generate(self, prompts: list[list[int]], num_generations: int = 1) -> Any:
        import json

        import torch

        out = self.inner.generate(prompts, num_generations)
        self.calls += 1
        param = next(self.inner.model.parameters())
        record: dict[str, Any] = {"call": self.calls, "param_device": str(param.device), "dtype": str(param.dtype)}
        if param.device.type == "cuda":
            stream = torch.cuda.current_stream()
            fraction_of = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            fraction = float(fraction_of(param.device)) if fraction_of is not None else None
            record |= {
                "stream_id": int(stream.stream_id),
                "stream_priority": int(stream.priority),
                "default_stream_id": int(torch.cuda.default_stream().stream_id),
                "priority_range": list(torch.cuda.Stream.priority_range()),
                "memory_fraction": fraction,
            }
            if self.calls >= 2 and fraction is not None and fraction < 0.5:
                total = torch.cuda.get_device_properties(param.device).total_memory
                try:  # more than the cap: the allocator must refuse it
                    block = torch.empty(int(total * fraction) + (256 << 20), dtype=torch.uint8, device=param.device)
                    del block
                    record["over_cap_refused"] = False
                except torch.OutOfMemoryError:
                    record["over_cap_refused"] = True
                torch.cuda.empty_cache()
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        return out
