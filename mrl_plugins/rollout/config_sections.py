"""The ``rollout:`` section's keys in three groups a reader can take in one at a time.

:class:`~mrl_plugins.rollout.config.RolloutConfig` is all three (the keys stay flat in YAML: ``rollout.workers``);
the groups are how ``docs/config.md`` and the code present them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mrl_plugins.config_fields import internal
from mrl_plugins.device.memory import DEFAULT_HEADROOM


@dataclass
class EngineSection:
    """The engine: which one, its threads, cores, device budget and memory share."""

    engine: str = field(
        default="transformers", metadata={"help": "generation engine: 'transformers' or 'vllm' (or a plugin's)"}
    )
    engine_options: dict = field(
        default_factory=dict,
        metadata={
            "help": "engine 'vllm' only: extra vllm.LLM keyword arguments (e.g. gpu_memory_utilization, "
            "max_model_len, enforce_eager); the engine sets load_format, dtype (the trainer model's), "
            "logprobs_mode and tensor_parallel_size 1 itself"
        },
    )
    engine_threads: int = field(
        default=1, metadata={"help": "torch threads of each rollout engine (CPU: at most its worker's cores)", "ge": 1}
    )
    engine_cores: list[int] | None = internal(
        "the workers take the process's cores outside rollout.trainer_cores (restrict the process with taskset to "
        "leave cores out)",
        default=None,
    )
    engine_budget: dict = field(
        default_factory=dict,
        metadata={
            "help": "device part of every rollout worker's compute budget: npu_cube_cores, npu_vector_cores "
            "(torch_npu set_stream_limit/set_device_limit) and stream_priority (high|normal|low; generation runs on "
            "that stream, a hardware priority on CUDA); the cores and threads come from the placement"
        },
    )
    memory_headroom: float = field(
        default=DEFAULT_HEADROOM,
        metadata={
            "help": "NPU/CUDA rollout workers (transformers engine): after the first generation the worker caps its "
            "allocator at the measured peak x (1 + headroom) of the device (CPU: measured and reported only)",
            "ge": 0,
            "le": 4,
        },
    )


@dataclass
class DeploymentSection:
    """Where the workers run: how many, local or remote, the placement and its automatic choice, the trainer's
    share, restarts and rebalancing."""

    workers: int = field(
        default=1,
        metadata={"help": "rollout worker processes; 0 = engine inside the trainer process (no overlap)", "ge": 0},
    )
    remote_workers: int = field(
        default=0,
        metadata={
            "help": "workers outside the trainer's process tree, on this or other hosts, joining through "
            "rollout.rendezvous (indices after the local ones); started by hand (launcher 'manual': `mrl worker "
            "--connect <rendezvous> --index i`) or, with rollout.ray_address set, as Ray actors; the transports "
            "'auto' then carry experience over torch_distributed and weights over broadcast (or directory, when "
            "weight_sync.directory names a shared filesystem)",
            "ge": 0,
        },
    )
    rendezvous: str = field(
        default="127.0.0.1:0",
        metadata={"help": "HOST:PORT the trainer listens on for remote workers (reachable from them; port 0 = any)"},
    )
    ray_address: str | None = field(
        default=None,
        metadata={
            "help": "set: Ray starts the rollout.remote_workers as actors (placed, restarted by Ray; pip install "
            "'mrl-plugins[ray]'; docs/ray.md) on the cluster ray.init connects to: 'auto' (RAY_ADDRESS, else the "
            "cluster started on this node with `ray start --head`), 'HOST:PORT' of its head, or 'local' (a one-node "
            "cluster in the trainer for this run); null: remote workers are started by hand (`mrl worker --connect`)"
        },
    )
    ray_strategy: str = internal(
        "Ray places the workers' bundles PACK; target nodes with rollout.ray_resources",
        default="PACK",
        choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
    )
    ray_resources: dict = field(
        default_factory=dict,
        metadata={
            "help": "Ray: custom resources added to every worker's bundle, e.g. {rollout_host: 1} to "
            "place workers only on nodes started with `ray start --resources '{\"rollout_host\": 4}'`"
        },
    )
    ray_worker_cores: list | None = field(
        default=None,
        metadata={
            "help": "Ray: CPU core ids of its node each worker actor binds to, engine_threads of them per "
            "actor in order (the n-th actor Ray placed on a node takes the n-th slice); None: the cores the node's "
            "raylet runs on, which Ray's actors inherit. With `taskset -c <others> ray start` on a worker node, "
            "this keeps Ray's own processes off the workers' cores (docs/ray.md)"
        },
    )
    colocated_workers: int = field(
        default=0, metadata={"help": "hybrid mode: how many of the workers share the trainer's device", "ge": 0}
    )
    placement: str = field(
        default="auto",
        metadata={
            "help": "'auto': where the run can choose (one training process, local workers, mode colocate or "
            "disaggregated, no rebalance) it measures its stage times and keeps the faster of the split this "
            "section gives (workers on their cores) and taking turns on all of the trainer's cores (the "
            "trainer's own model generates, the workers idle), re-checked every 10 steps (mrl_plugins.rollout."
            "autoplace; mrl/rollout/placement 0 split, 1 turns); in the split the trainer borrows the cores the "
            "workers leave idle; elsewhere the split, with the reason in enable()'s line. 'fixed': always the "
            "split (the workers serve from their start)",
            "choices": ("fixed", "auto"),
        },
    )
    placement_start: str = internal(
        "placement auto starts by taking turns while the workers start (rollout.autoplace)",
        default="turns",
        choices=("split", "turns"),
    )
    placement_interval: int = internal("placement auto decides every 10 steps (the first after 3)", default=10, ge=1)
    placement_margin: float = internal(
        "placement auto switches when the other way is projected 10 % faster", default=0.1, ge=0, lt=1
    )
    lend_cores: bool | None = internal(
        "placement auto lends the workers' idle cores to the trainer whenever the weight transport's publish is "
        "not a collective (its registration's capabilities say so)",
        default=None,
    )
    trainer_threads: int | None = internal(
        "the trainer runs one torch thread per core of rollout.trainer_cores (derived)", default=None, ge=1
    )
    trainer_cores: list[int] | None = field(
        default=None,
        metadata={
            "help": "CPU cores the trainer keeps (one torch thread each); the rollout workers split the process's "
            "other cores. None: the first core"
        },
    )
    oversubscribe: bool = internal(
        "more rollout workers than free cores are refused before the model is built (every step would slow down)",
        default=False,
    )
    restart_workers: int = field(
        default=0,
        metadata={
            "help": "restarts allowed for dead workers over the run (0: a dead worker is an error); needs "
            "rejoinable transports. Local workers are restarted by the pool, launcher 'ray' workers by Ray (each "
            "actor's max_restarts), a 'manual' worker you start again rejoins",
            "ge": 0,
        },
    )
    start_timeout_s: float | None = internal(
        "a worker may take max(1.5 x timeout_s, its engine's declared start: vllm 300 s) to start (derived)",
        default=None,
        gt=0,
    )
    start_method: str = internal(
        "a local worker is forked where that is safe (a CPU worker with one thread of an engine registered "
        "fork_safe, no device runtime in the trainer), else spawned (rollout.lifecycle)",
        default="auto",
        choices=("auto", "spawn", "fork"),
    )
    local_warmup: bool | str = internal(
        "while the workers start, the trainer's own model generates with the transformers engine where the "
        "engine's registration declares warmup (transformers); with vllm the first generation waits for it",
        default="auto",
        choices=(True, False, "auto"),
    )
    rebalance: bool = field(
        default=False,
        metadata={
            "help": "hybrid mode: move workers between the colocated and dedicated pools by the trainer's wait "
            "share (see mrl_plugins.rollout.hybrid); needs workers >= 2"
        },
    )
    rebalance_window: int = internal("hybrid rebalancing averages 5 generations per decision", default=5, ge=1)
    rebalance_high: float = internal(
        "a dedicated worker joins the trainer's device above a 0.25 wait share", default=0.25, le=1
    )
    rebalance_low: float = internal("a colocated worker leaves below a 0.05 wait share", default=0.05, ge=0)


@dataclass
class SchedulingSection:
    """How generation and training interleave: staleness, which logprobs the loss takes, tools."""

    pipeline: str | None = internal(
        "rollout.max_staleness: 0 takes turns (generate, then train), >= 1 generates one batch ahead (derived)",
        default=None,
        choices=("async", "sync"),
    )
    stale_policy: str | None = internal(
        "samples older than rollout.max_staleness are regenerated; max_staleness: null keeps them all (derived)",
        default=None,
        choices=("drop", "keep"),
    )
    max_staleness: int | None = field(
        default=1,
        metadata={
            "help": "weight versions a sample may lag the trainer: 0 = take turns (generate, then train, on-policy); "
            "N >= 1 = generate step k+1 while training step k and regenerate samples older than N versions; "
            "null = generate ahead and keep every sample (counted in mrl/rollout/stale_samples). With TRL "
            "num_iterations=k the lookahead is submitted one step before it is used",
            "ge": 0,
        },
    )
    old_logps: str = field(
        default="trainer",
        metadata={
            "help": "GRPO's old logprobs in the loss: 'trainer' (TRL's extra forward pass per generation plus its "
            "importance-sampling correction) or 'engine' (the engine's sampling logprobs, i.e. the behaviour "
            "policy, as TRL's AsyncGRPO does; saves that forward pass; GRPO only, temperature-only sampling)",
            "choices": ("trainer", "engine"),
        },
    )
    ref_logps: str = field(
        default="trainer",
        metadata={
            "help": "reference-model logprobs for the KL term (beta != 0): 'trainer' (TRL's forward pass of its "
            "ref_model on the trainer) or 'engine' (every rollout worker holds a copy of the reference model and "
            "scores the completions it generated; the trainer skips that pass; needs rollout workers)",
            "choices": ("trainer", "engine"),
        },
    )
    timeout_s: float | None = internal(
        "the top-level timeout_s bounds every wait for a worker (derived)", default=None, gt=0
    )
    tool_rollouts_ahead: bool = field(
        default=True,
        metadata={
            "help": "TRL tools / environment_factory (GRPO, one training process, async pipeline): the next batch's "
            "whole multi-turn rollout, its tool calls and environment resets included, runs in a background thread "
            "of the trainer while it trains (TRL's own code on a stand-in for the trainer, every turn on the "
            "workers); false: only the first turn of a tools batch is generated ahead and the tool calls run on "
            "the trainer's thread when TRL asks (for tools that must not run beside training)"
        },
    )
    tool_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "TRL tools and environment methods: max seconds a tool call may take; a tool past it is reported "
            "to the model as a failing tool ({'error': ...}, tools/failure_frequency) and the rollout goes on. A "
            "synchronous tool is called in a thread of its own so that it can be bounded (one past the bound is "
            "left running); 0: no bound, tools are called as TRL calls them",
            "ge": 0,
        },
    )


#: (title, group) in the order the reference shows them
SECTIONS = (("engine", EngineSection), ("deployment", DeploymentSection), ("scheduling", SchedulingSection))
