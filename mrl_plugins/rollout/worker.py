"""The worker side of a rollout worker pool: :func:`worker_main` runs in every worker process.

A worker builds its models from their configs, opens each model's weight receiver
(``open_receiver`` of the selected weight-sync stage, from the handle its sender gave the pool)
and its experience producer (``open_producer`` of the selected comm stage), then serves
requests from its queue: it switches to the version a request needs (``min_version``), generates,
optionally scores the completions with further models, and sends the answer through the comm stage.
A publish notice (:class:`~mrl_plugins.rollout.wire.WeightsNotice`) makes it fetch the new version at once;
between requests it also polls every ``weight_sync.poll_interval_s``. It exits when the trainer process is
gone; an error is reported to the trainer before the process exits non-zero.
The trainer side is :class:`~mrl_plugins.rollout.pool.WorkerPool`; every message is in :mod:`.wire`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from mrl_plugins.errors import MrlError, StageTimeoutError
from mrl_plugins.hookspecs import StageContext

from .engine import build_engine
from .wire import (
    BUDGET,
    MEMORY,
    SWITCHED,
    BatchMeta,
    GenerateRequest,
    StopRequest,
    WeightsNotice,
    WorkerError,
    WorkerEvent,
)

NOTICE_GRACE_S = 5.0  # how long a notice makes an idle worker try for its version before it polls as usual


@dataclass
class ServedModel:
    """One model a worker serves (picklable): its architecture, its parameters' dtypes (the trainer's: a bf16
    policy is served in bf16) and the handle of its weight stream."""

    model_config: dict
    model_class: str
    weight_handle: Any
    dtype: str | None = None  # the dtype of most of the trainer's parameters (None: the config's default)
    dtypes: dict[str, str] = field(default_factory=dict)  # parameters of another dtype than ``dtype``, by name


def param_dtypes(model: Any) -> tuple[str | None, dict[str, str]]:
    """``(dtype, exceptions)`` of ``model``'s parameters for :class:`ServedModel`: the most common dtype and the
    names of the parameters of another one (names without the ``torch.`` prefix: ``bfloat16``)."""
    from collections import Counter

    names = {n: str(p.dtype).removeprefix("torch.") for n, p in model.named_parameters()}
    if not names:
        return None, {}
    common = Counter(names.values()).most_common(1)[0][0]
    return common, {n: d for n, d in names.items() if d != common}


@dataclass
class WorkerSpec:
    """Everything a spawned worker needs (picklable)."""

    index: int
    config: Any  # MrlConfig
    models: dict[str, ServedModel]  # model_id -> what to build
    sampling: Any  # SamplingParams
    engine_factory: Any
    comm_handle: Any
    cores: list[int] | None
    threads: int
    #: builds the worker's plugin manager from ``config`` (the trainer's manager's ``factory``, a module-level
    #: function: picklable by name), so every stage end opens in the worker as it would in the trainer
    plugin_factory: Any
    env: dict = field(default_factory=dict)
    device: str = "cpu"
    seed: int = 0
    #: the engine keeps its own copy of the weights (``RolloutEngine.own_weights``): applied after each switch
    own_weights: bool = False
    log_level: int = logging.WARNING  # the trainer's level for "mrl_plugins" (version-switch lines at INFO)


def _build_model(spec: ServedModel) -> Any:
    """The served model from its config, in the trainer's dtypes (its weights arrive with the first version)."""
    import torch
    import transformers

    cls = getattr(transformers, spec.model_class, None) or transformers.AutoModelForCausalLM
    config_cls = transformers.AutoConfig.for_model(spec.model_config["model_type"]).__class__
    config = config_cls.from_dict(spec.model_config)
    model = cls(config) if cls is not transformers.AutoModelForCausalLM else cls.from_config(config)
    if spec.dtype is not None:
        model = model.to(getattr(torch, spec.dtype))
    if spec.dtypes:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in spec.dtypes:
                    param.data = param.data.to(getattr(torch, spec.dtypes[name]))
    return model.eval()


