"""Configuration of the rollout stage and of the deployment modes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mrl_plugins.config_fields import check_fields, fill_derived
from mrl_plugins.errors import ConfigError, choices
from mrl_plugins.optional import is_ray_available

from .config_sections import SECTIONS, DeploymentSection, EngineSection, SchedulingSection

#: bundle resources the ray launcher sets itself (rollout.ray_resources may not name them)
RAY_OWN_RESOURCES = ("CPU", "GPU", "NPU", "memory", "object_store_memory")


def parse_address(value: str, what: str = "rollout.rendezvous") -> tuple[str, int]:
    """``HOST:PORT`` -> ``(host, port)``; a clear error for anything else (port 0 = pick a free one)."""
    host, sep, port = str(value).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ConfigError(f"{what}: expected HOST:PORT (e.g. 10.0.0.5:29600; port 0 = any free), got {value!r}")
    return host, int(port)


#: the registration hook of rollout engines (``rollout.engine`` names one)
ENGINES = "mrl_rollout_register_engines"


def configured_engine(pm: Any, config: Any) -> Any:
    """The :class:`~mrl_plugins.hookspecs.RolloutEngine` registration of ``config``'s ``rollout.engine``: its
    factory and what it declares it can do."""
    return pm.backend(ENGINES, config.rollout.engine)


@dataclass
class RolloutConfig(SchedulingSection, DeploymentSection, EngineSection):
    """``rollout:`` section.

    Its keys come in three groups (``mrl_plugins.rollout.config_sections``): the engine, the deployment
    (where the workers run) and the scheduling (how generation and training interleave); in YAML they stay flat.
    """

    SECTIONS = SECTIONS

    def __post_init__(self) -> None:
        """Standalone values of the derived fields not given (a loaded config derives them from its settings:
        :func:`mrl_plugins.config.derive`)."""
        fill_derived(
            self,
            {
                "timeout_s": 120.0,
                "start_timeout_s": 180.0,
                "trainer_threads": lambda s: len(s.trainer_cores) if s.trainer_cores else 1,
                "lend_cores": True,
                "pipeline": lambda s: "sync" if s.max_staleness == 0 else "async",  # 0: take turns
                "stale_policy": lambda s: "keep" if s.max_staleness is None else "drop",  # null: keep, counted
            },
        )

    @property
    def launch(self) -> str:
        """Who starts the workers: ``'ray'`` with ``rollout.ray_address`` set, ``'manual'`` (``mrl worker
        --connect``) with remote workers, else ``'local'`` (the trainer's own processes only)."""
        if self.ray_address is not None:
            return "ray"
        return "manual" if self.remote_workers else "local"

    @property
    def staleness_bound(self) -> float:
        """The versions a sample may lag before it is stale (``inf`` for ``max_staleness: null``)."""
        return float("inf") if self.max_staleness is None else float(self.max_staleness)

    def validate(self) -> None:
        """The fields' choices and bounds (their metadata), then the rules between fields."""
        check_fields(self, "rollout")
        if not self.engine:
            raise ConfigError("rollout.engine: must name an engine")
        fixed = sorted(
            {"model", "load_format", "logprobs_mode", "tensor_parallel_size", "weight_transfer_config"}
            & set(self.engine_options)
        )
        if fixed:
            raise ConfigError(
                f"rollout.engine_options: {fixed} are set by the engine itself (weight_transfer_config: by "
                f"weight_sync.transport 'vllm' and weight_sync.vllm_backend); remove them"
            )
        if self.ref_logps == "engine" and self.workers == 0 and self.remote_workers == 0:
            raise ConfigError(
                "rollout.ref_logps: 'engine' needs rollout workers (rollout.workers or rollout.remote_workers > 0) "
                "to score on; valid here: 'trainer'"
            )
        for key in ("engine_cores", "trainer_cores"):
            cores = getattr(self, key)
            if cores is not None and not cores:
                raise ConfigError(
                    f"rollout.{key}: an empty list leaves that side with no core; list at least one core or remove "
                    "the key (None: split the process's cores)"
                )
            if cores and (min(cores) < 0 or len(set(cores)) != len(cores)):
                raise ConfigError(f"rollout.{key}: {cores!r} invalid; a list of distinct CPU core ids >= 0")
        if self.remote_workers:
            parse_address(self.rendezvous)
        elif self.rendezvous != DeploymentSection.rendezvous:
            raise ConfigError(
                f"rollout.rendezvous: {self.rendezvous!r} is where the trainer listens for remote workers, and "
                "rollout.remote_workers is 0; set rollout.remote_workers >= 1 or remove rendezvous"
            )
        self._validate_launcher()
        if self.colocated_workers > self.workers:
            raise ConfigError(
                f"rollout.colocated_workers: {self.colocated_workers} exceeds rollout.workers ({self.workers})"
            )
        if {"cores", "threads"} & set(self.engine_budget):
            raise ConfigError(
                "rollout.engine_budget: a mapping of npu_cube_cores, npu_vector_cores, stream_priority (the workers' "
                "cores are those outside rollout.trainer_cores, their threads rollout.engine_threads)"
            )
        from mrl_plugins.device.budget import ComputeBudget

        ComputeBudget.from_dict(dict(self.engine_budget), "rollout.engine_budget")  # unknown keys/values refused
        if not self.rebalance_low < self.rebalance_high:
            raise ConfigError(
                f"rollout.rebalance_low/rebalance_high: need low < high, got {self.rebalance_low} and "
                f"{self.rebalance_high}"
            )

    def fixed_by(self, mode: str, processes: int = 1, engine: Any = None) -> str | None:
        """Why this run keeps the configured split (``placement: fixed``, or a deployment where ``auto`` has nothing
        to choose: it moves work between one training process and its local workers, and takes turns with the
        trainer's own model, which must stand in for the ``engine``'s registration: its ``warmup``), or None:
        ``auto`` decides."""
        if self.placement == "fixed":
            return "placement: fixed"
        if engine is not None and not engine.warmup:
            return f"the trainer's own model does not stand in for engine {engine.name!r}"
        if self.workers < 1:
            return "no local rollout workers"
        if self.remote_workers:
            return "remote workers"
        if self.rebalance:
            return "rollout.rebalance moves the workers instead"
        if mode == "hybrid":
            return "mode hybrid"
        if processes > 1:
            return f"{processes} training processes"
        return None

    def check_backend(self, key: str, engine: Any, engines: dict[str, Any]) -> None:
        """What follows from the engine's registration (a :class:`~mrl_plugins.hookspecs.RolloutEngine`, looked up
        by the plugin manager, which calls this with every registered engine): its options and scoring checked,
        the start bound raised to its declared start, ``local_warmup: auto`` resolved to its ``warmup``."""
        if key != "engine":
            return
        if self.engine_options and not engine.options:
            raise ConfigError(
                f"rollout.engine_options: engine {self.engine!r} takes no options, got {sorted(self.engine_options)}; "
                f"engines that do: {choices(n for n, e in engines.items() if e.options)}"
            )
        if self.ref_logps == "engine" and not engine.scores:
            raise ConfigError(
                f"rollout.ref_logps 'engine': engine {self.engine!r} cannot score completions (engines that can: "
                f"{choices(n for n, e in engines.items() if e.scores)}); use ref_logps: trainer"
            )
        self.start_timeout_s = max(float(self.start_timeout_s), float(engine.start_s))
        if self.local_warmup == "auto":
            self.local_warmup = bool(engine.warmup)

    @property
    def warmup(self) -> bool:
        """Whether the trainer's own model generates while the workers start (``local_warmup``; 'auto' is resolved
        from the engine's registration by :meth:`check_backend`, and stays off until then)."""
        return self.local_warmup is True

    def _validate_launcher(self) -> None:
        """``rollout.ray_address`` (Ray starts the remote workers) and its ``ray_*`` keys (Ray is looked for, never
        imported)."""
        launch = self.launch
        if launch == "ray" and not self.remote_workers:
            raise ConfigError(
                "rollout.ray_address: Ray starts the rollout.remote_workers, which is 0; set rollout.remote_workers "
                ">= 1 (rollout.workers stay the trainer's own processes), or remove ray_address"
            )
        if launch != "ray":
            changed = [
                k for k, default in (("ray_strategy", "PACK"), ("ray_resources", {}), ("ray_worker_cores", None))
                if getattr(self, k) != default
            ]  # fmt: skip
            if changed:
                raise ConfigError(f"rollout.{changed[0]}: only used with rollout.ray_address set (Ray's workers)")
            return
        if not self.ray_address.strip():
            raise ConfigError("rollout.ray_address: 'auto', 'local' or the head's HOST:PORT")
        if self.ray_address.startswith("ray://"):
            raise ConfigError(
                f"rollout.ray_address: {self.ray_address!r} is a Ray Client address, which the launcher does not "
                "support (the trainer must be a process of the cluster); run it on a cluster node with 'auto' or "
                "the head's HOST:PORT"
            )
        if self.ray_address not in ("auto", "local"):
            parse_address(self.ray_address, "rollout.ray_address")
        bad = [k for k, v in self.ray_resources.items()
               if not isinstance(k, str) or k in RAY_OWN_RESOURCES or isinstance(v, bool)
               or not isinstance(v, int | float) or v <= 0]  # fmt: skip
        if bad:
            raise ConfigError(
                f"rollout.ray_resources: {bad[0]!r}: a custom resource name with a number > 0 (not one of "
                f"{choices(RAY_OWN_RESOURCES)}: the launcher sets those from engine_threads and the device)"
            )
        cores = self.ray_worker_cores
        if cores is not None and (
            not isinstance(cores, list) or not cores or len(set(map(str, cores))) != len(cores)
            or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cores)
            or len(cores) < self.engine_threads
        ):  # fmt: skip
            raise ConfigError(
                f"rollout.ray_worker_cores: {cores!r} invalid; a list of distinct CPU core ids >= 0, at least "
                f"engine_threads ({self.engine_threads}) of them (each actor on a node binds engine_threads of them "
                "in order), or null (the cores Ray's raylet gives its actors)"
            )
        if not is_ray_available():
            raise ConfigError(
                "rollout.ray_address: Ray starts the workers, and Ray is not installed here: pip install "
                "'mrl-plugins[ray]' (on the trainer's node and every worker node)"
            )

    def check_placement_on(self, mode: str, device: Any) -> None:
        """:meth:`check_placement` against this process's cores and the visible devices of ``device``'s type."""
        import os

        devices = 0
        if device.type != "cpu":
            from mrl_plugins.device import probe

            devices = probe.cuda_device_count() if device.type == "cuda" else probe.npu_status().device_count
        self.check_placement(
            mode, device.type, sorted(os.sched_getaffinity(0)), devices=devices, device_index=device.index or 0
        )

    def check_placement(
        self,
        mode: str,
        device_type: str,
        cores: list[int],
        *,
        devices: int = 0,
        device_index: int = 0,
    ) -> None:
        """Refuse more local workers than this host can give their own core (CPU) or device (NPU/CUDA).

        ``cores``: the cores the trainer process may use (``os.sched_getaffinity(0)``); ``devices``: the visible
        devices of ``device_type``. Counted with the placement rule that places them
        (:mod:`mrl_plugins.device.placement`: ``cpu_split``, ``accelerator_indices``); hybrid's colocated workers
        share the trainer's cores or device and need none.
        """
        from mrl_plugins.device.placement import accelerator_indices, cpu_split

        dedicated = self.workers - (self.colocated_workers if mode == "hybrid" else 0)
        if device_type == "cpu":
            for key in ("trainer_cores", "engine_cores"):
                outside = sorted(set(getattr(self, key) or ()) - set(cores))
                if outside:
                    raise ConfigError(
                        f"rollout.{key}: cores {outside} are not cores this process may use; valid: {sorted(cores)}"
                    )
            if self.oversubscribe or dedicated <= 0:
                return
            if self.engine_cores is None and len(cores) > 1 and not set(cores) - set(self.trainer_cores or ()):
                raise ConfigError(
                    f"rollout.trainer_cores: {self.trainer_cores} are all the cores this process may use; leave at "
                    f"least one of {sorted(cores)} to the {dedicated} rollout worker(s)"
                )
            trainer, pool = cpu_split(self, cores)
            free = len([c for c in pool if c not in (trainer or ())]) or 1  # one core: shared by design
            if self.engine_cores is not None:
                where = f"rollout.engine_cores lists {len(self.engine_cores)}"
            elif len(cores) > 1:
                where = f"this process may use {len(cores)} core(s) {sorted(cores)}, the trainer keeps {len(trainer)}"
            else:
                where = f"this process may use 1 core {sorted(cores)}"
            if dedicated > free:
                raise ConfigError(
                    f"rollout.workers: {dedicated} rollout worker(s) but only {free} CPU core(s) free for them "
                    f"({where}); lower rollout.workers to {free} (workers sharing cores slow every step down)"
                )
            each = max(1, free // dedicated)
            if self.engine_threads > each:
                raise ConfigError(
                    f"rollout.engine_threads: {self.engine_threads} torch threads per worker, but each of the "
                    f"{dedicated} rollout worker(s) gets {each} CPU core(s) ({where}); lower rollout.engine_threads "
                    f"to {each} (threads beyond a worker's cores slow it down)"
                )
            return
        if mode == "colocate" or dedicated <= 0:
            return
        need = max(accelerator_indices(mode, self.workers, self.colocated_workers, device_index)) + 1
        if need > devices:
            raise ConfigError(
                f"rollout.workers: {dedicated} dedicated worker(s) in mode {mode} need {device_type} devices "
                f"{device_index + 1}..{need - 1} (one each, after the trainer's {device_index}) but only {devices} "
                f"{device_type} device(s) are visible; lower rollout.workers or use mode: colocate"
            )
