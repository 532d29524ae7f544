"""Hook specifications: the contract between the host adapter and the plugins.

Naming: ``mrl_<stage>_<verb>``. Hooks are called with keyword arguments only (pluggy refuses
positional calls); implementations declare the parameters they need by name, as plain parameters
(not after ``*``: pluggy passes no keyword-only parameters). Three kinds of hook:

* lifecycle -- :func:`mrl_configure` (historic: plugins registered late still get it) and
  :func:`mrl_shutdown`;
* registration -- ``mrl_<stage>_register_<things>`` return small named registration objects
  (:mod:`mrl_plugins.hookspecs.types`), collected by the manager into one table per kind and picked
  by name from the config. Everything selectable is found this one way: a whole stage
  (``mrl_<stage>_register_stages`` -> ``plugins.<stage>``: the built-in ``mrl``, ``upstream`` or a
  third party's) as much as the parts the built-in stages pick from (engines, transports, codecs).
  A stage is an object satisfying its protocol in :mod:`mrl_plugins.hookspecs.channels`
  (:class:`~mrl_plugins.hookspecs.channels.CommStage` ...): it *opens its own ends*, typed protocols
  with :class:`Capabilities`, on the trainer side and on the worker side; the rollout stage is handed
  the other stages' ends through the manager;
* one name-mapping hook any plugin may answer, whichever plugin runs the stage
  (:func:`mrl_weight_sync_map_name`); ``None`` passes to the next plugin, and with no answer the
  name is used as it is.

Parameter types are imported under ``TYPE_CHECKING`` only (no import cost, no import circle).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import pluggy

from mrl_plugins.hookspecs.types import (
    CommCodec,
    CommTransport,
    RolloutEngine,
    StageContext,
    StagePlugin,
    WeightTransport,
)

if TYPE_CHECKING:  # pragma: no cover
    from mrl_plugins.config import MrlConfig

PROJECT_NAME = "mrl_plugins"
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


# --------------------------------------------------------------------------- lifecycle


@hookspec(historic=True)
def mrl_configure(config: MrlConfig) -> None:
    """Receive the validated run configuration.

    :param config: the :class:`mrl_plugins.config.MrlConfig` of this run.

    Called once after all plugins are registered, blocked plugins removed and the selected stage objects
    built, before any stage method is called. Historic: a plugin registered later is called immediately on
    registration.

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
def mrl_rollout_register_stages() -> Iterable[StagePlugin]:
    """Register implementations of the whole rollout stage, selectable as ``plugins.rollout: <name>``.

    :return: registration objects whose ``factory()`` returns a
        :class:`~mrl_plugins.hookspecs.channels.RolloutStage` (``open_runtime(ctx, setup)``); two plugins
        registering one name is an error naming both.

    Called once when the manager builds its registry (before ``mrl_configure``); the selected one's factory is
    called when it is selected.

    Example::

        @hookimpl
        def mrl_rollout_register_stages():
            yield StagePlugin(name="myrollout", factory=MyRollout)  # MyRollout().open_runtime(ctx, setup)
    """


@hookspec
def mrl_weight_sync_register_stages() -> Iterable[StagePlugin]:
    """Register implementations of the whole weight-sync stage, selectable as ``plugins.weight_sync: <name>``.

    :return: registration objects whose ``factory()`` returns a
        :class:`~mrl_plugins.hookspecs.channels.WeightSyncStage` (``capabilities``, ``open_sender``,
        ``open_receiver``); duplicate names are an error.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_weight_sync_register_stages():
            yield StagePlugin(name="files", factory=FileWeights)
    """


@hookspec
def mrl_comm_register_stages() -> Iterable[StagePlugin]:
    """Register implementations of the whole communication stage, selectable as ``plugins.comm: <name>``.

    :return: registration objects whose ``factory()`` returns a :class:`~mrl_plugins.hookspecs.channels.CommStage`
        (``capabilities``, ``open_consumer``, ``open_producer``); duplicate names are an error.

    Called once when the manager builds its registry (before ``mrl_configure``).

    Example::

        @hookimpl
        def mrl_comm_register_stages():
            yield StagePlugin(name="zmq", factory=ZmqComm)
    """


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


# --------------------------------------------------------------------------- names


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
