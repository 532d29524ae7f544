"""The ``rollout:`` section's keys in three groups a reader can take in one at a time.

:class:`~mrl_plugins.rollout.config.RolloutConfig` is all three (the keys stay flat in YAML: ``rollout.workers``);
the groups are how ``docs/config.md`` and the code present them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    engine_threads: int = field(default=1, metadata={"help": "torch threads of each rollout engine"})
    engine_cores: list[int] | None = field(
        default=None, metadata={"help": "CPU cores for engines (None: split the process's cores)"}
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
        default=0.2,
        metadata={
            "help": "NPU/CUDA rollout workers (transformers engine): after the first generation the worker caps its "
            "allocator at the measured peak x (1 + headroom) of the device (CPU: measured and reported only)"
        },
    )


@dataclass
class DeploymentSection:
    """Where the workers run: how many, local or remote, the placement and its automatic choice, the trainer's
    share, restarts and rebalancing."""

    workers: int = field(
        default=1, metadata={"help": "rollout worker processes; 0 = engine inside the trainer process (no overlap)"}
    )
    remote_workers: int = field(
        default=0,
        metadata={
            "help": "workers outside the trainer's process tree, on this or other hosts, joining through "
            "rollout.rendezvous (indices after the local ones); started by hand (launcher 'manual': `mrl worker "
            "--connect <rendezvous> --index i`) or as Ray actors (launcher 'ray'); need comm.transport: "
            "torch_distributed and weight_sync.transport: broadcast, per_param or directory (shared filesystem)"
        },
    )
    rendezvous: str = field(
        default="127.0.0.1:0",
        metadata={"help": "HOST:PORT the trainer listens on for remote workers (reachable from them; port 0 = any)"},
    )
    launcher: str | None = field(
        default=None,
        metadata={
            "help": "who starts the workers: 'local' (rollout.workers processes of the trainer's, no remote "
            "workers), 'manual' (besides those, rollout.remote_workers you start with `mrl worker --connect`), "
            "'ray' (besides those, rollout.remote_workers started, placed and restarted by Ray as actors on a "
            "running cluster: rollout.ray_address; pip install 'mrl-plugins[ray]'; docs/ray.md); None: 'manual' "
            "when remote_workers > 0, else 'local'"
        },
    )
    ray_address: str = field(
        default="auto",
        metadata={
            "help": "launcher 'ray': the cluster ray.init connects to: 'auto' (RAY_ADDRESS, else the cluster "
            "started on this node with `ray start --head`), 'HOST:PORT' of its head, or 'local' (start a "
            "one-node cluster in the trainer for this run; no other way starts one)"
        },
    )
    ray_strategy: str = field(
        default="PACK",
        metadata={
            "help": "launcher 'ray': the placement group's strategy over its bundles (one per remote worker: CPU "
            "= engine_threads, plus GPU 1 on CUDA or NPU 1 on Ascend): PACK, SPREAD, STRICT_PACK or STRICT_SPREAD"
        },
    )
    ray_resources: dict = field(
        default_factory=dict,
        metadata={
            "help": "launcher 'ray': custom resources added to every worker's bundle, e.g. {rollout_host: 1} to "
            "place workers only on nodes started with `ray start --resources '{\"rollout_host\": 4}'`"
        },
    )
    ray_worker_cores: list | None = field(
        default=None,
        metadata={
            "help": "launcher 'ray': CPU core ids of its node each worker actor binds to, engine_threads of them per "
            "actor in order (the n-th actor Ray placed on a node takes the n-th slice); None: the cores the node's "
            "raylet runs on, which Ray's actors inherit. With `taskset -c <others> ray start` on a worker node, "
            "this keeps Ray's own processes off the workers' cores (docs/ray.md)"
        },
    )
    colocated_workers: int = field(
        default=0, metadata={"help": "hybrid mode: how many of the workers share the trainer's device"}
    )
    placement: str = field(
        default="fixed",
        metadata={
            "help": "'fixed': the workers and the trainer keep the cores this section gives them; 'auto': the run "
            "measures its stage times and keeps the faster of that split and taking turns on all of the "
            "trainer's cores (the trainer's own model generates, the workers idle), re-checked every "
            "placement_interval steps (mrl_plugins.rollout.autoplace; mrl/rollout/placement 0 split, 1 turns); "
            "one training process, local workers, mode colocate or disaggregated"
        },
    )
    placement_start: str = field(
        default="turns",
        metadata={
            "help": "placement auto: the arrangement of the first steps. 'turns': the trainer takes turns on all "
            "cores while the workers start at the lowest CPU priority (they take what it leaves); 'split': the "
            "workers start at full speed on their own cores while the trainer generates with its own model on "
            "its cores (rollout.local_warmup), so the split is ready sooner; either way the other arrangement is "
            "explored at the first decision"
        },
    )
    placement_interval: int = field(
        default=10, metadata={"help": "placement auto: optimizer steps between two decisions (the first after 3)"}
    )
    placement_margin: float = field(
        default=0.1,
        metadata={"help": "placement auto: switch only when the other arrangement is projected this much faster"},
    )
    lend_cores: bool = field(
        default=True,
        metadata={
            "help": "placement auto: in the split, once the workers have answered every lookahead they hold the "
            "trainer borrows what they leave idle until its next generation request, checked between its layers "
            "(mrl/rollout/lends, mrl/rollout/lent_s). CPU: their cores (affinity, all threads). NPU, workers sharing "
            "the trainer's NPU with engine_budget core limits: the training stream runs on the device's cube/vector "
            "cores minus the workers' in the split and on all of them while lent (torch_npu set_stream_limit/"
            "reset_stream_limit; unverified on hardware). CUDA: nothing to lend (torch has no per-stream SM share)"
        },
    )
    trainer_threads: int = field(
        default=1, metadata={"help": "torch threads left to the trainer when an engine shares its cores"}
    )
    trainer_cores: list[int] | None = field(
        default=None, metadata={"help": "CPU cores for the trainer (None: the rest)"}
    )
    oversubscribe: bool = field(
        default=False,
        metadata={
            "help": "allow more dedicated rollout workers than the CPU cores free for them (workers then share "
            "cores and every step slows down); off: such a config is refused before the model is built. "
            "NPU/CUDA workers of mode disaggregated/hybrid need one device each either way"
        },
    )
    restart_workers: int = field(
        default=0,
        metadata={
            "help": "restarts allowed for dead workers over the run (0: a dead worker is an error); needs "
            "rejoinable transports. Local workers are restarted by the pool, launcher 'ray' workers by Ray (each "
            "actor's max_restarts), a 'manual' worker you start again rejoins"
        },
    )
    start_timeout_s: float = field(
        default=180.0, metadata={"help": "max seconds for a worker to start and load the model"}
    )
    start_method: str = field(
        default="auto",
        metadata={
            "help": "how a local worker process starts: 'auto' (fork where it is safe: a CPU worker of the "
            "'transformers' engine with 1 thread and no device runtime or process group in the trainer, so it "
            "inherits the imported torch and transformers and is ready in well under a second; else spawn), "
            "'spawn' (a fresh interpreter that imports everything again: seconds of one core) or 'fork' (an error "
            "where it is unsafe)"
        },
    )
    local_warmup: bool | str = field(
        default="auto",
        metadata={
            "help": "while the workers are still starting: true = the trainer's own model generates (on-policy, "
            "said at enable()), false = the first generation waits for the workers (progress on stderr, at most "
            "rollout.start_timeout_s), 'auto' = true for the 'transformers' engine (the trainer's own model is that "
            "same engine), false for any other (rollout.engine: vllm generates with vLLM from the first step)"
        },
    )
    rebalance: bool = field(
        default=False,
        metadata={
            "help": "hybrid mode: move workers between the colocated and dedicated pools by the trainer's wait "
            "share (see mrl_plugins.rollout.hybrid); needs workers >= 2"
        },
    )
    rebalance_window: int = field(
        default=5, metadata={"help": "hybrid: generations averaged per decision (and waited after a move)"}
    )
    rebalance_high: float = field(
        default=0.25, metadata={"help": "hybrid: mean wait share above which a dedicated worker becomes colocated"}
    )
    rebalance_low: float = field(
        default=0.05, metadata={"help": "hybrid: mean wait share below which a colocated worker becomes dedicated"}
    )


@dataclass
class SchedulingSection:
    """How generation and training interleave: the pipeline, staleness, which logprobs the loss takes, time
    limits and queues."""

    pipeline: str = field(
        default="async", metadata={"help": "'async': generate step k+1 while training step k; 'sync': take turns"}
    )
    max_staleness: int = field(
        default=1,
        metadata={
            "help": "max weight versions a sample may lag the trainer "
            "(with TRL num_iterations=k the lookahead is submitted one step before it is used)"
        },
    )
    stale_policy: str = field(
        default="drop",
        metadata={"help": "samples older than max_staleness: 'drop' (regenerate) or 'keep' (count only)"},
    )
    old_logps: str = field(
        default="trainer",
        metadata={
            "help": "GRPO's old logprobs in the loss: 'trainer' (TRL's extra forward pass per generation plus its "
            "importance-sampling correction) or 'engine' (the engine's sampling logprobs, i.e. the behaviour "
            "policy, as TRL's AsyncGRPO does; saves that forward pass; GRPO only, temperature-only sampling)"
        },
    )
    ref_logps: str = field(
        default="trainer",
        metadata={
            "help": "reference-model logprobs for the KL term (beta != 0): 'trainer' (TRL's forward pass of its "
            "ref_model on the trainer) or 'engine' (every rollout worker holds a copy of the reference model and "
            "scores the completions it generated; the trainer skips that pass; needs rollout workers)"
        },
    )
    timeout_s: float = field(default=120.0, metadata={"help": "max seconds to wait for a worker's batch or reply"})
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
            "left running); 0: no bound, tools are called as TRL calls them"
        },
    )
    model_priorities: dict = field(
        default_factory=lambda: {"policy": 0},
        metadata={"help": "multi-model pool: model_id -> priority (lower runs first)"},
    )
    switch_throttle: int = field(
        default=64, metadata={"help": "max queued requests per model admitted while a weight switch is pending"}
    )


#: (title, group) in the order the reference shows them
SECTIONS = (("engine", EngineSection), ("deployment", DeploymentSection), ("scheduling", SchedulingSection))

__all__ = ["SECTIONS", "DeploymentSection", "EngineSection", "SchedulingSection"]
