"""The ``vllm`` weight transport: trainer weights straight into each worker's vLLM engine through vLLM's own
weight-transfer protocol, on the backend of the device (``weight_sync.vllm_backend``).

vLLM (>= 0.2x) splits a weight update into a trainer-side engine (``WeightTransferTrainerFactory.trainer_init``,
``send_weights``) and an inference-side engine that the model runner builds from ``weight_transfer_config`` and
drives in four phases: ``init_weight_transfer_engine`` once, then per version ``start_weight_update``,
``update_weights`` (concurrently with the trainer's broadcast) and ``finish_weight_update``. Its backends move device
memory (``nccl``; on Ascend whatever vllm-ascend registers, looked up as ``hccl``; ``ipc`` is not offered: see
docs/vllm.md); on a CPU host ``auto`` picks ``mrl_gloo`` (:mod:`~mrl_plugins.weight_sync.vllm_backends`).

How the plugin drives it:

* **Sender** (trainer): owns a ``TCPStore`` (the control plane) and, from the first publish on, vLLM's trainer
  engine for the backend with a :class:`StoreClient`: the four phases become store keys that every receiver acts on
  and acknowledges, each wait bounded by ``weight_sync.timeout_s``. A publish returns when every engine applied it.
* **Receiver** (rollout worker, :class:`VLLMTransferReceiver`): bound to the worker's vLLM engine. At a drain point
  (between requests: the pool tells the workers before a collective publish, and idle ones poll) ``poll`` joins
  the backend's group once and returns the next announced version; ``switch`` runs the round on the engine and
  stamps it with the version. There is no staging copy and no checksum: the weights land in vLLM's parameters, in
  layerwise reload, while no request is in flight.
* Tied weights: a receiver reports the names its model serves under an alias (``lm_head.weight`` for a tied
  embedding); the sender sends them too (vLLM keeps a separate processed ``lm_head``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from mrl_plugins._net import td
from mrl_plugins._proc import wait_until
from mrl_plugins.errors import ConfigError, StageTimeoutError, choices
from mrl_plugins.hookspecs import PublishReport, SwitchReport

from .shards import WeightSyncError, check_newer

LOG = logging.getLogger("mrl_plugins.weight_sync")
#: ``weight_sync.vllm_backend: auto`` per device type
AUTO_BACKENDS = {"cpu": "mrl_gloo", "cuda": "nccl", "npu": "hccl"}


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def resolve_backend(name: str, device_type: str | None = None) -> str:
    """The vLLM weight-transfer backend for ``weight_sync.vllm_backend`` (``auto``: by the trainer's device)."""
    if name != "auto":
        return name
    if device_type is None:
        from mrl_plugins.device import get_device

        device_type = get_device("auto").type
    return AUTO_BACKENDS[device_type]


def check_backend(backend: str) -> None:
    """ConfigError naming the registered backends when vLLM has no trainer-side engine called ``backend``."""
    from mrl_plugins.optional import check_vllm_installed

    check_vllm_installed()
    from .vllm_backends import register, registered

    register()
    have = registered()
    if backend not in have:
        hint = " (vllm-ascend registers its own; is it installed?)" if backend == "hccl" else ""
        raise ConfigError(
            f"weight_sync.vllm_backend {backend!r}: vLLM has no such weight-transfer backend{hint}; "
            f"registered: {choices(have)}, or 'auto'"
        )


def _wait(store: Any, key: str, count: int | None, timeout: float, what: str) -> None:
    """Until ``key`` exists (``count`` None) or its counter reaches ``count``; StageTimeoutError after ``timeout``."""
    wait_until(
        lambda: True if store.check([key]) and (count is None or int(store.add(key, 0)) >= count) else None,
        time.monotonic() + timeout,
        f"weight_sync 'vllm': {what} not done within {timeout:.0f} s",
        sleep=0.002,
    )


class StoreClient:
    """vLLM's ``VLLMWeightSyncClient`` (structural) over the sender's store: each phase is a key every receiver acts
    on; the trainer waits for all their acknowledgements. ``round`` is set by the sender before each publish."""

    def __init__(self, store: Any, receivers: int, timeout: float) -> None:
        self.store, self.receivers, self.timeout = store, receivers, timeout
        self.round = 0
        self.version = 0

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.store.set("init", json.dumps(init_info))
        _wait(self.store, "init_done", self.receivers, self.timeout, "joining the weight-transfer group")

    def start_weight_update(self) -> None:
        pass  # each receiver starts its round when it sees the update below (one message per round)

    def update_weights(self, update_info: Any) -> None:
        msg = {"version": self.version, "update_info": update_info}
        self.store.set(f"round/{self.round}", json.dumps(msg))
        _wait(self.store, f"round_done/{self.round}", self.receivers, self.timeout, f"round {self.round}")

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # each receiver finishes (and stamps the version) inside its round


@dataclass
class VLLMTransferHandle:
    """Picklable end of a ``vllm`` transport: the sender's store and the backend the engines are built with."""

    host: str
    port: int
    world_size: int
    backend: str
    timeout_s: float
    model_id: str = "policy"

    @property
    def engine_options(self) -> dict[str, Any]:
        """``vllm.LLM`` keyword arguments the receiving engine must be built with."""
        return {"weight_transfer_config": {"backend": self.backend}}

    def attach(self, rank: int = 1, model: Any = None) -> VLLMTransferReceiver:
        if not 1 <= rank < self.world_size:
            raise WeightSyncError(f"receiver rank must be in 1..{self.world_size - 1}, got {rank}")
        return VLLMTransferReceiver(self, rank, model)


class VLLMTransferSender:
    """Trainer end: ``publish`` runs one round of vLLM's weight transfer to every receiver's engine."""

    def __init__(
        self, config: Any, *, model_id: str = "policy", run_id: str = "run", host: str = "127.0.0.1",
        world_size: int = 2, device_type: str | None = None, **_: Any,
    ) -> None:  # fmt: skip
        import torch.distributed as dist

        if world_size < 2:
            raise WeightSyncError(f"vllm transport needs world_size >= 2 (sender + receivers), got {world_size}")
        self.backend = resolve_backend(config.vllm_backend, device_type)
        check_backend(self.backend)  # before any worker starts
        self.model_id, self.run_id, self.host, self.world = model_id, run_id, host, world_size
        self.timeout = float(config.timeout_s)
        self.store = dist.TCPStore(host, 0, world_size=world_size, is_master=True, timeout=td(self.timeout),
                                   wait_for_workers=False)  # fmt: skip
        self.client = StoreClient(self.store, world_size - 1, self.timeout)
        self.engine: Any = None
        self.source: Any = None
        self._aliases: dict[str, str] = {}
        self._latest: int | None = None

    def receiver_handle(self) -> VLLMTransferHandle:
        return VLLMTransferHandle(self.host, self.store.port, self.world, self.backend, self.timeout, self.model_id)

    def _connect(self) -> None:
        from .vllm_backends import PairsSource, trainer_engine

        self.source = PairsSource()
        port = _free_port(self.host)
        self.engine = trainer_engine(self.backend, host=self.host, port=port, world_size=self.world,
                                     timeout_s=self.timeout, client=self.client, source=self.source)  # fmt: skip
        for rank in range(1, self.world):  # the names each receiver's model serves under an alias
            self._aliases.update(json.loads(self.store.get(f"aliases/{rank}")))
        LOG.info("weight sync 'vllm': %s group of %d formed (trainer + %d engines)", self.backend, self.world,
                 self.world - 1)  # fmt: skip

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        check_newer(self.model_id, version, self._latest)
        start = time.perf_counter()
        if self.engine is None:
            try:
                self._connect()
            except (RuntimeError, ValueError) as exc:  # the backend's rendezvous: a receiver missing or refusing
                raise StageTimeoutError(
                    f"weight_sync 'vllm': the {self.backend} weight-transfer group of {self.world} (trainer + "
                    f"{self.world - 1} engines) did not form within {self.timeout:.0f} s ({type(exc).__name__}: {exc})"
                ) from None
        pairs = [(n, t.detach()) for n, t in named_tensors]
        have = {n: t for n, t in pairs}
        pairs += [(alias, have[src]) for alias, src in self._aliases.items() if src in have and alias not in have]
        self.source.pairs = pairs
        self.client.version = int(version)
        try:
            self.engine.send_weights()
        except RuntimeError as exc:  # a peer died or did not answer inside the backend's broadcast
            raise WeightSyncError(f"weight_sync 'vllm': version {version} not applied ({exc})") from None
        finally:
            self.client.round += 1
            self.source.pairs = []
        self._latest = int(version)
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        return PublishReport(self.model_id, int(version), nbytes, time.perf_counter() - start, len(pairs))

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()


class VLLMTransferReceiver:
    """Worker end, bound to the worker's vLLM engine (:meth:`bind_engine`): ``poll`` / ``switch`` / ``version``
    like :class:`~mrl_plugins.weight_sync.receiver.DoubleBufferedReceiver`, the weights applied into the engine."""

    #: the worker applies nothing itself: the round loads the engine's weights
    into_engine = True

    def __init__(self, handle: VLLMTransferHandle, rank: int, model: Any = None) -> None:
        import torch.distributed as dist

        self.h, self.rank, self.model_id = handle, rank, handle.model_id
        self.timeout = float(handle.timeout_s)
        self.store = dist.TCPStore(handle.host, handle.port, world_size=handle.world_size, is_master=False,
                                   timeout=td(self.timeout))  # fmt: skip
        self.store.set(f"aliases/{rank}", json.dumps(_aliases(model) if model is not None else {}))
        self.engine: Any = None
        self.version = -1
        self._inited = False
        self._round = 0
        self._next: dict | None = None

    def bind_engine(self, engine: Any) -> None:
        """The vLLM engine the rounds load into (built with :attr:`VLLMTransferHandle.engine_options`)."""
        filters = engine.params.filters() if hasattr(engine, "params") else []
        if filters:
            raise ConfigError(
                f"weight_sync.transport 'vllm' loads the weights into vLLM only, and sampling with "
                f"{', '.join(filters)} scores completions with the worker's own copy of the model; turn off "
                f"{', '.join(filters)} or use weight_sync.transport: shm"
            )
        self.engine = engine

    def _join(self) -> None:
        info = json.loads(self.store.get("init"))
        info["rank_offset"] = self.rank  # one engine per worker (tensor parallel 1): group rank = worker + 1
        self.engine.llm.init_weight_transfer_engine({"init_info": info})
        self._inited = True
        self.store.add("init_done", 1)

    def poll(self, timeout: float | None = None) -> int | None:
        """The next announced version (the round then waits for :meth:`switch`), else None; joins the group first
        when the trainer has opened it."""
        if self.engine is None:
            raise WeightSyncError("vllm transport: bind_engine() before poll()")
        if not self._inited:
            if not self.store.check(["init"]):
                return None
            self._join()
        key = f"round/{self._round}"
        if self._next is None and self.store.check([key]):
            self._next = json.loads(self.store.get(key))
        return None if self._next is None else int(self._next["version"])

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        """Run the announced round on the engine (its broadcast with the trainer), stamped with its version."""
        if self._next is None:
            return None
        msg, self._next = self._next, None
        t0 = time.perf_counter()
        llm = self.engine.llm
        llm.start_weight_update()
        llm.update_weights({"update_info": msg["update_info"]})
        llm.finish_weight_update(weight_version=str(msg["version"]))
        seconds = time.perf_counter() - t0
        self.store.add(f"round_done/{self._round}", 1)
        self._round += 1
        rep = SwitchReport(self.model_id, self.version, int(msg["version"]), 0, seconds)
        self.version = int(msg["version"])
        self.engine.last_apply_ms = seconds * 1e3
        LOG.info("switch model_id=%s %d -> %d seconds=%.4f (vLLM weight transfer, %s)", self.model_id,
                 rep.from_version, rep.to_version, seconds, self.h.backend)  # fmt: skip
        return rep

    @contextlib.contextmanager
    def active(self, timeout: float | None = None) -> Iterator[Any]:
        yield self.engine

    def stats(self) -> dict[str, float]:
        return {"version": self.version}

    def close(self) -> None:
        self.engine = None


def _aliases(model: Any) -> dict[str, str]:
    """``{alias: name}`` for state-dict entries that share a parameter (a tied ``lm_head.weight``)."""
    by_ptr = {p.data_ptr(): n for n, p in model.named_parameters()}
    return {n: by_ptr[t.data_ptr()] for n, t in model.state_dict().items()
            if t.data_ptr() in by_ptr and by_ptr[t.data_ptr()] != n}  # fmt: skip


__all__ = [
    "AUTO_BACKENDS",
    "StoreClient",
    "VLLMTransferHandle",
    "VLLMTransferReceiver",
    "VLLMTransferSender",
    "check_backend",
    "resolve_backend",
]
