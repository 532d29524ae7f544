"""Run configuration: typed dataclasses loaded from YAML, a dict or the environment.

Every field carries ``metadata["help"]``; unknown keys and bad values raise
:class:`~mrl_plugins.errors.ConfigError` naming the key and the valid choices, before anything is
applied. Stage sections come from the stage packages (``mrl_plugins.comm.config`` ...).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from mrl_plugins.config_fields import (
    TOP,
    _check_internal,
    _check_removed,
    _nested,
    check_fields,
    internal,
    section_from_dict,
)
from mrl_plugins.demo import tool_task
from mrl_plugins.demo.models import PRESETS, TOOL_PRESETS
from mrl_plugins.device.select import canonical_device_spec
from mrl_plugins.errors import ConfigError, choices

MODES = ("colocate", "disaggregated", "hybrid")
TRAINERS = ("grpo", "rloo")
#: the embedded job's tasks (``train.task``): the count task of the ``tiny``/``small`` presets, and the tool task
#: (:mod:`mrl_plugins.demo.tool_task`, preset ``tiny-tools``) with ``tools=``, one environment factory or a dict of two
TASKS = ("count", *tool_task.TASKS)


def _set_in_code(obj: Any) -> dict[str, Any]:
    """A section object built in code as the mapping it stands for: every field but the derived ones it was not
    given (``_derivable``: :func:`~mrl_plugins.config_fields.fill_derived`), which loading derives like the unset keys
    of a mapping."""
    derivable = getattr(obj, "_derivable", frozenset())
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name not in derivable}


@dataclass
class PluginsConfig:
    """Which plugin runs each stage."""

    rollout: str = field(
        default="mrl", metadata={"help": "plugin for rollout: 'mrl', 'upstream' (TRL's own) or a third-party name"}
    )
    weight_sync: str = field(
        default="mrl", metadata={"help": "plugin for weight sync: 'mrl', 'upstream' or a third-party name"}
    )
    comm: str = field(
        default="mrl", metadata={"help": "plugin for experience transfer: 'mrl', 'upstream' or a third-party name"}
    )

    def as_dict(self) -> dict[str, str]:
        return dataclasses.asdict(self)


@dataclass
class TrainConfig:
    """The GRPO/RLOO run that ``mrl run`` and ``mrl compare`` launch (ignored by ``mrl_plugins.enable``)."""

    trainer: str = field(default="grpo", metadata={"help": "TRL trainer", "choices": TRAINERS})
    model: str = field(
        default="small", metadata={"help": f"preset ({choices(PRESETS)}) or a local HF checkpoint folder"}
    )
    task: str = field(
        default="count",
        metadata={
            "help": f"'count' (presets {choices(p for p in PRESETS if p not in TOOL_PRESETS)}), or the calculator "
            f"task of preset {choices(TOOL_PRESETS)} (grpo only): 'tools' (tools=[add, subtract]), 'environment' "
            "(environment_factory=CalculatorEnv) or 'environments' (a dict of two: AddEnv, SubtractEnv)",
            "choices": TASKS,
        },
    )
    steps: int = field(default=30, metadata={"help": "optimizer steps (max_steps)", "ge": 1})
    seed: int = field(default=0, metadata={"help": "random seed (same for every compared run)"})
    learning_rate: float = field(default=3e-3, metadata={"help": "learning rate"})
    num_prompts: int = field(default=512, metadata={"help": "size of the generated prompt dataset", "ge": 1})
    threads: int = field(
        default=0,
        metadata={
            "help": "torch threads of the trainer process; 0 = all cores of the budget (with rollout workers on a CPU "
            "the placement sets them: only 0 is accepted there)",
            "ge": 0,
        },
    )
    device: str = field(
        default="auto",
        metadata={
            "help": "where the run trains: 'auto' (NPU, else CUDA, else CPU), 'cpu', 'cuda[:N]' or 'npu[:N]'; "
            "enable() takes the device the trainer is on"
        },
    )
    output_dir: str = field(default="mrl-out", metadata={"help": "TRL output_dir"})
    logging_steps: int = field(default=1, metadata={"help": "TRL logging_steps", "ge": 1})
    trl_args: dict = field(
        default_factory=dict,
        metadata={
            "help": "extra GRPOConfig/RLOOConfig keyword arguments (checked against the installed TRL's before a run; "
            "not those train.* sets: max_steps, learning_rate, seed, output_dir, logging_steps)"
        },
    )

    #: GRPOConfig/RLOOConfig arguments a train.* key sets
    OWNED_TRL_ARGS = {
        "max_steps": "steps",
        "learning_rate": "learning_rate",
        "seed": "seed",
        "output_dir": "output_dir",
        "logging_steps": "logging_steps",
    }

    def validate(self) -> None:
        """The fields' rules, the task's trainer, ``trl_args`` not setting what a ``train`` key sets, and ``device``
        in the one spelling the code compares."""
        check_fields(self, "train")
        if self.task != "count" and self.trainer != "grpo":
            raise ConfigError(
                f"train.task: {self.task!r} needs train.trainer 'grpo' (TRL's RLOOTrainer takes no tools), "
                f"got {self.trainer!r}"
            )
        for arg, key in self.OWNED_TRL_ARGS.items():
            if arg in self.trl_args:
                raise ConfigError(f"train.trl_args: {arg!r} is set by train.{key}; set that instead")
        self.device = canonical_device_spec(self.device, "train.device")


def derive(top: Any, rollout: Any, weight_sync: Any, comm: Any) -> dict[str, dict[str, Any]]:
    """The internal fields that follow from the user's settings, per stage section.

    ``timeout_s`` (T) bounds every wait for another process, a network peer's silence too (its help text); a start
    may take ``1.5 T`` (at least the engine's declared start, set once the engine's registration is known:
    :meth:`~mrl_plugins.rollout.config.RolloutConfig.check_backend`). ``checksums`` switches weights' and
    experience's checksums together (its help text). With remote workers the transports left
    at ``auto`` cross hosts (experience over ``torch_distributed`` on the rendezvous host, weights over
    ``broadcast``, or ``directory`` when ``weight_sync.directory`` is set); otherwise shared memory.
    """
    from mrl_plugins.comm.config import LOCAL_COMM_TRANSPORTS
    from mrl_plugins.rollout.config import parse_address

    t = float(top.timeout_s)
    remote = rollout.remote_workers > 0
    w_transport = weight_sync.transport
    if w_transport == "auto":
        w_transport = ("directory" if weight_sync.directory else "broadcast") if remote else "shm"
    c_transport = comm.transport
    if c_transport == "auto":
        c_transport = "torch_distributed" if remote else "shm"
    return {
        "rollout": {
            "timeout_s": t,
            "start_timeout_s": 1.5 * t,  # at least the engine's own start: RolloutConfig.check_backend
        },
        "weight_sync": {"transport": w_transport, "timeout_s": t, "verify_checksum": bool(top.checksums)},
        "comm": {
            "transport": c_transport,
            "host": parse_address(rollout.rendezvous)[0] if remote else "127.0.0.1",
            "send_timeout_s": t,
            "receive_timeout_s": t,
            "heartbeat_timeout_s": min(t, 5.0) if c_transport in LOCAL_COMM_TRANSPORTS else t,
            "checksum": "xxh3" if top.checksums else "none",
        },
    }


def _stage_classes() -> dict[str, type]:
    from mrl_plugins.comm.config import CommConfig
    from mrl_plugins.rollout.config import RolloutConfig
    from mrl_plugins.weight_sync.config import WeightSyncConfig

    return {"rollout": RolloutConfig, "weight_sync": WeightSyncConfig, "comm": CommConfig}


AUTOLOAD_WHY = (
    "third-party plugins load from the 'mrl_plugins' entry points unless MRL_DISABLE_PLUGIN_AUTOLOAD=1 (mrl plugins: "
    "--no-autoload); block one plugin with disable"
)
DEVICE_WHY = "enable() uses the device the trainer is on; mrl run / mrl compare: train.device"


@dataclass
class MrlConfig:
    """The whole configuration (top level of the YAML file).

    Loading it (:meth:`from_dict`, or building it in code) derives the internal fields of every section from the
    settings (:func:`derive`), whether a section comes as a mapping or as an object (what its code set is kept).
    ``device`` is the device the trainer is on, set by ``enable()`` for the processes it starts ('auto' before)."""

    plugins: PluginsConfig = field(default_factory=PluginsConfig, metadata={"help": "plugin per stage"})
    disable: list[str] = field(default_factory=list, metadata={"help": "plugin names blocked before loading"})
    autoload: bool = internal(AUTOLOAD_WHY, default=True)
    mode: str = field(default="colocate", metadata={"help": "deployment", "choices": MODES})
    device: str | None = internal(DEVICE_WHY, default="auto")
    timeout_s: float = field(
        default=120.0,
        metadata={
            "help": "seconds to wait for another process (a worker's answer, each wait of a weight transfer, a send "
            "or receive of experience, a remote worker's silence) before the run fails naming it; a worker may "
            "take 1.5x as long to start (vLLM at least 300 s), a peer on this host is dead after min(timeout_s, "
            "5) s without a heartbeat",
            "ge": 1,
        },
    )
    checksums: bool = field(
        default=True,
        metadata={
            "help": "checksum weights (crc32c on shared memory and disk, xxh3 on broadcast; a mismatch means no "
            "switch) and experience frames (xxh3; a corrupt frame is dropped and counted). Off, the shared-memory "
            "ring still checks its frames on CPUs that may reorder stores (Arm): there the checksum is what keeps "
            "a frame read too early from being taken whole"
        },
    )
    rollout: Any = field(default=None, metadata={"help": "rollout stage section"})
    weight_sync: Any = field(default=None, metadata={"help": "weight-sync stage section"})
    comm: Any = field(default=None, metadata={"help": "communication stage section"})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": "run settings for mrl run/compare"})
    log_metrics: bool = field(default=True, metadata={"help": "add mrl/<stage>/... keys to TRL's logs"})

    def __post_init__(self) -> None:
        """Parse every section once, then derive: a section's internal fields its settings (a mapping's keys, or
        what code set on an object: :func:`_set_in_code`) leave unset take their values from :func:`derive`,
        whatever form the section came in."""
        self._typed_sections()
        self.validate()  # the top-level values, before anything derives from them
        settings, parsed = {}, {}
        for name, cls in _stage_classes().items():
            given = getattr(self, name)
            if given is not None and not isinstance(given, dict | cls):
                raise ConfigError(f"{name}: expected a {cls.__name__} or a mapping, got {type(given).__name__}")
            settings[name] = _set_in_code(given) if isinstance(given, cls) else dict(given or {})
            if not isinstance(given, cls):
                _check_internal(cls, given, name)
            parsed[name] = section_from_dict(cls, settings[name], name)  # the section's own errors first
        derived = derive(self, parsed["rollout"], parsed["weight_sync"], parsed["comm"])
        for name, section in parsed.items():
            unset = {k: v for k, v in derived[name].items() if settings[name].get(k, "auto") == "auto"}
            derivable = section._derivable | set(unset)  # what a config built again from it derives again
            if unset:
                section = dataclasses.replace(section, **unset)
                section.validate()
            section._derivable = frozenset(derivable)
            setattr(self, name, section)
        self._check_across()

    def _check_across(self) -> None:
        """What a section cannot check alone (it needs the deployment mode)."""
        rc, ws = self.rollout, self.weight_sync
        if rc.rebalance and (self.mode != "hybrid" or rc.workers < 2):
            raise ConfigError(
                f"rollout.rebalance: moves workers between the pools of mode: hybrid with rollout.workers >= 2; "
                f"got mode: {self.mode}, workers: {rc.workers}"
            )
        if rc.colocated_workers and self.mode != "hybrid":
            raise ConfigError(
                f"rollout.colocated_workers: read in mode 'hybrid' only (mode is {self.mode!r}); remove it or set "
                f"mode: hybrid"
            )
        from mrl_plugins.weight_sync.config import KNOWN_TRANSPORTS

        if ws.directory is not None and ws.transport != "directory" and ws.transport in KNOWN_TRANSPORTS:
            raise ConfigError(
                f"weight_sync.directory: read by weight_sync.transport 'directory' only (this run's is "
                f"{ws.transport!r}; 'auto' picks 'directory' with rollout.remote_workers); remove it or set "
                f"weight_sync.transport: directory"
            )

    def _typed_sections(self) -> None:
        """``plugins`` and ``train`` parsed (``MrlConfig(train={...})``) or, objects, checked (as their copies)."""
        for name, cls in (("plugins", PluginsConfig), ("train", TrainConfig)):
            if isinstance(getattr(self, name), dict | cls):
                setattr(self, name, _nested(cls, getattr(self, name), name))

    def validate_all(self) -> None:
        """Validate the top level and every section (for objects built in code, or changed after loading)."""
        self._typed_sections()
        stages = _stage_classes()
        top = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in stages}
        section_from_dict(MrlConfig, top, TOP, validate=False)  # the top level's types (sections by default)
        self.validate()
        for name, cls in stages.items():
            section = getattr(self, name)
            if not isinstance(section, cls):
                raise ConfigError(f"{name}: expected a {cls.__name__} or a mapping, got {type(section).__name__}")
            section.validate()
        self._check_across()

    @classmethod
    def from_dict(cls, data: Any) -> MrlConfig:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{TOP}: expected a mapping at the top level, got {type(data).__name__}")
        _check_removed(data, TOP)
        _check_internal(cls, data, TOP)
        for name in _stage_classes():  # the section's own errors before any derivation
            value = data.get(name)
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{name}: expected a mapping, got {type(value).__name__}")
        return section_from_dict(cls, data, TOP, validate=False)  # __post_init__ validates

    def validate(self) -> None:
        """The top level's own fields (the sections: :meth:`validate_all`)."""
        check_fields(self, TOP)
        if self.device is not None:
            self.device = canonical_device_spec(self.device, "device")


