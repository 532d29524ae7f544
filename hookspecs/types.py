"""Small value types that cross the hook boundary: registration objects (conda's plugin style, collected by the
manager as :mod:`mrl_plugins.hookspecs.spec` describes), results and the per-run context.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

_NAME_RE = re.compile(r"[a-z0-9][a-z0-9_-]*")

#: The three stages of an RL loop that plugins can replace.
STAGES: tuple[str, ...] = ("rollout", "weight_sync", "comm")


@dataclass(frozen=True)
class Capabilities:
    """What a stage's ends can do; the defaults are the conservative answer.

    :param rejoinable: an end opened after the first transfer (a restarted or moved worker) joins the stream.
    :param cross_host: the two ends may run on different hosts (``rollout.remote_workers``).
    :param zero_copy: received batch fields are views into the transport's memory, valid until
        :meth:`Experience.release` (the caller copies what it keeps).
    :param collective: a publish needs every receiver to take part while it runs (a process group):
        workers are told before the publish, not after, and a dead worker cannot be replaced.
    :param in_process: the ends live in one process (no handle crosses a process boundary).
    """

    rejoinable: bool = False
    cross_host: bool = False
    zero_copy: bool = False
    collective: bool = False
    in_process: bool = False


@dataclass(frozen=True)
class _Registration:
    """A named factory. ``name`` is what a config selects; ``factory`` builds the backend."""

    name: str
    factory: Callable[..., Any]
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or _NAME_RE.fullmatch(self.name) is None:
            raise ValueError(
                f"registration name must be lowercase ASCII letters, digits, '_' or '-' (starting with a letter "
                f"or digit), got {self.name!r}"
            )
        if not callable(self.factory):
            raise TypeError(f"registration {self.name!r}: factory must be callable, got {type(self.factory).__name__}")


@dataclass(frozen=True)
class RolloutEngine(_Registration):
    """A generation backend (``transformers``, ``vllm``, ...).

    ``factory(model, tokenizer, *, params: SamplingParams, device="cpu", seed=None)`` returns an object with
    ``generate(prompts, num_generations) -> EngineOutput`` (completion ids and per-token sampling logprobs).

    What the engine can do is declared here and read by the stage, never inferred from its name; the defaults are
    the conservative answer.

    :param options: it takes ``rollout.engine_options`` (keyword arguments for the engine it builds).
    :param scores: its workers can also score completions with a second model (``rollout.ref_logps: engine``).
    :param fork_safe: a one-thread CPU worker of it may be forked from the trainer (inheriting its imports) where
        nothing in the trainer process forbids it; otherwise workers are spawned.
    :param warmup: the trainer's own model (the ``transformers`` loop) may answer while its workers start
        (``rollout.local_warmup: auto``): only where that stands in for the engine without a long build of its own.
    :param own_weights: its engine keeps its own copy of the weights (vLLM): after each switch to a new version the
        stage calls ``engine.apply_weights(version=...)`` (which sets ``engine.last_apply_ms``), and the engine sizes
        its own memory, so a worker does not cap its allocator at the first generation's peak.
    :param start_s: seconds a worker with this engine may need to start (its build), when longer than
        1.5 x ``timeout_s``.
    :param requires: ``requires()`` raises a ConfigError saying how to install what the engine imports; cheap
        (nothing imported), called before a run builds anything.
    :param check: ``check(model_config, device_type, architecture)`` raises a ConfigError when the engine cannot
        serve that model on that device; may import the engine's package, called by ``enable()`` before anything
        is changed.
    """

    options: bool = False
    scores: bool = False
    fork_safe: bool = False
    warmup: bool = False
    own_weights: bool = False
    start_s: float = 0.0
    requires: Callable[[], None] | None = None
    check: Callable[[Any, str, str | None], None] | None = None


@dataclass(frozen=True)
class WeightTransport(_Registration):
    """A weight transport of the built-in weight-sync stage (``broadcast``, ``shm``, ``directory``, ...).

    ``factory(config: WeightSyncConfig, *, model_id, run_id, world_size=receivers + 1)`` returns a sender with
    ``publish(version, named_tensors)`` and ``receiver_handle()`` (picklable; ``.attach()`` on the inference side,
    ``.attach(rank=rank + 1)`` for a ``collective`` one). ``capabilities`` is what its ends can do (the stage
    sets it on the ends it opens).
    """

    capabilities: Capabilities = field(default_factory=Capabilities)


@dataclass(frozen=True)
class CommTransport(_Registration):
    """An experience transport of the built-in comm stage (``shm``, ``queue``, ``torch_distributed``, ...).

    ``factory(config: CommConfig, *, n_producers, run_id, codec)`` returns the consumer (trainer side) with
    ``receive(timeout)`` and ``producer_handle(i)`` (picklable; ``.attach(codec=...)`` in the rollout worker).
    ``codec`` is the field codec the stage built from the ``comm.codec`` registration, on each side.
    """

    capabilities: Capabilities = field(default_factory=Capabilities)


@dataclass(frozen=True)
class CommCodec(_Registration):
    """An experience codec (``raw``, ``fp16``, ...). ``factory(config: CommConfig)`` returns a field codec
    (:class:`mrl_plugins.comm.codec.Codec` or a subclass: ``choose(name, tensor, array)`` per field)."""


@dataclass(frozen=True)
class StagePlugin(_Registration):
    """An implementation of one whole stage, selected as ``plugins.<stage>: <name>`` (``mrl``, ``upstream`` or a
    third party's). ``factory()`` returns the stage object: a :class:`~mrl_plugins.hookspecs.channels.RolloutStage`,
    :class:`~mrl_plugins.hookspecs.channels.WeightSyncStage` or :class:`~mrl_plugins.hookspecs.channels.CommStage`
    (which one follows from the hook that registers it); the manager builds it once, when it is selected."""


#: registration hook -> (stage, registration class, what it is called in errors, the config key that selects one)
REGISTRATION_HOOKS: dict[str, tuple[str, type[_Registration], str, str]] = {
    "mrl_rollout_register_stages": ("rollout", StagePlugin, "rollout plugin", "plugins.rollout"),
    "mrl_weight_sync_register_stages": ("weight_sync", StagePlugin, "weight-sync plugin", "plugins.weight_sync"),
    "mrl_comm_register_stages": ("comm", StagePlugin, "comm plugin", "plugins.comm"),
    "mrl_rollout_register_engines": ("rollout", RolloutEngine, "rollout engine", "rollout.engine"),
    "mrl_weight_sync_register_transports": (
        "weight_sync",
        WeightTransport,
        "weight-sync transport",
        "weight_sync.transport",
    ),
    "mrl_comm_register_transports": ("comm", CommTransport, "comm transport", "comm.transport"),
    "mrl_comm_register_codecs": ("comm", CommCodec, "comm codec", "comm.codec"),
}

#: stage -> the registration hook of its whole-stage implementations
STAGE_HOOKS: dict[str, str] = {stage: f"mrl_{stage}_register_stages" for stage in STAGES}


@dataclass
class RolloutResult:
    """What the rollout stage returns for one batch of prompts.

    ``prompt_ids``/``completion_ids``/``logprobs`` have one entry per generated sequence
    (``len(prompts) * num_generations``, prompts repeated in order); ``logprobs[i][t]`` is the
    sampling log-probability of ``completion_ids[i][t]``. ``weight_version`` is the version of the
    weights that produced every sequence of this result. ``scores[m][i][t]``: the log-probability of
    ``completion_ids[i][t]`` under another model ``m`` (e.g. ``"ref"``, the reference model), where the
    rollout scored its completions with one (temperature-scaled like the trainer's; empty otherwise).
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    weight_version: int
    model_id: str = "policy"
    metrics: dict[str, float] = field(default_factory=dict)
    scores: dict[str, list[list[float]]] = field(default_factory=dict)


@dataclass
class PublishReport:
    """What publishing one weight version did: bytes moved, seconds spent, shard count."""

    model_id: str
    version: int
    nbytes: int
    seconds: float
    shards: int = 1


@dataclass
class SwitchReport:
    """One staging -> active switch (one version-log line)."""

    model_id: str
    from_version: int
    to_version: int
    nbytes: int
    seconds: float


@dataclass
class StageContext:
    """Per-run state handed to every stage method (``open_*``, ``capabilities``) and to ``mrl_shutdown``.

    ``config`` is the validated :class:`mrl_plugins.config.MrlConfig`; ``host`` is the trainer
    (or ``None`` outside a trainer); ``metrics`` collects ``mrl/<stage>/...`` numbers that the
    adapter forwards to TRL's logs (the built-in ``mrl`` rollout stage needs it: it counts as it serves);
    ``plugins`` is the process's :class:`~mrl_plugins.manager.MrlPluginManager`
    (set by the manager on the first stage call): a stage opens the other stages' ends through it
    (``ctx.plugins.weight_sync_open_sender(...)``) and finds registrations there (``ctx.plugins.backend(...)``);
    ``resources`` is where a plugin keeps what it built for itself, under its own name, so that
    ``mrl_shutdown`` can release it (never another stage's objects: those are handed over explicitly).
    """

    config: Any
    host: Any = None
    metrics: Any = None
    resources: dict[str, Any] = field(default_factory=dict)
    plugins: Any = None
