"""The built-in ``comm`` stage plugin (selected as ``plugins.comm: mrl``): transports ``shm``, ``queue``,
``torch_distributed``; codecs ``raw``, ``fp16``, ``bf16``.

It opens the experience path's ends from the registrations that ``comm.transport`` and ``comm.codec`` name
(third-party transports and codecs included): ``open_consumer`` on the trainer side, ``open_producer`` in each
rollout worker (which builds the codec from its own registry, so a codec needs to be installed, not pickled). Each
end carries its transport's :class:`~mrl_plugins.hookspecs.channels.Capabilities`. The caller owns and closes the
ends.
"""

from __future__ import annotations

import functools
from typing import Any

from mrl_plugins.hookspecs import Capabilities, CommCodec, CommTransport, StageContext, StagePlugin, hookimpl

from .codec import Codec, make_codec
from .dist_transport import dist_factory
from .queue_transport import queue_factory
from .shm_ring import shm_factory

TRANSPORTS = "mrl_comm_register_transports"
CODECS = "mrl_comm_register_codecs"


def _codec(ctx: StageContext) -> Codec:
    cfg = ctx.config.comm
    return ctx.plugins.backend(CODECS, cfg.codec).factory(cfg)


def _transport(ctx: StageContext) -> Any:
    return ctx.plugins.backend(TRANSPORTS, ctx.config.comm.transport)


class CommPlugin:
    """The ``comm`` stage ``mrl`` (a :class:`~mrl_plugins.hookspecs.channels.CommStage`; the plugin registered by the
    manager as ``mrl.comm``), with its transports and codecs."""

    @hookimpl
    def mrl_comm_register_stages(self) -> list[StagePlugin]:
        return [StagePlugin("mrl", lambda: self, "transports shm / queue / torch_distributed, codecs (comm.*)")]

    @hookimpl
    def mrl_comm_register_transports(self) -> list[CommTransport]:
        return [
            CommTransport(
                "shm",
                shm_factory,
                "shared-memory ring, N producers -> 1 consumer on one host",
                Capabilities(rejoinable=True, zero_copy=True),
            ),
            CommTransport(
                "queue", queue_factory, "multiprocessing.Queue + pickle (baseline)", Capabilities(rejoinable=True)
            ),
            CommTransport(
                "torch_distributed",
                dist_factory,
                "frames over a private gloo process group per producer (a restarted one joins a new group)",
                Capabilities(cross_host=True, rejoinable=True),
            ),
        ]

    @hookimpl
    def mrl_comm_register_codecs(self) -> list[CommCodec]:
        return [
            CommCodec(name, functools.partial(make_codec, name=name), description)
            for name, description in (
                ("auto", "raw on shm/queue, fp16 on network transports"),
                ("raw", "lossless, every field as is"),
                ("fp16", "floats fp16 (overflow-guarded)"),
                ("bf16", "floats bf16"),
            )
        ]

    def capabilities(self, ctx: StageContext) -> Capabilities:
        return _transport(ctx).capabilities

    def open_consumer(self, ctx: StageContext, run_id: str, producers: int) -> Any:
        reg = _transport(ctx)
        codec = _codec(ctx)  # an unknown or broken codec fails here, before any worker starts
        consumer = reg.factory(ctx.config.comm, n_producers=producers, run_id=run_id, codec=codec)
        consumer.capabilities = reg.capabilities
        return consumer

    def open_producer(self, ctx: StageContext, handle: Any, index: int) -> Any:
        reg = _transport(ctx)
        producer = handle.attach(codec=_codec(ctx))
        producer.capabilities = reg.capabilities
        return producer