def load_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a YAML file into a dict; malformed YAML is a ConfigError naming the file and line."""
    import yaml

    p = resolve_config_path(path)
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"config {str(p)!r} cannot be read: {exc}") from exc
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{p}:{where} malformed YAML: {getattr(exc, 'problem', exc)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: the top level must be a mapping, got {type(data).__name__}")
    return data


def bundled_configs() -> dict[str, Path]:
    """Names of the YAML files shipped in ``mrl_plugins.configs`` -> their paths."""
    root = resources.files("mrl_plugins.configs")
    return {Path(str(f)).stem: Path(str(f)) for f in root.iterdir() if str(f).endswith(".yaml")}


def resolve_config_path(path: str | os.PathLike[str]) -> Path:
    """A path as given, else ``configs/<name>`` shipped with the package (``colocate`` or ``colocate.yaml``)."""
    p = Path(path)
    if p.is_file():
        return p
    bundled = bundled_configs()
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    if stem in bundled and (p.parent == Path(".") or p.parent.name == "configs"):
        return bundled[stem]
    raise ConfigError(f"config file {str(path)!r} not found; bundled configs: {choices(bundled)}")


def load_config(source: Any = None) -> MrlConfig:
    """Load and validate a config from a path, a dict, an :class:`MrlConfig` or ``None`` (defaults).

    An :class:`MrlConfig` is validated and copied: what a run resolves into its config (the plugin manager reads
    the engine's registration into ``rollout``, ``enable()`` the trainer's device) never changes the caller's."""
    if isinstance(source, MrlConfig):
        loaded = copy.deepcopy(source)
        loaded.validate_all()  # sections given as mappings parsed, device specs canonical: in the copy
        return loaded
    if source is None:
        return MrlConfig.from_dict({})
    if isinstance(source, str | os.PathLike):
        return MrlConfig.from_dict(load_yaml(source))
    if isinstance(source, dict):
        return MrlConfig.from_dict(source)
    raise ConfigError(f"config: expected a YAML path, a dict or an MrlConfig, got {type(source).__name__}")