def worker_main(spec: WorkerSpec, requests: Any, errors: Any, parent_pid: int | None, ready: Any, events: Any) -> None:
    """Entry point of a rollout worker process."""
    os.environ.update(spec.env)
    pkg_log = logging.getLogger("mrl_plugins")
    if spec.log_level <= logging.INFO and not pkg_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(f"[mrl worker {spec.index}] %(message)s"))
        pkg_log.addHandler(handler)
        pkg_log.setLevel(spec.log_level)
    try:
        import torch

        device, applied = apply_worker_budget(spec)
        events.put(WorkerEvent(BUDGET, spec.index, applied.as_dict() | {"pid": os.getpid()}))
        pm = spec.plugin_factory(spec.config)
        ctx = StageContext(config=pm.config, plugins=pm)  # as the manager resolved it on this host
        timeline_dir = os.environ.get("MRL_TIMELINE_DIR")
        timeline = (
            open(os.path.join(timeline_dir, f"worker-{spec.index}-{os.getpid()}.jsonl"), "a", encoding="utf-8")  # noqa: SIM115
            if timeline_dir
            else None
        )
        receivers: dict[str, Any] = {}
        engines: dict[str, Any] = {}
        for mid, served in spec.models.items():
            model = _build_model(served)
            # the engine first: one that runs the model in place (transformers) moves it to the worker's device, and
            # the receiver then holds its double buffer where the parameters are (on a GPU, not in host memory)
            # rollout.engine_options, with what the weight transport needs the engine built with
            # (weight_sync.transport: vllm's weight_transfer_config)
            options = dict(spec.config.rollout.engine_options or {}) | dict(
                getattr(served.weight_handle, "engine_options", None) or {}
            )
            engines[mid] = build_engine(
                spec.engine_factory, model, spec.sampling, device=spec.device, seed=spec.seed + spec.index,
                options=options,
            )  # fmt: skip
            receivers[mid] = pm.weight_sync_open_receiver(
                ctx=ctx, model=model, handle=served.weight_handle, model_id=mid, rank=spec.index
            )
            if getattr(receivers[mid], "into_engine", False):  # weight_sync 'vllm': rounds load into the engine
                receivers[mid].bind_engine(engines[mid])
        producer = pm.comm_open_producer(ctx=ctx, handle=spec.comm_handle, index=spec.index)
        reserve = _memory_reservation(spec, device, engines.get("policy"), events)
        ready.set()  # models built, weights and experience paths attached
        timeout = spec.config.rollout.timeout_s
        from mrl_plugins.weight_sync.receiver import PollInterval

        # the pool sends a notice with every publish; besides, between requests the worker polls for new versions
        # every weight_sync.poll_interval_s (auto: 3/8 of the measured gap between versions); a request names the
        # version it needs (min_version) and is served with it
        clock = PollInterval(spec.config.weight_sync.poll_interval_s)
        last_poll = time.monotonic()

        def pull(model_ids: Any = receivers) -> None:
            for mid in model_ids:
                switched = switch_engine(
                    receivers[mid], engines[mid], spec.own_weights, timeout, spec.config.weight_sync.timeout_s
                )
                if switched is not None:
                    if mid == "policy":
                        clock.arrived()
                    events.put(WorkerEvent(SWITCHED, spec.index, switched[0], mid))

        def await_version(mid: str, version: int, deadline: float, *, strict: bool = True) -> None:
            pull((mid,))
            while receivers[mid].version < version:
                if time.monotonic() > deadline:
                    if not strict:
                        return
                    raise StageTimeoutError(
                        f"worker {spec.index}: weight version {version} of {mid!r} not received within "
                        f"{timeout:.0f} s (have {receivers[mid].version})"
                    )
                time.sleep(0.002)
                pull((mid,))

        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                return  # trainer died: exit instead of lingering (remote workers: its store is gone)
            try:
                req = requests.get(timeout=min(0.5, clock.seconds))  # the trainer's liveness is checked at least 2/s
            except queue.Empty:
                if time.monotonic() - last_poll >= clock.seconds:
                    pull()
                    last_poll = time.monotonic()
                continue
            if isinstance(req, StopRequest):
                return
            if isinstance(req, WeightsNotice):  # a publish notice: fetch now instead of at the next poll
                mid, version = req.model_id, req.version
                if mid in receivers:
                    await_version(mid, version, time.monotonic() + min(timeout, NOTICE_GRACE_S), strict=False)
                    last_poll = time.monotonic()
                continue
            if not isinstance(req, GenerateRequest):  # from another process or host: say what came, not AttributeError
                raise MrlError(f"worker {spec.index}: unknown request {type(req).__name__} (see rollout.wire)")
            req_id, chunk, prompts, num_generations = req.req_id, req.chunk, req.prompts, req.num_generations
            model_id, min_version, score_with = req.model_id, req.min_version, req.score_with
            for mid in (model_id, *score_with):
                if mid not in engines:
                    raise MrlError(f"worker {spec.index}: model_id {mid!r} is not served; valid: {sorted(engines)}")
            receiver, engine = receivers[model_id], engines[model_id]
            deadline = time.monotonic() + timeout
            await_version(model_id, min_version, deadline)
            t0 = time.perf_counter()
            with receiver.active(), device.stream_context(applied.stream):
                version = receiver.version
                if reserve is not None:  # first generation: cap the allocator at its measured peak + headroom
                    out = reserve(engine.generate, prompts, num_generations)
                    reserve = None
                else:
                    out = engine.generate(prompts, num_generations)
            gen_s = time.perf_counter() - t0
            if timeline is not None:  # MRL_TIMELINE_DIR (mrl compare's time plot): this generation's interval
                end = time.monotonic()
                timeline.write(json.dumps({"worker": spec.index, "kind": "generate", "t0": end - gen_s, "t1": end}))
                timeline.write("\n")
                timeline.flush()
            lengths = torch.tensor([len(c) for c in out.completion_ids], dtype=torch.int64)
            flat_ids = torch.tensor(list(itertools.chain.from_iterable(out.completion_ids)), dtype=torch.int64)
            flat_lp = torch.tensor(list(itertools.chain.from_iterable(out.logprobs)), dtype=torch.float32)
            batch = {"completion_ids": flat_ids, "lengths": lengths, "logprobs": flat_lp}
            for mid in score_with:  # the completions' logprobs under another served model (e.g. the reference)
                await_version(mid, 0, deadline)
                with receivers[mid].active():
                    scores = engines[mid].score(out.prompt_ids, out.completion_ids)
                batch[f"score_{mid}"] = torch.tensor(list(itertools.chain.from_iterable(scores)), dtype=torch.float32)
            meta = BatchMeta(
                seq=int(req_id),
                chunk=int(chunk),
                worker=spec.index,
                model_id=model_id,
                version=int(version),
                gen_us=int(gen_s * 1e6),
                apply_us=int(engine.last_apply_ms * 1e3) if spec.own_weights else 0,
            )
            producer.send(batch, meta.to_meta(), timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - report to the trainer, then exit non-zero
        try:
            errors.put(WorkerError(spec.index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"), timeout=2)
        except Exception:  # noqa: BLE001
            pass
        raise SystemExit(3) from None
    finally:
        if locals().get("timeline") is not None:
            locals()["timeline"].close()
        for end in [*locals().get("engines", {}).values(), *locals().get("receivers", {}).values()]:
            close = getattr(end, "close", None)
            if callable(close):
                close()
        if locals().get("producer") is not None:
            locals()["producer"].close()


def apply_worker_budget(spec: WorkerSpec) -> tuple[Any, Any]:
    """Apply the worker's compute budget through the device layer, before any engine is built (vLLM's in-process
    engine core and its OpenMP threads inherit it): CPU affinity and torch threads from the placement; on NPU
    ``rollout.engine_budget``'s cube/vector core limits (torch_npu ``set_stream_limit``/``set_device_limit``); a
    stream of ``stream_priority`` that generation runs on. Returns ``(device, AppliedBudget)``."""
    from mrl_plugins.device import ComputeBudget, apply_compute_budget, get_device

    if spec.device == "auto":  # a remote worker: this host's accelerator
        spec.device = str(get_device("auto").torch_device)
    device = get_device(spec.device)
    extra = dict(getattr(spec.config.rollout, "engine_budget", None) or {})
    budget = ComputeBudget(cores=list(spec.cores) if spec.cores else None, threads=spec.threads, **extra)
    applied = apply_compute_budget(budget, device)
    if spec.cores and device.type == "cpu":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, spec.cores)))
    return device, applied


