"""Hook specifications: the contract between the host adapter and the stage plugins.

Naming: ``mrl_<stage>_<verb>``. Hooks are called with keyword arguments only (pluggy refuses
positional calls); implementations declare the parameters they need by name, as plain parameters
(not after ``*``: pluggy passes no keyword-only parameters). Four kinds of hook:

* lifecycle -- :func:`mrl_configure` (historic: plugins registered late still get it) and
  :func:`mrl_shutdown`;
* registration -- ``mrl_<stage>_register_<things>`` return small named registration objects
  (:mod:`mrl_plugins.hookspecs.types`), collected by the manager and picked by name from config;
* stage hooks -- ``firstresult`` hooks that the manager routes to the plugin selected for that stage
  (``plugins: {rollout: mrl}``): only the selected provider's implementation runs, plus any hook
  wrappers (metrics, tracing) registered by other plugins. Each stage's plugin *opens its own ends*
  (:mod:`mrl_plugins.hookspecs.channels`: typed protocols with :class:`Capabilities`), on the
  trainer side and on the worker side; the rollout stage is handed the other stages' ends through
  these hooks and calls their methods. A plugin selected for a stage implements every hook of
  :data:`STAGE_HOOKS` for it (checked when it is selected); an answer of ``None`` is an error naming
  the hook and the plugin;
* one name-mapping hook any plugin may answer, whichever plugin runs the stage
  (:func:`mrl_weight_sync_map_name`); ``None`` passes to the next plugin, and with no answer the
  name is used as it is.

Parameter types are imported under ``TYPE_CHECKING`` only (no import cost, no import circle).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import pluggy

from mrl_plugins.hookspecs.types import CommCodec, CommTransport, RolloutEngine, StageContext, WeightTransport

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mrl_plugins.config import MrlConfig
    from mrl_plugins.hookspecs.channels import (
        Capabilities,
        ExperienceConsumer,
        ExperienceProducer,
        RolloutRuntime,
        RolloutSetup,
        WeightReceiver,
        WeightSender,
    )

PROJECT_NAME = "mrl_plugins"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- lifecycle


@hookspec(historic=True)
def mrl_configure(config: MrlConfig) -> None:
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

    :return: registration objects (name + factory); duplicate names are an error. ``factory(config)``
        (a :class:`mrl_plugins.comm.config.CommConfig`) returns a field codec: a
        :class:`mrl_plugins.comm.codec.Codec` or a subclass (it chooses the wire dtype of each field);
        the built-in comm stage builds the selected one through the registry on both ends.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_comm_register_codecs():
            yield CommCodec(name="int8", factory=lambda config: Int8Codec(config.lossless_fields))
    """


# --------------------------------------------------------------------------- rollout


@hookspec(firstresult=True)
def mrl_rollout_open_runtime(ctx: StageContext, setup: RolloutSetup) -> RolloutRuntime | None:
    """Build the trainer side of the rollout stage: the object the host calls where it would generate.

    :param ctx: the run's context (``ctx.host`` is the trainer, ``ctx.backends`` the registrations).
    :param setup: the policy, sampling settings, seed, device and placement plan
        (:class:`~mrl_plugins.hookspecs.channels.RolloutSetup`).
    :return: a :class:`~mrl_plugins.hookspecs.channels.RolloutRuntime`. It opens the other stages' ends
        through the manager (``ctx.plugins.weight_sync_open_sender(...)``, ``ctx.plugins.comm_open_consumer(...)``
        on this side; its workers open the receivers and producers) and owns them until ``close()``.

    Called once by the adapter at ``enable()``, for the plugin selected for ``rollout``. The runtime's
    ``generate`` is called once per generation batch, its ``publish`` at the host's weight-sync points.

    Example::

        @hookimpl
        def mrl_rollout_open_runtime(ctx, setup):
            return MyRuntime(ctx, setup.model, setup.sampling)  # generate(), publish(), close()
    """


# --------------------------------------------------------------------------- weight sync


@hookspec(firstresult=True)
def mrl_weight_sync_capabilities(ctx: StageContext) -> Capabilities | None:
    """What the weight-sync ends this plugin would open under ``ctx.config`` can do, before any is opened.

    :param ctx: the trainer process's context (``ctx.config``; ``ctx.plugins`` for registrations).
    :return: a :class:`~mrl_plugins.hookspecs.channels.Capabilities` (the same flags the opened ends carry).

    Called at ``enable()`` by the rollout stage, to refuse what the ends cannot do (workers on other hosts
    without ``cross_host``, moving workers without ``rejoinable``) before the trainer is touched.

    Example::

        @hookimpl
        def mrl_weight_sync_capabilities(ctx):
            return Capabilities(rejoinable=True)
    """


@hookspec(firstresult=True)
def mrl_weight_sync_open_sender(
    ctx: StageContext, model_id: str, run_id: str, receivers: int, same_process: bool
) -> WeightSender | None:
    """Open the trainer side of one model's weight stream.

    :param ctx: the trainer process's context.
    :param model_id: which served model (``"policy"``, ``"ref"`` ...).
    :param run_id: unique per rollout-stage start (name shared memory, files, groups after it).
    :param receivers: how many receiving processes will open a receiver from ``receiver_handle()``
        (a collective transport sizes its group from it: the trainer plus one rank per receiver).
    :param same_process: the receiver lives in this process (the in-process inference copy).
    :return: a :class:`~mrl_plugins.hookspecs.channels.WeightSender`, owned (and closed) by the caller.

    Called by the rollout stage when it starts, once per served model.

    Example::

        @hookimpl
        def mrl_weight_sync_open_sender(ctx, model_id, run_id, receivers, same_process):
            return FileSender(ctx.config.weight_sync.directory, model_id, run_id)
    """