def apply_env_overrides(config: MrlConfig, env: typing.Mapping[str, str] | None = None) -> MrlConfig:
    """``config`` with ``MRL_DISABLED_PLUGINS=a,b`` and ``MRL_DISABLE_PLUGIN_AUTOLOAD=1`` applied (a new object)."""
    env = os.environ if env is None else env
    disabled = [n.strip() for n in env.get("MRL_DISABLED_PLUGINS", "").split(",") if n.strip()]
    no_autoload = env.get("MRL_DISABLE_PLUGIN_AUTOLOAD", "").strip().lower() in ("1", "true", "yes")
    if not disabled and not no_autoload:
        return config
    out = copy.copy(config)  # the caller's config is never modified; its loaded sections are kept as they are
    out.disable = [*config.disable, *(n for n in dict.fromkeys(disabled) if n not in config.disable)]
    out.autoload = False if no_autoload else config.autoload
    return out


def parse_plugin_selection(value: str, what: str = "--plugins") -> dict[str, str]:
    """``rollout=mrl,comm=upstream`` -> ``{"rollout": "mrl", "comm": "upstream"}``; ConfigError naming ``what``
    otherwise. The one parser of this form (``--plugins``, ``MRL_PLUGINS``); plugin names are checked later by the
    manager, stage names by the ``plugins`` section."""
    from mrl_plugins.hookspecs import STAGES

    plugins: dict[str, str] = {}
    for part in value.split(","):
        stage, sep, name = (x.strip() for x in part.partition("="))
        if not sep or not stage or not name:
            raise ConfigError(
                f"{what}: expected STAGE=PLUGIN[,STAGE=PLUGIN...] with STAGE {choices(STAGES)}, got {part!r}"
            )
        plugins[stage] = name
    return plugins