def _memory_reservation(spec: WorkerSpec, device: Any, engine: Any, events: Any) -> Any:
    """``fn -> result``: run the first generation under a peak measurement and cap this worker's allocator at
    peak x (1 + ``rollout.memory_headroom``) (NPU/CUDA; CPU: recorded only); reported as a ``memory`` event.
    None for engines that size their own memory pool (vLLM: ``gpu_memory_utilization``)."""
    if engine is None or spec.own_weights:
        return None
    headroom = float(spec.config.rollout.memory_headroom)

    def run(fn: Any, *args: Any) -> Any:
        from mrl_plugins.device.memory import measure_peak, reserve_memory

        result, profile = measure_peak(lambda: fn(*args), device)
        fraction = None
        if device.type != "cpu" and profile.peak_bytes > 0:
            fraction = reserve_memory(device, profile.peak_bytes, headroom)
        events.put(WorkerEvent(MEMORY, spec.index, {"peak_bytes": profile.peak_bytes, "fraction": fraction}))
        return result

    return run


def budget_metrics(budgets: dict[int, dict]) -> dict[str, float]:
    """``rollout/budget_*`` gauges from what the workers reported: per worker ``w``, its cores, threads, NPU core
    limits (cube, vector; -1: none set), reserved memory fraction (0: none) and the device memory its first
    generation peaked at (bytes; 0 until measured; CPU: the process's peak RSS)."""
    out: dict[str, float] = {}
    for w, got in sorted(budgets.items()):
        b, mem = got.get("budget") or {}, got.get("memory") or {}
        out[f"rollout/budget_cores/{w}"] = float(len(b.get("cores") or []))
        out[f"rollout/budget_threads/{w}"] = float(b.get("threads") or 0)
        cube, vector = b.get("npu_stream_limit") or b.get("npu_device_limit") or (-1, -1)  # (cube, vector) set
        out[f"rollout/budget_npu_cube_cores/{w}"] = float(cube)
        out[f"rollout/budget_npu_vector_cores/{w}"] = float(vector)
        out[f"rollout/budget_memory_fraction/{w}"] = float(mem.get("fraction") or 0.0)
        out[f"rollout/budget_memory_peak_bytes/{w}"] = float(mem.get("peak_bytes") or 0.0)
    return out


def switch_engine(
    receiver: Any, engine: Any, own_weights: bool, poll_timeout: float, switch_timeout: float
) -> tuple[int, Any] | None:
    """Fetch and switch to a newer version of the receiver's model if one is published, then apply it to an engine
    that keeps its own copy of the weights (``own_weights``: vLLM; not when the receiver loads into the engine
    itself, ``into_engine``). Call it between requests. Returns ``(version, SwitchReport or None)``, or None."""
    staged = receiver.poll(poll_timeout)
    if staged is None:
        return None
    report = receiver.switch(switch_timeout)  # the receiver logs one line per switch
    version = int(report.to_version) if report is not None else int(staged)
    if own_weights and not getattr(receiver, "into_engine", False):
        engine.apply_weights(version=version)
    return version, report
