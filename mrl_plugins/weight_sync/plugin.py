"""The built-in weight-sync stage plugin (registered as ``mrl.weight_sync``, selected as ``plugins.weight_sync: mrl``).

Transports ``shm``, ``directory``, ``broadcast``, ``per_param`` and ``vllm``, each registered with what its ends can do
(:class:`~mrl_plugins.hookspecs.channels.Capabilities`). It opens the weight stream's ends from the registration
``weight_sync.transport`` names (third-party transports included):

* ``open_sender`` (trainer): the transport's sender; a
  ``collective`` transport gets a group of the trainer plus one rank per receiver;
* ``open_receiver`` (worker or in-process copy): a
  :class:`~mrl_plugins.weight_sync.receiver.DoubleBufferedReceiver` over the transport's receiving end, with names
  mapped through :func:`~mrl_plugins.hookspecs.spec.mrl_weight_sync_map_name`.

The caller owns and closes the ends; the weight metrics (``mrl/weights/...``) are counted by the caller from the
reports (:func:`mrl_plugins.metrics.record_publish`, :func:`~mrl_plugins.metrics.record_switch`), whichever plugin
serves the stage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from mrl_plugins.errors import ConfigError, choices
from mrl_plugins.hookspecs import Capabilities, StageContext, StagePlugin, WeightTransport, hookimpl

from .broadcast import BroadcastSender, PerParamSender
from .directory import DirectorySender
from .shm import ShmSender
from .vllm_transfer import VLLMTransferHandle, VLLMTransferSender

TRANSPORTS = "mrl_weight_sync_register_transports"


def _transport(ctx: StageContext) -> Any:
    return ctx.plugins.backend(TRANSPORTS, ctx.config.weight_sync.transport)


def _group_host(ctx: StageContext) -> str:
    """Where a collective sender's store listens: where workers on other hosts reach the trainer (the
    ``rollout.rendezvous`` host) when there are any, else loopback."""
    rollout = ctx.config.rollout
    if rollout.remote_workers:
        return str(rollout.rendezvous).rpartition(":")[0]
    return "127.0.0.1"


def attach_handle(handle: Any, rank: int, collective: bool) -> Any:
    """The receiving end of a transport handle: ``.attach(rank=rank + 1)`` for a ``collective`` transport (its
    registration's capability: receiver ``rank`` is group rank ``rank + 1``), ``.attach()`` otherwise."""
    return handle.attach(rank=rank + 1) if collective else handle.attach()


class WeightSyncPlugin:
    """The weight-sync stage ``mrl`` (a :class:`~mrl_plugins.hookspecs.channels.WeightSyncStage`): transports ``shm``,
    ``directory``, ``broadcast``, ``per_param``, ``vllm`` and the two ends built from them."""

    @hookimpl
    def mrl_weight_sync_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("mrl", lambda: self, "double-buffered, versioned weights over weight_sync.transport")]

    @hookimpl
    def mrl_weight_sync_register_transports(self) -> Iterator[WeightTransport]:
        network = Capabilities(collective=True, cross_host=True)
        yield WeightTransport("shm", ShmSender, "shared memory on one host, double-buffered",
                              Capabilities(rejoinable=True))  # fmt: skip
        yield WeightTransport("directory", DirectorySender, "safetensors files + atomic manifest (local or shared "
                              "filesystem)", Capabilities(rejoinable=True, cross_host=True))  # fmt: skip
        yield WeightTransport("broadcast", BroadcastSender, "bucketed torch.distributed broadcast on a dedicated "
                              "group", network)  # fmt: skip
        yield WeightTransport("per_param", PerParamSender, "one torch.distributed broadcast per parameter (baseline)",
                              network)  # fmt: skip
        yield WeightTransport("vllm", VLLMTransferSender, "into rollout.engine 'vllm' through vLLM's weight-transfer "
                              "protocol (nccl / hccl / mrl_gloo)", Capabilities(collective=True))  # fmt: skip

    def capabilities(self, ctx: StageContext) -> Capabilities:
        return _transport(ctx).capabilities

    def open_sender(self, ctx: StageContext, model_id: str, run_id: str, receivers: int, same_process: bool) -> Any:
        reg = _transport(ctx)
        if reg.name == "vllm" and ctx.config.rollout.engine != "vllm":
            raise ConfigError(
                f"weight_sync.transport 'vllm' loads the weights into vLLM engines; it needs rollout.engine: vllm "
                f"(got {ctx.config.rollout.engine!r}), or use transport {choices(['shm', 'broadcast'])}"
            )
        if same_process and reg.capabilities.collective:
            raise ConfigError(
                f"weight_sync.transport {reg.name!r} sends through a process group, which an inference copy in the "
                f"trainer process cannot join; use 'shm' (or rollout.workers >= 1)"
            )
        # a collective sender is sized for the receivers, its group's store listening where they reach it
        group = {"world_size": receivers + 1, "host": _group_host(ctx)} if reg.capabilities.collective else {}
        sender = reg.factory(ctx.config.weight_sync, model_id=model_id, run_id=run_id, **group)
        sender.capabilities = reg.capabilities
        return sender

    def open_receiver(self, ctx: StageContext, model: Any, handle: Any, model_id: str, rank: int) -> Any:
        from .receiver import DoubleBufferedReceiver

        caps = _transport(ctx).capabilities
        if isinstance(handle, VLLMTransferHandle):  # into the worker's vLLM engine: bound by the worker
            receiver = handle.attach(rank + 1, model)
        else:
            receiver = DoubleBufferedReceiver(
                model,
                attach_handle(handle, rank, caps.collective),
                model_id=model_id,
                staging=ctx.config.weight_sync.staging,
                name_map=ctx.plugins.weight_sync_name_map(model_id),
            )
        receiver.capabilities = caps
        return receiver


__all__ = ["WeightSyncPlugin", "attach_handle"]
