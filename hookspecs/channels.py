"""The stages and the typed ends each builds (after veRL's ``checkpoint_engine/base.py``: one small interface per
role, its lifecycle and its capabilities stated).

A stage is an object registered as a :class:`~mrl_plugins.hookspecs.types.StagePlugin` and selected by name
(``plugins.<stage>``): a :class:`RolloutStage`, :class:`WeightSyncStage` or :class:`CommStage`. Each opens its
ends (which side opens what: each stage's docstring and the table in docs/plugins.md).

Callers reach them through the process's plugin manager (``ctx.plugins.comm_open_consumer(...)``), which checks
each answer against its protocol: ``None`` or an object lacking a member is one PluginError naming the method and
the plugin. Methods are called with keyword arguments.

A weight version travels ``RolloutRuntime.publish -> WeightSender.publish -> (transport) ->
WeightReceiver.poll (staging) -> WeightReceiver.switch (active)``; a batch travels
``ExperienceProducer.send -> (transport) -> ExperienceConsumer.receive -> Experience``. A *handle*
(``receiver_handle()``, ``producer_handle(i)``) is the small picklable object that crosses to the worker
process, where the other end is opened from it.

Callers decide by :class:`Capabilities`, never by a backend's name: the rollout stage asks
``sender.capabilities.rejoinable`` before restarting a worker, ``cross_host`` before accepting workers
on other hosts, ``collective`` for the order of a publish and its notices.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from mrl_plugins.errors import PluginError, choices
from mrl_plugins.hookspecs.types import Capabilities

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from mrl_plugins.hookspecs.types import PublishReport, RolloutResult, StageContext, SwitchReport


# --------------------------------------------------------------------------- weight sync


@runtime_checkable
class WeightSender(Protocol):
    """Trainer side of one model's weight stream (``WeightSyncStage.open_sender``).

    Lifecycle: opened once per served model when the rollout stage starts; :meth:`publish` once per
    version (strictly increasing); :meth:`receiver_handle` any number of times (one per worker, also
    for a restarted one when ``capabilities.rejoinable``); :meth:`close` once (idempotent, releases
    shared memory / groups / files).
    """

    capabilities: Capabilities

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport:
        """Send ``version``; ``named_tensors`` is streamed (hold one bucket at most: ZeRO-3 gathers lazily)."""
        ...

    def receiver_handle(self) -> Any:
        """A picklable handle a receiver is opened from (``WeightSyncStage.open_receiver``)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class WeightReceiver(Protocol):
    """Inference side of one model's weight stream (``WeightSyncStage.open_receiver``).

    Lifecycle: opened once per served model in each worker (and for the in-process inference copy);
    :meth:`poll` between requests fetches a newer version into staging, :meth:`switch` makes it active
    once the requests inside :meth:`active` drained; :meth:`close` once. ``version`` is the active
    version (-1 before the first switch).
    """

    capabilities: Capabilities
    version: int

    def poll(self, timeout: float) -> int | None:
        """Stage the newest published version if it is newer; return it, or ``None`` when nothing is new."""
        ...

    def switch(self, timeout: float | None = None) -> SwitchReport | None:
        """Make the staged version active (``None``: nothing staged)."""
        ...

    def active(self) -> AbstractContextManager[Any]:
        """Context for one request: the active weights cannot switch under it."""
        ...

    def stats(self) -> Mapping[str, float]: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- comm


@runtime_checkable
class Experience(Protocol):
    """One received batch: ``meta`` (``model_id``, ``version``, ``seq`` ...) and ``batch`` (field -> tensor).

    With ``capabilities.zero_copy`` the fields that alias the transport's buffer are views (a tensor with
    ``_base`` set, a numpy array with ``base``); fields the consumer built itself (e.g. fp16 -> fp32 casts) are
    plain. Callers copy exactly the views out (:func:`mrl_plugins.comm.base.owned`: one copy at most), then
    :meth:`release` (idempotent; also for transports that copy, so callers need not know).
    """

    meta: Mapping[str, Any]
    batch: Mapping[str, Any]

    def release(self) -> None: ...


@runtime_checkable
class ExperienceConsumer(Protocol):
    """Trainer side of the experience path (``CommStage.open_consumer``): N producers -> 1 consumer.

    Lifecycle: opened once when the rollout stage starts, for a fixed number of producers;
    :meth:`producer_handle` once per producer index (again for a restarted worker when
    ``capabilities.rejoinable``); :meth:`receive` as often as the trainer needs a batch; :meth:`close` once.
    """

    capabilities: Capabilities

    def producer_handle(self, index: int) -> Any:
        """A picklable handle producer ``index`` is opened from (``CommStage.open_producer``)."""
        ...

    def receive(self, timeout: float | None = None) -> Experience:
        """The next batch from any producer; ``TimeoutError`` after ``timeout`` s, sooner for a dead producer.

        Raises :class:`mrl_plugins.comm.base.ChannelClosedError` when every producer closed its end."""
        ...

    def stats(self) -> Mapping[str, float]: ...

    def close(self) -> None: ...


