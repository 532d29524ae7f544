"""vLLM's weight-transfer protocol, the pieces this package adds to it (imports ``vllm``: load it only when
``weight_sync.transport: vllm`` is used).

* :class:`PairsSource`: a ``vllm`` ``WeightSource`` over the ``(name, tensor)`` pairs of one publish (the trainer
  engine takes its source once, at ``trainer_init``; each publish refills it).
* ``mrl_gloo``: a weight-transfer backend over a dedicated gloo group (host tensors), registered in both of vLLM's
  factories (``WeightTransferEngineFactory`` for the inference side, ``WeightTransferTrainerFactory`` for the
  trainer side): vLLM's own backends do not run on a CPU host, so this one runs the whole protocol there (what the
  tests exercise on vLLM's CPU backend). On the inference side it receives each tensor by broadcast from the trainer
  (group rank 0) and loads it with the model's ``load_weights`` inside vLLM's layerwise reload, like vLLM's dense
  nccl engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

from mrl_plugins._net import gloo_broadcast, gloo_group, td

GLOO_BACKEND = "mrl_gloo"


class PairsSource(WeightSource):
    """The trainer's weights of the current publish, as ``(name, tensor)`` pairs (set :attr:`pairs` before each
    ``send_weights``)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[str, torch.Tensor]] = []

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.pairs]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(list(self.pairs))


def _group(host: str, port: int, rank: int, world: int, timeout: float, is_master: bool) -> Any:
    import torch.distributed as dist

    store = dist.TCPStore(
        host, port, world_size=world, is_master=is_master, timeout=td(timeout), wait_for_workers=False
    )
    return store, gloo_group(store, rank, world, timeout, host)


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    """Inference side: where the trainer's group listens, this engine's first rank, the group size."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 120.0


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer side (always group rank 0, the sender)."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 120.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    """One round: the tensors that follow, in order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    """Inference side of ``mrl_gloo``: broadcast receive, ``load_weights`` in vLLM's layerwise reload."""

    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.pg: Any = None
        self.store: Any = None
        self.timeout = 120.0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        rank = init_info.rank_offset + int(self.parallel_config.rank)
        self.timeout = float(init_info.timeout_s)
        self.store, self.pg = _group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, self.timeout, False
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))  # host tensors: nothing to synchronize

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.pg is None:
            raise RuntimeError("mrl_gloo weight transfer not initialised: call init_weight_transfer_engine first")
        info = update_info
        for name, dtype_name, shape in zip(info.names, info.dtype_names, info.shapes, strict=True):
            t = torch.empty(shape, dtype=getattr(torch, dtype_name))
            gloo_broadcast(self.pg, t, self.timeout).wait(td(self.timeout))
            self.model.load_weights([(name, t.to(self.device))])

    def shutdown(self) -> None:
        self.pg = self.store = None


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side of ``mrl_gloo``: hosts the group, drives the inference side through its client, broadcasts."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, timeout_s: float = 120.0) -> None:
        super().__init__(client=client, source=source, is_sender=True)
        self.timeout = float(timeout_s)
        self.pg: Any = None
        self.store: Any = None

    @classmethod
    def trainer_init(cls, init_info: GlooTrainerInitInfo, *, client: Any, source: Any = None) -> Any:
        if source is None:
            raise ValueError("mrl_gloo weight transfer needs a WeightSource")
        if not init_info.is_sender:
            raise ValueError("mrl_gloo weight transfer has one trainer rank (rank 0)")
        engine = cls(client=client, source=source, timeout_s=init_info.timeout_s)
        worker = GlooInitInfo(
            init_info.master_address, init_info.master_port, 1, init_info.world_size, init_info.timeout_s
        )
        # the inference side blocks in init_weight_transfer_engine until the group forms: both at once
        with ThreadPoolExecutor(max_workers=1) as exe:
            future = exe.submit(client.init_weight_transfer_engine, asdict(worker))
            engine.store, engine.pg = _group(
                init_info.master_address, init_info.master_port, 0, init_info.world_size, engine.timeout, True
            )
            future.result()
        return engine

    def send_weights(self) -> None:
        meta = self.source.metadata()
        info = GlooUpdateInfo([m.name for m in meta], [str(m.dtype).split(".")[-1] for m in meta],
                              [list(m.shape) for m in meta])  # fmt: skip
        self.client.start_weight_update()
        exe = ThreadPoolExecutor(max_workers=1)
        try:
            future = exe.submit(self.client.update_weights, asdict(info))
            for _name, t in self.source:
                gloo_broadcast(self.pg, t.detach().to("cpu").contiguous(), self.timeout).wait(td(self.timeout))
            future.result()
        finally:
            exe.shutdown(wait=False)  # a failed broadcast leaves the peer blocked: never join it here
        self.client.finish_weight_update()

    def shutdown(self) -> None:
        self.pg = self.store = None


def register() -> None:
    """Register ``mrl_gloo`` in vLLM's two weight-transfer factories (idempotent)."""
    if GLOO_BACKEND not in registered(WeightTransferEngineFactory):
        WeightTransferEngineFactory.register_engine(GLOO_BACKEND, GlooWeightTransferEngine)
    if GLOO_BACKEND not in registered(WeightTransferTrainerFactory):
        WeightTransferTrainerFactory.register_engine(GLOO_BACKEND, GlooTrainerWeightTransferEngine)


def registered(factory: Any = WeightTransferTrainerFactory) -> list[str]:
    """The backend names a vLLM weight-transfer factory knows (its registry; vllm-ascend adds its own there)."""
    return sorted(getattr(factory, "_registry", {}))


def trainer_engine(backend: str, *, host: str, port: int, world_size: int, timeout_s: float, client: Any,
                   source: Any) -> Any:  # fmt: skip
    """``WeightTransferTrainerFactory.trainer_init`` for ``backend``: its trainer init info is built from the
    rendezvous fields it declares (``master_address``, ``master_port``, ``world_size``; ``timeout_s`` where it has
    one), as vLLM's dense nccl backend and this module's gloo one do."""
    import dataclasses

    register()
    engine_cls = WeightTransferTrainerFactory._registry[backend]()
    info_cls = engine_cls.init_info_cls
    names = {f.name for f in dataclasses.fields(info_cls)}
    need = {"master_address", "master_port", "world_size"}
    if not need <= names:
        raise ValueError(
            f"vLLM weight-transfer backend {backend!r}: its trainer init info {info_cls.__name__} has no "
            f"{sorted(need - names)} (not a broadcast-style backend this transport can drive)"
        )
    kwargs: dict[str, Any] = {"master_address": host, "master_port": port, "world_size": world_size, "rank": 0}
    if "timeout_s" in names:
        kwargs["timeout_s"] = timeout_s
    return WeightTransferTrainerFactory.trainer_init(info_cls(**kwargs), client=client, source=source)


__all__ = [
    "GLOO_BACKEND",
    "GlooTrainerWeightTransferEngine",
    "GlooWeightTransferEngine",
    "PairsSource",
    "register",
    "registered",
    "trainer_engine",
]
