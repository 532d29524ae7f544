"""The ``upstream`` plugin: TRL's own code path for every stage, so any stage can be switched back.

Rollout: TRL's transformers generation (``trainer._generate_single_turn`` with vLLM off) on the training model itself,
no inference copy, nothing to sync. Weight sync: TRL's per-parameter update, in process or, across processes, the
``per_param`` transport (one collective per parameter, as TRL's vLLM server client does). Comm: plain pickling
(``pickle`` frames, ``queue`` transport), what a naive multiprocessing pipeline does.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from mrl_plugins.errors import PluginError
from mrl_plugins.hookspecs import (
    Capabilities,
    PublishReport,
    RolloutResult,
    RolloutSetup,
    StageContext,
    StagePlugin,
    SwitchReport,
    hookimpl,
)

#: fixed backend choices of the upstream stages (cross-process)
UPSTREAM_WEIGHT_TRANSPORT = "per_param"
UPSTREAM_COMM_TRANSPORT = "queue"

#: the per_param group: one collective per parameter, a new process cannot join it
_PER_PARAM = Capabilities(collective=True)
_QUEUE = Capabilities(rejoinable=True)


class TrainerGeneration:
    """``rollout: upstream``: TRL generates with the training model (``replaces_host = False``: the adapter leaves
    TRL's generation in place, so a run equals vanilla TRL, and never calls :meth:`generate`)."""

    replaces_host = False

    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        raise PluginError("rollout 'upstream' leaves TRL's own generation in place: it has no generate of its own")

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> None:
        return None  # it generates with the training model: nothing to sync

    def close(self) -> None:
        pass


class InPlaceSender:
    """Upstream weight sync into an inference copy in the trainer process: one ``copy_`` per parameter into the
    live weights (what TRL's colocated vLLM ``load_weights`` does); no staging."""

    capabilities = Capabilities(in_process=True)

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id
        self.target: Any = None
        self.version: int | None = None
        self._last: tuple[int, float] = (0, 0.0)

    def receiver_handle(self) -> InPlaceSender:
        """In-process only: the sender itself (the receiver binds the model to it)."""
        return self

    def publish(self, version: int, named_tensors: Iterable[tuple[str, Any]]) -> PublishReport:
        import torch

        if self.target is None:
            raise PluginError("weight_sync 'upstream': no inference copy to update (no receiver was opened)")
        start = time.perf_counter()
        params = dict(self.target.named_parameters())
        nbytes = 0
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in params:
                    raise PluginError(f"weight_sync 'upstream': parameter {name!r} is not in the inference copy")
                params[name].copy_(tensor)
                nbytes += tensor.numel() * tensor.element_size()
        self.version = int(version)
        self._last = (nbytes, time.perf_counter() - start)
        return PublishReport(self.model_id, int(version), nbytes, self._last[1], shards=len(params))

    def close(self) -> None:
        self.target = None


class InPlaceReceiver:
    """The receiving side of :class:`InPlaceSender`: the weights are already live when published; :meth:`poll`
    reports a version published since the last switch, :meth:`switch` records it."""

    capabilities = InPlaceSender.capabilities

    def __init__(self, model: Any, sender: InPlaceSender, model_id: str) -> None:
        self.model, self.sender, self.model_id = model, sender, model_id
        sender.target = model
        self.version = 0  # the copy starts as the trainer's initial weights

    def poll(self, timeout: float) -> int | None:
        latest = self.sender.version
        return latest if latest is not None and latest > self.version else None

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        latest = self.sender.version
        if latest is None or latest <= self.version:
            return None
        nbytes, seconds = self.sender._last
        report = SwitchReport(self.model_id, self.version, latest, nbytes, seconds)
        self.version = latest
        return report

    @contextmanager
    def active(self) -> Iterator[Any]:
        yield self.model

    def stats(self) -> dict[str, float]:
        return {"version": float(self.version)}

    def close(self) -> None:
        pass


class UpstreamRollout:
    """``plugins.rollout: upstream``: TRL's own generation (a
    :class:`~mrl_plugins.hookspecs.channels.RolloutStage`)."""

    def open_runtime(self, ctx: StageContext, setup: RolloutSetup) -> TrainerGeneration:
        trainer = setup.host
        if trainer is None or not hasattr(trainer, "_generate_single_turn"):
            raise PluginError("rollout 'upstream' runs TRL's own generation and needs a TRL trainer as host")
        return TrainerGeneration()


class UpstreamWeightSync:
    """``plugins.weight_sync: upstream``: TRL's per-parameter update (a
    :class:`~mrl_plugins.hookspecs.channels.WeightSyncStage`)."""

    def capabilities(self, ctx: StageContext) -> Capabilities:
        return _PER_PARAM

    def open_sender(self, ctx: StageContext, model_id: str, run_id: str, receivers: int, same_process: bool) -> Any:
        if same_process:
            return InPlaceSender(model_id)
        from mrl_plugins.weight_sync.broadcast import PerParamSender

        sender = PerParamSender(ctx.config.weight_sync, model_id=model_id, run_id=run_id, world_size=receivers + 1)
        sender.capabilities = _PER_PARAM
        return sender

    def open_receiver(self, ctx: StageContext, model: Any, handle: Any, model_id: str, rank: int) -> Any:
        if isinstance(handle, InPlaceSender):
            return InPlaceReceiver(model, handle, model_id)
        from mrl_plugins.weight_sync.plugin import attach_handle
        from mrl_plugins.weight_sync.receiver import DirectLoader

        # into the live weights, no staging
        loader = DirectLoader(model, attach_handle(handle, rank, _PER_PARAM.collective), model_id)
        loader.capabilities = _PER_PARAM
        return loader


class UpstreamComm:
    """``plugins.comm: upstream``: pickled Python objects on a queue (a
    :class:`~mrl_plugins.hookspecs.channels.CommStage`)."""

    def capabilities(self, ctx: StageContext) -> Capabilities:
        return _QUEUE

    def open_consumer(self, ctx: StageContext, run_id: str, producers: int) -> Any:
        from mrl_plugins.comm.queue_transport import queue_factory

        consumer = queue_factory(ctx.config.comm, n_producers=producers, run_id=run_id)  # pickled Python objects
        consumer.capabilities = _QUEUE
        return consumer

    def open_producer(self, ctx: StageContext, handle: Any, index: int) -> Any:
        producer = handle.attach()
        producer.capabilities = _QUEUE
        return producer


class UpstreamPlugin:
    """TRL's own behaviour for rollout, weight sync and communication: ``upstream`` for every stage."""

    @hookimpl
    def mrl_rollout_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("upstream", UpstreamRollout, "TRL's own generation with the training model")]

    @hookimpl
    def mrl_weight_sync_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("upstream", UpstreamWeightSync, "TRL's per-parameter update into live weights")]

    @hookimpl
    def mrl_comm_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("upstream", UpstreamComm, "pickled objects on a multiprocessing queue")]
