"""Hook specifications: the contract between the host adapter and the stage plugins.

Naming: ``mrl_<stage>_<verb>``. Hooks are called with keyword arguments only (pluggy refuses
positional calls); implementations declare the parameters they need by name, as plain parameters
(not after ``*``: pluggy passes no keyword-only parameters). Three kinds of hook:

* lifecycle -- :func:`mrl_configure` (historic: plugins registered late still get it) and
  :func:`mrl_shutdown`;
* registration -- ``mrl_<stage>_register_<things>`` return small named registration objects
  (:mod:`mrl_plugins.hookspecs.types`), collected by the manager and picked by name from config;
* stage operations -- ``firstresult`` hooks that the manager routes to the plugin selected for
  that stage (``plugins: {rollout: mrl}``): only the selected provider's implementation runs, plus
  any hook wrappers (metrics, tracing) registered by other plugins;
* adjustments -- ``firstresult`` hooks any plugin may answer, whichever plugin runs the stage
  (:func:`mrl_weight_sync_map_name`); ``None`` passes to the next plugin, and with no answer the
  default applies.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

from mrl_plugins.hookspecs.types import (
    CommCodec,
    CommTransport,
    PublishReport,
    RolloutEngine,
    RolloutResult,
    StageContext,
    SwitchReport,
    WeightTransport,
)

if TYPE_CHECKING:  # pragma: no cover
    import torch

PROJECT_NAME = "mrl_plugins"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- lifecycle


@hookspec(historic=True)
def mrl_configure(config: Any) -> None:
    """Receive the validated run configuration.

    :param config: the :class:`mrl_plugins.config.MrlConfig` of this run.

    Called once after all plugins are registered and blocked plugins removed, before any stage
    hook. Historic: a plugin registered later is called immediately on registration.

    Example::

        @hookimpl
        def mrl_configure(config):
            self.poll_s = config.weight_sync.poll_interval_s
    """


@hookspec
def mrl_shutdown(ctx: StageContext, reason: str) -> None:
    """Release everything a plugin built for this run (processes, shared memory, groups).

    :param ctx: the run's context; plugins find their objects in ``ctx.resources``.
    :param reason: ``"normal"``, ``"error"`` or a signal name.

    Called once per run by the adapter (end of ``train()``, on error and on SIGTERM/SIGINT).
    Must not raise for resources already gone; must not wait without a timeout.

    Example::

        @hookimpl
        def mrl_shutdown(ctx, reason):
            ring = ctx.resources.pop("myplugin.ring", None)
            if ring is not None:
                ring.close(unlink=True)
    """


# --------------------------------------------------------------------------- registration


@hookspec
def mrl_rollout_register_engines() -> Iterable[RolloutEngine]:
    """Register generation engines selectable as ``rollout.engine``.

    :return: registration objects; two plugins registering one name is an error naming both.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_rollout_register_engines():
            yield RolloutEngine(name="myengine", factory=MyEngine, description="...")
    """


@hookspec
def mrl_weight_sync_register_transports() -> Iterable[WeightTransport]:
    """Register weight transports selectable as ``weight_sync.transport``.

    :return: registration objects (name + factory); duplicate names are an error.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_weight_sync_register_transports():
            yield WeightTransport(name="rdma", factory=RdmaTransport)
    """


@hookspec
def mrl_comm_register_transports() -> Iterable[CommTransport]:
    """Register experience transports selectable as ``comm.transport``.

    :return: registration objects (name + factory); duplicate names are an error.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_comm_register_transports():
            yield CommTransport(name="zmq", factory=ZmqTransport)
    """


@hookspec
def mrl_comm_register_codecs() -> Iterable[CommCodec]:
    """Register experience codecs selectable as ``comm.codec``.

    :return: registration objects (name + factory); duplicate names are an error.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_comm_register_codecs():
            yield CommCodec(name="int8", factory=Int8Codec)
    """


# --------------------------------------------------------------------------- rollout


@hookspec(firstresult=True)
def mrl_rollout_generate(
    ctx: StageContext, prompts: list[list[int]], num_generations: int, model_id: str
) -> RolloutResult | None:
    """Generate ``num_generations`` completions per prompt, with per-token sampling logprobs.

    :param ctx: the run's context (``ctx.host`` is the trainer).
    :param prompts: token ids of each prompt, unpadded.
    :param num_generations: completions per prompt (TRL's ``num_generations`` for this call).
    :param model_id: which served model answers (``"policy"`` unless a multi-model pool is used).
    :return: a :class:`RolloutResult` tagged with the weight version that produced it; ``None``
        lets the next implementation answer.

    Called by the adapter wherever TRL would generate (its ``vllm_generation.generate`` seam), once
    per generation batch. Routed to the plugin selected for ``rollout``.

    Example::

        @hookimpl
        def mrl_rollout_generate(ctx, prompts, num_generations, model_id):
            return ctx.resources["mine.engine"].generate(prompts, num_generations)
    """


# --------------------------------------------------------------------------- weight sync


@hookspec(firstresult=True)
def mrl_weight_sync_publish(
    ctx: StageContext, model_id: str, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
) -> PublishReport | None:
    """Publish the trainer's weights as ``version`` of ``model_id``.

    :param ctx: the run's context; the sender the adapter built is in ``ctx.resources``.
    :param model_id: which served model the weights belong to (``"policy"`` for a single model).
    :param named_tensors: ``(name, tensor)`` pairs, streamed: an implementation must not hold more
        than one bucket of them at once (ZeRO-3 gathers them one at a time).
    :param version: strictly increasing per ``model_id``.
    :return: a :class:`PublishReport`.

    Called at TRL's sync points (when the global step changed since the last generation).

    Example::

        @hookimpl
        def mrl_weight_sync_publish(ctx, model_id, version, named_tensors):
            return ctx.resources["mine.sender"].publish(model_id, version, named_tensors)
    """


@hookspec(firstresult=True)
def mrl_weight_sync_receive(ctx: StageContext, model_id: str, timeout: float) -> int | None:
    """Fetch the newest published version of ``model_id`` into the staging buffer, if it changed.

    :param ctx: the inference process's context (its receiver is in ``ctx.resources``).
    :param model_id: which served model to refresh.
    :param timeout: seconds to wait for a transfer in progress before raising ``TimeoutError``.
    :return: the version now staged, or ``None`` when nothing newer was published. A corrupted or
        incomplete version raises and leaves the active weights untouched.

    Called by the inference side (poll loop, or on a new-version control message).

    Example::

        @hookimpl
        def mrl_weight_sync_receive(ctx, model_id, timeout):
            return ctx.resources["mine.receiver"].poll(timeout=timeout)
    """


@hookspec(firstresult=True)
def mrl_weight_sync_switch(ctx: StageContext, model_id: str) -> SwitchReport | None:
    """Atomically make the staged version active once in-flight requests on the old one drained.

    :param ctx: the inference process's context.
    :param model_id: which served model switches.
    :return: a :class:`SwitchReport` (one version-log line), or ``None`` if nothing was staged.

    Called by the inference side after :func:`mrl_weight_sync_receive` staged a new version,
    between generation requests.

    Example::

        @hookimpl
        def mrl_weight_sync_switch(ctx, model_id):
            return ctx.resources["mine.receiver"].switch()
    """


@hookspec(firstresult=True)
def mrl_weight_sync_map_name(model_id: str, name: str) -> str | None:
    """Map a published parameter name to the receiving model's parameter name.

    :param model_id: the served model the tensor belongs to (``"policy"``, ``"ref"``, ...).
    :param name: the name the trainer published (the trainer model's parameter name; PEFT: the base
        model's name).
    :return: the receiving model's parameter name, or ``None`` to leave it to other plugins (with no
        answer at all the name is used as it is).

    Called once per published name and model (the answer is cached) by the double-buffered receivers of
    the ``mrl`` weight-sync stage: rollout workers and the in-process inference copy, in the process that
    receives (``weight_sync: upstream`` loads by name, as TRL does). Rollout workers build their own
    plugin manager, so a plugin must be installed (entry point) to be asked there. A name that maps to
    no parameter of the receiving model is an error naming it; no version is switched half-received.

    Example::

        @hookimpl
        def mrl_weight_sync_map_name(model_id, name):
            return name.replace("self_attn.qkv", "attn.c_attn") if model_id == "policy" else None
    """


# --------------------------------------------------------------------------- communication


@hookspec(firstresult=True)
def mrl_comm_encode(ctx: StageContext, batch: Mapping[str, Any], meta: Mapping[str, Any]) -> bytes | None:
    """Encode an experience batch (dict of tensors/arrays) into one frame.

    :param ctx: the run's context (``ctx.config.comm`` holds the codec settings).
    :param batch: field name -> tensor or array (completion ids, logprobs, masks, rewards ...).
    :param meta: header fields: ``model_id``, ``version`` (weight version), ``seq``.
    :return: the frame bytes.

    Called by the rollout side before a batch goes onto a transport (``mrl_comm_send`` uses it),
    and by benchmarks on their own.

    Example::

        @hookimpl
        def mrl_comm_encode(ctx, batch, meta):
            return encode_frame(batch, **meta)
    """


@hookspec(firstresult=True)
def mrl_comm_decode(ctx: StageContext, frame: bytes | memoryview) -> Any:
    """Decode a frame back into ``(meta, batch)`` with the original dtypes restored.

    :param ctx: the run's context.
    :param frame: bytes produced by :func:`mrl_comm_encode` of the same plugin (a memoryview of a
        shared-memory slot is allowed: do not keep it after returning).
    :return: ``(meta, batch)``.
    :raise mrl_plugins.comm.FrameError: bad magic, version, layout or checksum.

    Called by the trainer side for every received frame (``mrl_comm_receive`` uses it).

    Example::

        @hookimpl
        def mrl_comm_decode(ctx, frame):
            return decode_frame(frame)
    """


@hookspec(firstresult=True)
def mrl_comm_send(ctx: StageContext, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float) -> int | None:
    """Send one experience batch towards the trainer.

    :param ctx: the rollout process's context (its producer is in ``ctx.resources``).
    :param batch: field name -> tensor or array.
    :param meta: header fields: ``model_id``, ``version``, ``seq``.
    :param timeout: seconds to block when the transport is full (backpressure) before raising
        ``TimeoutError`` (:class:`mrl_plugins.errors.StageTimeoutError`).
    :return: the bytes put on the transport.

    Called by each rollout worker once per generated batch.

    Example::

        @hookimpl
        def mrl_comm_send(ctx, batch, meta, timeout):
            return ctx.resources["mine.producer"].send(batch, meta, timeout=timeout)
    """


@hookspec(firstresult=True)
def mrl_comm_receive(ctx: StageContext, timeout: float) -> Any:
    """Receive the next experience batch.

    :param ctx: the trainer process's context (its consumer is in ``ctx.resources``).
    :param timeout: seconds to wait for a batch before raising ``TimeoutError``
        (:class:`mrl_plugins.errors.StageTimeoutError`; a dead producer is reported sooner).
    :return: ``(meta, batch)`` as decoded by :func:`mrl_comm_decode`.

    Called by the adapter whenever the trainer needs the next generation batch.

    Example::

        @hookimpl
        def mrl_comm_receive(ctx, timeout):
            return ctx.resources["mine.consumer"].receive(timeout=timeout)
    """


#: stage-operation hooks per stage; the manager routes these to the selected plugin
STAGE_HOOKS: dict[str, tuple[str, ...]] = {
    "rollout": ("mrl_rollout_generate",),
    "weight_sync": ("mrl_weight_sync_publish", "mrl_weight_sync_receive", "mrl_weight_sync_switch"),
    "comm": ("mrl_comm_encode", "mrl_comm_decode", "mrl_comm_send", "mrl_comm_receive"),
}

#: hooks any plugin may answer (not routed to the selected provider)
ADJUSTMENT_HOOKS = ("mrl_weight_sync_map_name",)

__all__ = [
    "ADJUSTMENT_HOOKS",
    "PROJECT_NAME",
    "STAGE_HOOKS",
    "hookimpl",
    "hookspec",
    "PublishReport",
    "RolloutResult",
    "SwitchReport",
]
