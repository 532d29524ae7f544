"""The built-in ``comm`` stage plugin: transports ``shm``, ``queue``, ``torch_distributed``; three codecs.

``ctx.resources`` keys used by the stage operations and released by ``mrl_shutdown``:

=====================  ==================================================================
``comm.codec``         a :class:`FrameCodec` (built from ``ctx.config.comm`` on first use)
``comm.producer``      the rollout side's producer (``handle.attach()`` of a transport)
``comm.consumer``      the trainer side's consumer (``factory(config, n_producers=, run_id=)``)
``comm.prefetcher``    optional :class:`~mrl_plugins.comm.prefetch.Prefetcher` over the consumer;
                       when present ``mrl_comm_receive`` takes batches from it
``comm.control``       optional control hub or peer (:mod:`mrl_plugins.comm.control`)
=====================  ==================================================================

:func:`comm_metrics` turns the counters of what is there into ``mrl/comm/<key>`` numbers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from mrl_plugins.hookspecs import CommCodec, CommTransport, hookimpl

from .codec import Codec
from .config import CommConfig
from .dist_transport import dist_factory
from .frame import FramePlan, decode_frame
from .queue_transport import queue_factory
from .shm_ring import shm_factory

RESOURCE_KEYS = ("comm.prefetcher", "comm.producer", "comm.consumer", "comm.control", "comm.codec")


def _comm_config(config: Any) -> CommConfig:
    if isinstance(config, CommConfig):
        return config
    sub = getattr(config, "comm", None)
    return sub if isinstance(sub, CommConfig) else CommConfig()


class FrameCodec:
    """Encode/decode whole frames with one codec (what ``comm.codec`` registrations build).

    :param config: a :class:`CommConfig` or a run config with a ``comm`` section (for
        ``lossless_fields`` and ``checksum``).
    :param name: ``raw``, ``fp16`` or ``bf16`` (default: ``config.codec``).
    """

    def __init__(self, config: Any = None, name: str | None = None) -> None:
        cfg = _comm_config(config)
        self.name = name or cfg.codec
        self.codec = Codec(self.name, cfg.lossless_fields)
        self.checksum = cfg.checksum

    @classmethod
    def factory(cls, name: str, config: Any = None) -> FrameCodec:
        """``factory(name, config)``; registrations bind ``name``."""
        return cls(config, name)

    @property
    def fallbacks(self) -> int:
        """Float fields sent in their original dtype because they would overflow."""
        return self.codec.fallbacks

    def encode(self, batch: Mapping[str, Any], meta: Mapping[str, Any]) -> bytes:
        """One frame (bytes)."""
        plan = FramePlan(batch, meta, self.codec, self.checksum)
        out = bytearray(plan.nbytes)
        plan.write_into(out)
        return bytes(out)

    def decode(self, frame: bytes | bytearray | memoryview, copy: bool = False) -> tuple[dict, dict]:
        """``(meta, batch)``; see :func:`mrl_plugins.comm.frame.decode_frame`."""
        return decode_frame(frame, copy=copy)


def _codec(ctx: Any) -> FrameCodec:
    codec = ctx.resources.get("comm.codec")
    if codec is None:
        codec = ctx.resources["comm.codec"] = FrameCodec(ctx.config)
    return codec


def _need(ctx: Any, key: str) -> Any:
    obj = ctx.resources.get(key)
    if obj is None:
        from mrl_plugins.errors import PluginError

        raise PluginError(f"comm stage: ctx.resources[{key!r}] is not set (the adapter builds it before this call)")
    return obj


def comm_metrics(resources: Mapping[str, Any]) -> dict[str, float]:
    """``mrl/comm/<key>`` numbers from the consumer and producer stats (``producer_`` prefix for the latter)."""
    out: dict[str, float] = {}
    cons = resources.get("comm.consumer")
    if cons is not None:
        out.update({f"mrl/comm/{k}": float(v) for k, v in cons.stats().items()})
    prod = resources.get("comm.producer")
    if prod is not None:
        out.update({f"mrl/comm/producer_{k}": float(v) for k, v in prod.stats().items()})
    codec = resources.get("comm.codec")
    if codec is not None:
        out["mrl/comm/codec_fallbacks"] = float(codec.fallbacks)
    return out


class CommPlugin:
    """Stage plugin for ``comm`` (registered by the manager under the name ``mrl``)."""

    @hookimpl
    def mrl_comm_register_transports(self) -> list[CommTransport]:
        return [
            CommTransport("shm", shm_factory, "shared-memory ring, N producers -> 1 consumer on one host"),
            CommTransport("queue", queue_factory, "multiprocessing.Queue + pickle (baseline)"),
            CommTransport("torch_distributed", dist_factory, "frames over a private gloo process group"),
        ]

    @hookimpl
    def mrl_comm_register_codecs(self) -> list[CommCodec]:
        return [
            CommCodec("raw", functools.partial(FrameCodec.factory, "raw"), "lossless, every field as is"),
            CommCodec("fp16", functools.partial(FrameCodec.factory, "fp16"), "floats fp16 (overflow-guarded)"),
            CommCodec("bf16", functools.partial(FrameCodec.factory, "bf16"), "floats bf16"),
        ]

    @hookimpl
    def mrl_comm_encode(self, ctx: Any, batch: Mapping[str, Any], meta: Mapping[str, Any]) -> bytes:
        return _codec(ctx).encode(batch, meta)

    @hookimpl
    def mrl_comm_decode(self, ctx: Any, frame: bytes | memoryview) -> tuple[dict, dict]:
        return _codec(ctx).decode(frame)

    @hookimpl
    def mrl_comm_send(self, ctx: Any, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float) -> int:
        return _need(ctx, "comm.producer").send(batch, meta, timeout=timeout)

    @hookimpl
    def mrl_comm_receive(self, ctx: Any, timeout: float) -> tuple[dict, dict]:
        pf = ctx.resources.get("comm.prefetcher")
        r = pf.get(timeout=timeout) if pf is not None else _need(ctx, "comm.consumer").receive(timeout).detach()
        return r.meta, r.batch

    @hookimpl
    def mrl_shutdown(self, ctx: Any, reason: str) -> None:
        for key in RESOURCE_KEYS:
            obj = ctx.resources.pop(key, None)
            if obj is None:
                continue
            try:
                if key == "comm.prefetcher":
                    obj.stop(timeout=2.0)
                elif key in ("comm.consumer",) or type(obj).__name__ == "ControlHub":
                    obj.close(unlink=True)
                elif hasattr(obj, "close"):
                    obj.close()
            except Exception:  # shutdown must not raise for resources already gone
                pass