@hookspec(firstresult=True)
def mrl_weight_sync_open_receiver(
    ctx: StageContext, model: torch.nn.Module, handle: Any, model_id: str, rank: int
) -> WeightReceiver | None:
    """Open the inference side of one model's weight stream, loading into ``model``.

    :param ctx: the inference process's context (a rollout worker's, or the trainer's for an in-process copy).
    :param model: the inference copy whose parameters receive each version.
    :param handle: what the sender's ``receiver_handle()`` returned (pickled across processes).
    :param model_id: which served model.
    :param rank: this receiver's index among the sender's ``receivers`` (0-based).
    :return: a :class:`~mrl_plugins.hookspecs.channels.WeightReceiver`, owned (and closed) by the caller.
        Published names go through :func:`mrl_weight_sync_map_name` (``ctx.plugins.weight_sync_name_map``).

    Called by each rollout worker at start (and by the in-process engine), once per served model.

    Example::

        @hookimpl
        def mrl_weight_sync_open_receiver(ctx, model, handle, model_id, rank):
            return FileReceiver(handle, model)  # poll(), switch(), active(), version
    """


@hookspec(firstresult=True)
def mrl_weight_sync_map_name(model_id: str, name: str) -> str | None:
    """Map a published parameter name to the receiving model's parameter name.

    :param model_id: the served model the tensor belongs to (``"policy"``, ``"ref"``, ...).
    :param name: the name the trainer published (the trainer model's parameter name; PEFT: the base
        model's name).
    :return: the receiving model's parameter name, or ``None`` to leave it to other plugins (with no
        answer at all the name is used as it is).

    Asked of every plugin, not only the selected one. Called once per published name and model (the answer
    is cached) by the double-buffered receivers of the ``mrl`` weight-sync stage: rollout workers and the
    in-process inference copy, in the process that receives (``weight_sync: upstream`` loads by name, as TRL
    does). Rollout workers build their own plugin manager, so a plugin must be installed (entry point) to be
    asked there. A name that maps to no parameter of the receiving model is an error naming it; no version is
    switched half-received.

    Example::

        @hookimpl
        def mrl_weight_sync_map_name(model_id, name):
            return name.replace("self_attn.qkv", "attn.c_attn") if model_id == "policy" else None
    """


# --------------------------------------------------------------------------- communication


@hookspec(firstresult=True)
def mrl_comm_capabilities(ctx: StageContext) -> Capabilities | None:
    """What the experience ends this plugin would open under ``ctx.config`` can do, before any is opened.

    :param ctx: the trainer process's context (``ctx.config``; ``ctx.plugins`` for registrations).
    :return: a :class:`~mrl_plugins.hookspecs.channels.Capabilities`.

    Called at ``enable()`` by the rollout stage (workers on other hosts need ``cross_host``).

    Example::

        @hookimpl
        def mrl_comm_capabilities(ctx):
            return Capabilities(rejoinable=True)
    """


@hookspec(firstresult=True)
def mrl_comm_open_consumer(ctx: StageContext, run_id: str, producers: int) -> ExperienceConsumer | None:
    """Open the trainer side of the experience path for ``producers`` rollout workers.

    :param ctx: the trainer process's context (``ctx.config.comm`` holds the transport settings).
    :param run_id: unique per rollout-stage start.
    :param producers: how many producers will open an end from ``producer_handle(i)``, ``0 <= i < producers``.
    :return: an :class:`~mrl_plugins.hookspecs.channels.ExperienceConsumer`, owned (and closed) by the caller.

    Called by the rollout stage when it starts its workers.

    Example::

        @hookimpl
        def mrl_comm_open_consumer(ctx, run_id, producers):
            return ZmqConsumer(ctx.config.comm, run_id, producers)
    """


@hookspec(firstresult=True)
def mrl_comm_open_producer(ctx: StageContext, handle: Any, index: int) -> ExperienceProducer | None:
    """Open the rollout side of the experience path in a worker process.

    :param ctx: the worker process's context.
    :param handle: what the consumer's ``producer_handle(index)`` returned (pickled across processes).
    :param index: this worker's producer index.
    :return: an :class:`~mrl_plugins.hookspecs.channels.ExperienceProducer`, owned (and closed) by the caller.

    Called by each rollout worker at start, once.

    Example::

        @hookimpl
        def mrl_comm_open_producer(ctx, handle, index):
            return handle.attach()
    """


#: the hooks a plugin selected for each stage implements; the manager routes them to that plugin only
STAGE_HOOKS: dict[str, tuple[str, ...]] = {
    "rollout": ("mrl_rollout_open_runtime",),
    "weight_sync": (
        "mrl_weight_sync_capabilities",
        "mrl_weight_sync_open_sender",
        "mrl_weight_sync_open_receiver",
    ),
    "comm": ("mrl_comm_capabilities", "mrl_comm_open_consumer", "mrl_comm_open_producer"),
}

__all__ = ["PROJECT_NAME", "STAGE_HOOKS", "hookimpl", "hookspec"]