@runtime_checkable
class ExperienceProducer(Protocol):
    """Rollout side of the experience path (``CommStage.open_producer``), one per worker.

    Lifecycle: opened once per worker process from its handle; :meth:`send` once per generated batch
    (blocks at most ``timeout`` s when the consumer is behind: backpressure); :meth:`close` once.
    """

    capabilities: Capabilities

    def send(self, batch: Mapping[str, Any], meta: Mapping[str, Any], timeout: float | None = None) -> int:
        """Put one batch on the transport; returns the bytes sent."""
        ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- rollout


@runtime_checkable
class RolloutRuntime(Protocol):
    """Trainer side of the rollout stage (``RolloutStage.open_runtime``): what the host calls where it generates.

    Lifecycle: opened at ``enable()``; may start processes lazily (optional ``start()``/``release()``,
    called when ``train()`` begins and ends); :meth:`publish` at the host's weight-sync points,
    :meth:`generate` once per generation batch; :meth:`close` once. ``replaces_host = False`` (the
    ``upstream`` runtime) tells the adapter to leave the host's own generation in place.
    """

    replaces_host: bool

    def generate(self, prompts: list[list[int]], num_generations: int, model_id: str) -> RolloutResult:
        """``num_generations`` completions per prompt with per-token sampling logprobs and their weight version."""
        ...

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> PublishReport | None:
        """Hand the trainer's weights to the inference side as ``version`` (``None``: nothing to sync)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class RolloutHost(Protocol):
    """What the rollout stage may ask of its host (the trainer side of the adapter; for TRL
    :class:`mrl_plugins.adapters.trl_generation.MrlGeneration`). The stage never reads the trainer itself.

    ``version`` is the weight version the host last published; :meth:`sync_weights` publishes the trainer's
    current weights (through the runtime's ``publish``) when the stage needs a newer version before it can
    generate ahead; ``model`` is the policy being trained (unwrapped); :meth:`generation_interval` is how many
    optimizer steps pass between two of the host's generations; :meth:`next_prompts` returns the prompt ids of
    the batch after ``current`` (or None when the host cannot tell) and is asked only while ``lookahead`` holds;
    :meth:`steps_left` is how many optimizer steps the run has left (None when unbounded or unknown).
    """

    version: int
    lookahead: bool

    @property
    def model(self) -> Any: ...

    def sync_weights(self) -> None: ...

    def generation_interval(self) -> int: ...

    def next_prompts(self, current: list[list[int]]) -> list[list[int]] | None: ...

    def steps_left(self) -> int | None: ...


@dataclass
class RolloutSetup:
    """What the host hands the rollout stage (``RolloutStage.open_runtime``).

    :param host: the trainer.
    :param model: the policy to serve (unwrapped from DDP/accelerate).
    :param sampling: the host's sampling settings (:class:`mrl_plugins.rollout.engine.SamplingParams`).
    :param seed: the run's seed.
    :param device: the device the trainer runs on (:mod:`mrl_plugins.device`).
    :param placements: ``(worker placements, trainer cores, shared placement)`` from the adapter's
        placement plan, or ``None`` for no worker processes (``rollout.workers: 0``).
    :param generation: the host as the stage may ask it (:class:`RolloutHost`).
    :param score_models: further models every worker holds to score completions (``{"ref": ref_model}``).
    :param processes: the host's training processes (ranks); each opens its own runtime.
    """

    host: Any
    model: Any
    sampling: Any
    seed: int = 0
    device: Any = None
    placements: Any = None
    generation: Any = None
    score_models: dict[str, Any] = field(default_factory=dict)
    processes: int = 1


# --------------------------------------------------------------------------- the stages


@runtime_checkable
class RolloutStage(Protocol):
    """The rollout stage (``plugins.rollout``).

    :meth:`open_runtime` is called once by the adapter at ``enable()``: ``ctx.host`` is the trainer, ``setup`` the
    policy, sampling settings, seed, device and placement plan (:class:`RolloutSetup`). The runtime it returns
    opens the other stages' ends through the manager (``ctx.plugins.weight_sync_open_sender(...)``,
    ``ctx.plugins.comm_open_consumer(...)`` on this side; its workers open the receivers and producers with their
    own manager) and owns them until ``close()``. Its ``generate`` is called once per generation batch, its
    ``publish`` at the host's weight-sync points.
    """

    def open_runtime(self, ctx: StageContext, setup: RolloutSetup) -> RolloutRuntime: ...


@runtime_checkable
class WeightSyncStage(Protocol):
    """The weight-sync stage (``plugins.weight_sync``): one weight stream per served model.

    * :meth:`capabilities` -- what the ends it would open under ``ctx.config`` can do, asked at ``enable()``
      before anything is opened (workers on other hosts need ``cross_host``, moved ones ``rejoinable``);
    * :meth:`open_sender` -- trainer side, once per served model when the rollout stage starts: ``run_id`` is
      unique per start (name shared memory, files, groups after it); ``receivers`` is how many processes open a
      receiver from ``receiver_handle()`` (a collective transport sizes its group from it); ``same_process``: the
      receiver is an inference copy in this process;
    * :meth:`open_receiver` -- inference side, once per served model in each worker (and for an in-process
      copy), loading into ``model`` from the sender's ``handle``; ``rank`` is this receiver's index among the
      sender's ``receivers``. Names published go through ``mrl_weight_sync_map_name``
      (``ctx.plugins.weight_sync_name_map(model_id)``).

    The caller owns and closes the ends.
    """

    def capabilities(self, ctx: StageContext) -> Capabilities: ...

    def open_sender(
        self, ctx: StageContext, model_id: str, run_id: str, receivers: int, same_process: bool
    ) -> WeightSender: ...

    def open_receiver(
        self, ctx: StageContext, model: torch.nn.Module, handle: Any, model_id: str, rank: int
    ) -> WeightReceiver: ...


@runtime_checkable
class CommStage(Protocol):
    """The communication stage (``plugins.comm``): experience from N rollout workers to the trainer.

    * :meth:`capabilities` -- what its ends can do, asked at ``enable()`` before anything is opened;
    * :meth:`open_consumer` -- trainer side, once when the rollout stage starts its workers, for ``producers``
      producers, each opened from ``producer_handle(i)``;
    * :meth:`open_producer` -- in each rollout worker at start, from the consumer's ``handle`` for ``index``.

    The caller owns and closes the ends.
    """

    def capabilities(self, ctx: StageContext) -> Capabilities: ...

    def open_consumer(self, ctx: StageContext, run_id: str, producers: int) -> ExperienceConsumer: ...

    def open_producer(self, ctx: StageContext, handle: Any, index: int) -> ExperienceProducer: ...


#: stage -> the protocol its selected plugin's object satisfies
STAGE_PROTOCOLS: dict[str, type] = {"rollout": RolloutStage, "weight_sync": WeightSyncStage, "comm": CommStage}


def check_end(obj: Any, protocol: type, what: str, who: str) -> Any:
    """``obj`` if it satisfies ``protocol`` (methods and attributes present), else a PluginError naming ``who``
    (the plugin) and ``what`` returned it."""
    if not isinstance(obj, protocol):
        missing = [n for n in _protocol_attrs(protocol) if not hasattr(obj, n)]
        raise PluginError(
            f"{who}: {what} returned a {type(obj).__name__}, which is not a {protocol.__name__} "
            f"(missing: {', '.join(sorted(missing)) or '?'}; see mrl_plugins.hookspecs.channels)"
        )
    return obj


def check_stage(obj: Any, protocol: type, who: str) -> Any:
    """``obj`` if it has every method of the stage ``protocol``, each taking the protocol's keyword arguments; else one
    PluginError naming ``who`` and the methods (checked when a stage is selected, not at its first call in a run)."""
    methods = [n for n in _protocol_attrs(protocol) if callable(getattr(protocol, n, None))]
    lacking = [m for m in methods if not callable(getattr(obj, m, None))]
    if lacking:
        raise PluginError(
            f"{who} does not implement {choices(lacking)}; its object is a {protocol.__name__} "
            f"(see mrl_plugins.hookspecs.channels)"
        )
    for method in methods:
        wanted = [p for p in inspect.signature(getattr(protocol, method)).parameters if p != "self"]
        try:
            inspect.signature(getattr(obj, method)).bind(**dict.fromkeys(wanted))
        except TypeError as exc:
            raise PluginError(
                f"{who}: {method} cannot be called as {method}({', '.join(wanted)}) ({exc}); see "
                f"{protocol.__name__} in mrl_plugins.hookspecs.channels"
            ) from exc
        except ValueError:  # no signature (a builtin): called as it is
            pass
    return obj


def _protocol_attrs(protocol: type) -> list[str]:
    names = set()
    for base in protocol.__mro__:
        if base in (Protocol, object) or base.__name__ == "Generic":
            continue
        names |= {n for n in vars(base) if not n.startswith("_")}
        names |= set(getattr(base, "__annotations__", {}))
    return sorted(names)
