"""The built-in weight-sync plugin (registered by the manager under the plugin name ``"mrl"``).

Resources it uses in ``ctx.resources`` (built by the adapter/lead from the selected transport):

* ``"weight_sync.sender"``: a sender (``publish(version, named_tensors)``), or a dict
  ``model_id -> sender`` when several models are published;
* ``"weight_sync.receiver"``: a :class:`~mrl_plugins.weight_sync.receiver.DoubleBufferedReceiver`, or a
  dict ``model_id -> receiver``;
* ``"weight_sync.poller"`` (optional): a :class:`~mrl_plugins.weight_sync.receiver.VersionPoller` or a
  dict of them; stopped at shutdown.

Metrics (into ``ctx.metrics``: a :class:`~mrl_plugins.metrics.StageMetrics`, whose counters sum between
TRL log steps and whose gauges keep the last value, or a plain mutable mapping):

* each publish: counter ``mrl/weights/publish_seconds`` (the transport's own time);
* each switch: counters ``mrl/weights/received_bytes``, ``mrl/weights/receive_seconds`` (fetch into
  staging + switch) and ``mrl/weights/switches``; gauges ``mrl/weights/active_version``,
  ``mrl/weights/switch_ms``, ``mrl/weights/fetch_gbps`` and ``mrl/weights/ignored_versions``.

The published bytes and version (``mrl/weights/bytes``, ``mrl/weights/version``) are counted by the
caller of the publish hook (the TRL runtime), whichever plugin serves it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from typing import Any

import torch

from mrl_plugins.errors import PluginError, choices
from mrl_plugins.hookspecs import PublishReport, StageContext, SwitchReport, WeightTransport, hookimpl

from .broadcast import BroadcastSender, PerParamSender
from .directory import DirectorySender
from .shm import ShmSender

SENDER_KEY = "weight_sync.sender"
RECEIVER_KEY = "weight_sync.receiver"
POLLER_KEY = "weight_sync.poller"


def _pick(ctx: StageContext, key: str, model_id: str) -> Any:
    obj = ctx.resources.get(key)
    if obj is None:
        raise PluginError(f"weight_sync: ctx.resources[{key!r}] is not set (the adapter builds it)")
    if isinstance(obj, dict):
        if model_id not in obj:
            raise PluginError(f"weight_sync: no {key.split('.')[-1]} for model_id={model_id!r}; have {choices(obj)}")
        return obj[model_id]
    return obj


def _close_all(obj: Any, method: str) -> None:
    for o in obj.values() if isinstance(obj, dict) else [obj]:
        fn = getattr(o, method, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # noqa: BLE001 - shutdown must not raise for resources already gone
                pass


class WeightSyncPlugin:
    """Transports ``shm``, ``directory``, ``broadcast`` and ``per_param`` plus the three stage operations."""

    @hookimpl
    def mrl_weight_sync_register_transports(self) -> Iterator[WeightTransport]:
        yield WeightTransport(name="shm", factory=ShmSender, description="shared memory on one host, double-buffered")
        yield WeightTransport(
            name="directory",
            factory=DirectorySender,
            description="safetensors files + atomic manifest (local or shared filesystem)",
        )
        yield WeightTransport(
            name="broadcast",
            factory=BroadcastSender,
            description="bucketed torch.distributed broadcast on a dedicated group",
        )
        yield WeightTransport(
            name="per_param",
            factory=PerParamSender,
            description="one torch.distributed broadcast per parameter (baseline)",
        )

    @hookimpl
    def mrl_weight_sync_publish(
        self, ctx: StageContext, model_id: str, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> PublishReport | None:
        report = _pick(ctx, SENDER_KEY, model_id).publish(version, named_tensors)
        _emit(ctx, {"mrl/weights/publish_seconds": report.seconds})
        return report

    @hookimpl
    def mrl_weight_sync_receive(self, ctx: StageContext, model_id: str, timeout: float) -> int | None:
        return _pick(ctx, RECEIVER_KEY, model_id).poll(timeout)

    @hookimpl
    def mrl_weight_sync_switch(self, ctx: StageContext, model_id: str) -> SwitchReport | None:
        receiver = _pick(ctx, RECEIVER_KEY, model_id)
        report = receiver.switch(getattr(getattr(ctx.config, "weight_sync", None), "timeout_s", None))
        if report is not None:
            stats = receiver.stats()
            _emit(
                ctx,
                {
                    "mrl/weights/received_bytes": float(report.nbytes),
                    "mrl/weights/receive_seconds": report.seconds,
                    "mrl/weights/switches": 1.0,
                },
                {
                    "mrl/weights/active_version": float(report.to_version),
                    "mrl/weights/switch_ms": stats.get("switch_ms", 0.0),
                    "mrl/weights/fetch_gbps": stats.get("fetch_gbps", 0.0),
                    "mrl/weights/ignored_versions": stats.get("ignored_versions", 0.0),
                },
            )
        return report

    @hookimpl
    def mrl_shutdown(self, ctx: StageContext, reason: str) -> None:
        poller = ctx.resources.pop(POLLER_KEY, None)
        if poller is not None:
            _close_all(poller, "stop")
        for key in (RECEIVER_KEY, SENDER_KEY):
            obj = ctx.resources.pop(key, None)
            if obj is not None:
                _close_all(obj, "close")


def _emit(ctx: StageContext, counters: dict[str, float], gauges: dict[str, float] | None = None) -> None:
    """Counters add to what the log window holds already; gauges replace it."""
    m = ctx.metrics
    if m is None:
        return
    add, gauge = getattr(m, "add", None), getattr(m, "gauge", None)
    if callable(add) and callable(gauge):
        for k, v in counters.items():
            add(k, v)
        for k, v in (gauges or {}).items():
            gauge(k, v)
    elif isinstance(m, MutableMapping):
        for k, v in counters.items():
            m[k] = m.get(k, 0.0) + v
        m.update(gauges or {})


__all__ = ["POLLER_KEY", "RECEIVER_KEY", "SENDER_KEY", "WeightSyncPlugin"]
