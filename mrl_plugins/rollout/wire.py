"""The rollout pool's wire protocol: every message between the trainer's pool and a rollout worker.

Trainer -> worker messages travel on the worker's request queue (``multiprocessing`` queue, or the rendezvous
store's :class:`~mrl_plugins.rollout.remote.StoreQueue` for a remote worker; pickled either way); worker -> trainer
ones on its event queue (:class:`WorkerEvent`) and error queue (:class:`WorkerError`). The experience batch itself
travels through the comm stage, tagged with a :class:`BatchMeta` as its ``meta`` mapping (a frame carries plain
values).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerateRequest:
    """One chunk of ticket ``req_id`` for one worker."""

    req_id: int
    chunk: int
    prompts: list[list[int]]
    num_generations: int
    model_id: str = "policy"
    min_version: int = -1  # generate with this version of the weights or a newer one
    score_with: tuple[str, ...] = ()  # other served models that score every completion (reference logprobs)


@dataclass(frozen=True)
class WeightsNotice:
    """Version ``version`` of ``model_id`` is (being) published."""

    model_id: str
    version: int


@dataclass(frozen=True)
class StopRequest:
    """Leave the worker loop (the worker closes its ends and exits)."""


STOP = StopRequest()

#: :class:`WorkerEvent` kinds
SWITCHED, BUDGET, MEMORY = "switched", "budget", "memory"


@dataclass(frozen=True)
class WorkerEvent:
    """What worker ``worker`` did: ``switched`` to ``value`` (a version) of ``model_id``; applied a compute
    ``budget`` at start (``value``: ``AppliedBudget.as_dict()`` + pid); reserved ``memory`` at its first batch
    (``value``: peak bytes and the fraction)."""

    kind: str
    worker: int
    value: Any
    model_id: str = ""


@dataclass(frozen=True)
class WorkerError:
    """Why worker ``worker`` stopped (the exception and its traceback)."""

    worker: int
    text: str


@dataclass(frozen=True)
class BatchMeta:
    """The tags of one experience batch (one answered chunk)."""

    seq: int  # the ticket (request id)
    chunk: int
    worker: int
    model_id: str
    version: int  # the weights that generated it
    gen_us: int = 0
    apply_us: int = 0  # the worker's last weight apply (vLLM reload), 0: none
    extra: dict[str, Any] = field(default_factory=dict)

    def to_meta(self) -> dict[str, Any]:
        out = asdict(self)
        return {**out.pop("extra"), **out}

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any]) -> BatchMeta:
        known = {"seq", "chunk", "worker", "model_id", "version", "gen_us", "apply_us"}
        return cls(
            seq=int(meta["seq"]),
            chunk=int(meta["chunk"]),
            worker=int(meta.get("worker", -1)),
            model_id=str(meta.get("model_id", "policy")),
            version=int(meta["version"]),
            gen_us=int(meta.get("gen_us", 0)),
            apply_us=int(meta.get("apply_us", 0)),
            extra={k: v for k, v in meta.items() if k not in known},
        )
