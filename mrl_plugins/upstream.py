"""The ``upstream`` plugin: TRL's own code path for every stage, so any stage can be switched back.

* rollout -- TRL's transformers generation (``trainer._generate_single_turn`` with vLLM off), on
  the training model itself: no separate inference copy, nothing to sync. With every stage on
  ``upstream`` the adapter installs nothing, so a run equals vanilla TRL step for step.
* weight sync -- TRL's per-parameter update: one ``copy_`` per parameter into an in-process
  inference copy (what TRL's colocated vLLM ``load_weights`` does), or, across processes, the
  ``per_param`` transport (one collective per parameter, as TRL's vLLM server client does).
  No staging buffer: the update lands in the live weights.
* comm -- plain pickling (``pickle`` frames, ``queue`` transport): what a naive multiprocessing
  pipeline does.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Iterable, Mapping
from typing import Any

from mrl_plugins.errors import PluginError
from mrl_plugins.hookspecs import PublishReport, RolloutResult, StageContext, SwitchReport, hookimpl

#: fixed backend choices of the upstream stages (cross-process)
UPSTREAM_WEIGHT_TRANSPORT = "per_param"
UPSTREAM_COMM_TRANSPORT = "queue"
UPSTREAM_COMM_CODEC = "raw"


class UpstreamPlugin:
    """TRL's own behaviour for rollout, weight sync and communication."""

    # ---------------------------------------------------------------- rollout
    @hookimpl
    def mrl_rollout_generate(
        self, ctx: StageContext, prompts: list[list[int]], num_generations: int, model_id: str
    ) -> RolloutResult | None:
        trainer = ctx.host
        if trainer is None or not hasattr(trainer, "_generate_single_turn"):
            raise PluginError("rollout 'upstream' runs TRL's own generation and needs a TRL trainer as ctx.host")
        flat = [list(p) for p in prompts for _ in range(num_generations)]
        saved = trainer.use_vllm
        trainer.use_vllm = False
        try:
            try:
                out = trainer._generate_single_turn(flat, None, {}, num_generations)
            except TypeError:  # RLOOTrainer's signature has no num_generations
                out = trainer._generate_single_turn(flat, None, {})
        finally:
            trainer.use_vllm = saved
        completion_ids = out[0] if isinstance(out, tuple) else out
        return RolloutResult(
            prompt_ids=flat,
            completion_ids=[list(c) for c in completion_ids],
            logprobs=None,  # type: ignore[arg-type]  # TRL's transformers path computes none
            weight_version=int(trainer.state.global_step),
            model_id=model_id,
        )

    # ---------------------------------------------------------------- weight sync
    @hookimpl
    def mrl_weight_sync_publish(
        self, ctx: StageContext, model_id: str, version: int, named_tensors: Iterable[tuple[str, Any]]
    ) -> PublishReport | None:
        start = time.perf_counter()
        sender = _for_model(ctx.resources.get("weight_sync.sender"), model_id)
        if sender is not None:
            return sender.publish(version, named_tensors)
        target = ctx.resources.get("weight_sync.target_model")
        if target is None:
            raise PluginError("weight_sync 'upstream': no inference copy to update (ctx.resources has no target)")
        import torch

        params = dict(target.named_parameters())
        nbytes = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise PluginError(f"weight_sync 'upstream': parameter {name!r} is not in the inference copy")
                params[name].copy_(tensor)
                nbytes += tensor.numel() * tensor.element_size()
        ctx.resources["upstream.version"] = version
        return PublishReport(model_id, version, nbytes, time.perf_counter() - start, shards=len(params))

    @hookimpl
    def mrl_weight_sync_receive(self, ctx: StageContext, model_id: str, timeout: float) -> int | None:
        loader = _for_model(ctx.resources.get("weight_sync.receiver"), model_id)
        if loader is None:  # in-process: publish already wrote the live weights
            return None
        return loader.poll(timeout)

    @hookimpl
    def mrl_weight_sync_switch(self, ctx: StageContext, model_id: str) -> SwitchReport | None:
        loader = _for_model(ctx.resources.get("weight_sync.receiver"), model_id)
        if loader is None:
            return None
        return loader.switch(ctx.config.weight_sync.timeout_s)

    # ---------------------------------------------------------------- comm
    @hookimpl
    def mrl_comm_encode(self, ctx: StageContext, batch: Mapping[str, Any], meta: Mapping[str, Any]) -> bytes:
        return pickle.dumps((dict(meta), _to_numpy(batch)), protocol=pickle.HIGHEST_PROTOCOL)

    @hookimpl
    def mrl_comm_decode(self, ctx: StageContext, frame: bytes | memoryview) -> Any:
        return pickle.loads(frame)

    @hookimpl
    def mrl_comm_send(
        self, ctx: StageContext, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float
    ) -> int | None:
        producer = ctx.resources.get("comm.producer")
        if producer is None:
            raise PluginError("comm 'upstream': no producer in this process (ctx.resources['comm.producer'])")
        return producer.send(batch, meta, timeout=timeout)

    @hookimpl
    def mrl_comm_receive(self, ctx: StageContext, timeout: float) -> Any:
        consumer = ctx.resources.get("comm.consumer")
        if consumer is None:
            raise PluginError("comm 'upstream': no consumer in this process (ctx.resources['comm.consumer'])")
        return consumer.receive(timeout=timeout)


def _to_numpy(batch: Mapping[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in batch.items():
        out[key] = value.detach().cpu().numpy() if hasattr(value, "detach") else value
    return out


def _for_model(obj: Any, model_id: str) -> Any:
    """A per-model resource: the object itself, or its entry in a ``model_id -> object`` dict."""
    if isinstance(obj, dict):
        if model_id not in obj:
            raise PluginError(f"upstream: nothing registered for model_id={model_id!r}; have {sorted(obj)}")
        return obj[model_id]
    return obj
