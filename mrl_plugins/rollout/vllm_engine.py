"""The ``vllm`` rollout engine: a ``vllm.LLM`` built from the policy it is handed, weights applied by reload.

What it does, in the order a worker meets it:

* **Built from the policy, never from a hub.** Given a Hugging Face model, the engine writes the model's config
  (no weights) to a private temporary folder, builds ``vllm.LLM`` on it with ``load_format="dummy"`` and
  ``skip_tokenizer_init=True`` (prompts arrive as token ids, stop tokens are passed explicitly), then applies the
  model's weights.
* **In-process engine core.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: vLLM's scheduler and model runner run in the
  calling process (the rollout worker), so there is no EngineCore child to orphan, no busy-polling process beside
  the trainer, and the worker's compute budget (CPU affinity and threads, device, memory share) binds all of vLLM.
  One device per engine (tensor parallel size 1).
* **Weights by vLLM's layerwise reload.** :meth:`VLLMEngine.apply_weights` hands ``(name, tensor)`` pairs in
  checkpoint (Hugging Face) names to the model runner's ``reload_weights(weights_iterator, is_checkpoint_format=True)``
  through ``collective_rpc``: vLLM restores its checkpoint-format parameters, loads, and re-runs its kernel
  post-processing (the CPU backend repacks linear weights; a per-tensor ``load_weights`` fails there). A tied
  embedding is sent under both names (``model.embed_tokens.weight`` and ``lm_head.weight``): vLLM keeps a separate
  processed ``lm_head`` that is only refreshed from its own name. The worker applies a version between requests, so
  no request is in flight (the drain point); the weight stream itself (transport, checksums, double-buffered
  staging copy) is the weight-sync stage's, unchanged.
* **Logprobs**: the contract of :mod:`mrl_plugins.rollout.engine`. Temperature-only sampling: vLLM's
  ``processed_logprobs`` (the same number). With a sampling filter vLLM's processed logprobs are the filtered
  distribution's and its other ``logprobs_mode`` options do not fit (``raw_logprobs`` ignores the temperature,
  ``raw_logits`` gives one logit without its normaliser, and the mode is engine-wide, fixed when vLLM starts): the
  completions are scored by one teacher-forced pass of the engine's Hugging Face model (:func:`~mrl_plugins.
  rollout.engine.teacher_forced_logps`; the module whose weights vLLM serves, so the same version).

Where it is verified: ``docs/vllm.md``. Never imported at module import: ``vllm`` loads when an engine is built.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from mrl_plugins.errors import ConfigError
from mrl_plugins.optional import check_vllm_installed

from .engine import EngineOutput, SamplingParams, _check_prompts, teacher_forced_logps, trim_after_eos

log = logging.getLogger("mrl_plugins.rollout")

#: head sizes vLLM 0.32's CPU attention backend accepts (read from vLLM itself when it is importable)
_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
#: seconds a vLLM worker may take to start (it builds and profiles its engine): its registration's ``start_s``
VLLM_START_S = 300.0
#: KV-cache GiB given to vLLM's CPU backend when ``VLLM_CPU_KVCACHE_SPACE`` is unset (its default reserves none)
DEFAULT_CPU_KVCACHE_GIB = 1


def _head_dim(config: Any) -> int:
    head_dim = getattr(config, "head_dim", None)
    if head_dim:
        return int(head_dim)
    return int(config.hidden_size) // int(config.num_attention_heads)


def _cpu_head_sizes() -> tuple[int, ...]:
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return tuple(CPUAttentionBackend.get_supported_head_sizes())
    except Exception:  # noqa: BLE001 - another vLLM layout: fall back to the sizes 0.32 documents
        return _CPU_HEAD_SIZES


def check_vllm_servable(config: Any, device: str = "cpu", architecture: str | None = None) -> None:
    """Raise ConfigError, naming the problem and the way out, when vLLM cannot serve a model of ``config``.

    Checked before anything is built: vLLM installed, the architecture in vLLM's model registry, and on CPU a head
    size vLLM's CPU attention accepts. Imports ``vllm`` (a few seconds), so call it only for ``engine: vllm``.
    """
    check_vllm_installed()
    from vllm import ModelRegistry

    archs = list(getattr(config, "architectures", None) or ([architecture] if architecture else []))
    supported = set(ModelRegistry.get_supported_archs())
    if archs and not any(a in supported for a in archs):
        raise ConfigError(
            f"rollout.engine 'vllm': vLLM cannot serve architecture {archs}; set rollout.engine: transformers "
            f"(vLLM serves e.g. Qwen2ForCausalLM, LlamaForCausalLM)"
        )
    if str(device).split(":")[0] == "cpu":
        head = _head_dim(config)
        sizes = _cpu_head_sizes()
        if head not in sizes:
            raise ConfigError(
                f"rollout.engine 'vllm': vLLM's CPU attention does not support head_dim={head} (hidden_size / "
                f"num_attention_heads); supported: {list(sizes)}. Use a model with one of those (the 'tiny' and "
                f"'small' presets have 32) or rollout.engine: transformers"
            )


#: share of the device memory that is free when the engine starts which vLLM may take (weights, activations, KV
#: cache); the rest stays with whatever else uses the device (a trainer sharing it in colocate / hybrid mode)
FREE_MEMORY_SHARE = 0.8


def _memory_share(kind: str) -> float:
    """``gpu_memory_utilization`` (a fraction of the device's total memory) = ``FREE_MEMORY_SHARE`` x what is free
    now: a dedicated device gives vLLM ~80 %, one shared with a trainer leaves the trainer what it holds plus 20 %
    of the rest. Set ``rollout.engine_options.gpu_memory_utilization`` to override. Unverified on hardware."""
    import torch

    backend = getattr(torch, "npu", None) if kind == "npu" else torch.cuda
    try:
        free, total = backend.mem_get_info()
    except Exception as exc:  # noqa: BLE001 - no such device / runtime
        raise ConfigError(f"rollout.engine 'vllm': cannot read the {kind} memory ({exc}); set "
                          f"rollout.engine_options.gpu_memory_utilization") from exc  # fmt: skip
    share = FREE_MEMORY_SHARE * free / total
    if share < 0.05:
        raise ConfigError(
            f"rollout.engine 'vllm': only {free / 2**30:.1f} of {total / 2**30:.1f} GiB free on the {kind} device; "
            f"free memory or set rollout.engine_options.gpu_memory_utilization"
        )
    return round(share, 3)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _restore_after_vllm(saved_set_num_threads: Any) -> None:
    """vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op for the whole process; put it back (the
    worker's thread budget is set before the engine is built, and the trainer process must keep its own)."""
    import torch

    if torch.set_num_threads is not saved_set_num_threads:
        torch.set_num_threads = saved_set_num_threads


class VLLMEngine:
    """Generation through an in-process ``vllm.LLM``; weights applied with :meth:`apply_weights`.

    :param model: a Hugging Face causal LM (the engine builds vLLM from its config and loads its weights; it keeps a
        reference and :meth:`apply_weights` without arguments re-applies the model's current weights).
    :param tokenizer: optional; fills ``params.eos_token_ids``/``pad_token_id`` when they are unset.
    :param device: ``cpu``, ``cuda[:N]`` or ``npu[:N]`` (the process's visible device; one device per engine).
    :param seed: base seed; every completion gets its own (``seed + call x batch + i``).
    :param options: extra ``vllm.LLM`` keyword arguments (``rollout.engine_options``), e.g.
        ``gpu_memory_utilization``, ``max_model_len``, ``enforce_eager``. ``dtype`` must equal the model's.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        device: str = "cpu",
        params: SamplingParams,
        seed: int | None = None,
        options: dict | None = None,
    ) -> None:
        params.fill_from_tokenizer(tokenizer)
        self.params = params
        self.seed = seed
        self.device = str(device)
        self.model = model  # the Hugging Face module whose weights this engine serves
        self.last_apply_ms = 0.0
        self._calls = 0
        self._tmpdir: str | None = None
        kwargs = dict(options or {})
        check_vllm_servable(model.config, self.device, type(model).__name__)
        model_dtype = _dtype_name(next(model.parameters()).dtype)
        asked = kwargs.pop("dtype", None)
        if asked is not None and _dtype_name(asked) != model_dtype:
            raise ConfigError(
                f"rollout.engine_options.dtype: {asked!r} differs from the trainer model's dtype {model_dtype!r}; "
                f"the engine must sample with the weights the trainer trains (remove dtype, or cast the model)"
            )
        self._tmpdir = tempfile.mkdtemp(prefix="mrl-vllm-")
        try:
            config = copy.deepcopy(model.config)
            config.architectures = config.architectures or [type(model).__name__]  # one built in code has none
            config.save_pretrained(self._tmpdir)
            kwargs.update(load_format="dummy", skip_tokenizer_init=True, dtype=model_dtype)
            self.llm = self._build(self._tmpdir, kwargs)
            if "weight_transfer_config" not in kwargs:  # else the first version arrives by vLLM's weight transfer
                self.apply_weights(version=0)
        except BaseException:  # a failed start leaves neither the folder nor vLLM's engine behind
            self.close()
            raise

    # ------------------------------------------------------------------------------------------------ build
    def _build(self, path: str, kwargs: dict) -> Any:
        import torch

        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core runs in this process
        kind = self.device.split(":")[0]
        if kind == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(DEFAULT_CPU_KVCACHE_GIB))
            cores = sorted(os.sched_getaffinity(0))
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cores)))
        elif "gpu_memory_utilization" not in kwargs:  # CUDA / NPU (unverified on hardware)
            kwargs["gpu_memory_utilization"] = _memory_share(kind)
        kwargs.setdefault("logprobs_mode", "processed_logprobs")
        kwargs.setdefault("enforce_eager", True)
        kwargs.setdefault("tensor_parallel_size", 1)
        if self.seed is not None:
            kwargs.setdefault("seed", int(self.seed))
        transfer = kwargs.get("weight_transfer_config")
        if isinstance(transfer, dict) and transfer.get("backend") == "mrl_gloo":  # this package's CPU backend
            from mrl_plugins.weight_sync.vllm_backends import register

            register()
        saved = torch.set_num_threads
        # vLLM initialises torch.distributed (world size 1) when no process group exists; close() takes down only
        # one it created, never the trainer's (accelerate's, or the one TRL's own vLLM made)
        self._owns_process_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        import vllm

        t0 = time.perf_counter()
        try:
            llm = vllm.LLM(model=path, **kwargs)
        except (ValueError, RuntimeError) as exc:  # vLLM's own refusals: memory, config, platform
            raise ConfigError(f"rollout.engine 'vllm': vLLM refused to start: {exc}") from exc
        finally:
            _restore_after_vllm(saved)
        self.startup_s = time.perf_counter() - t0
        log.info("vLLM engine ready in %.1f s (%s, device %s)", self.startup_s, path, self.device)
        return llm

    # ------------------------------------------------------------------------------------------------ weights
    def apply_weights(self, named_tensors: Iterable[tuple[str, Any]] | None = None, version: int | None = None) -> int:
        """Load ``(name, tensor)`` pairs (checkpoint names) into vLLM; without pairs, the served model's current
        weights (every parameter and persistent buffer, tied aliases included). Returns the bytes applied.
        ``version``: the version applied (the engine protocol's argument; vLLM needs nothing of it).

        Call it only when no request is in flight (the worker calls it between requests)."""
        if named_tensors is None:
            named_tensors = self.model.state_dict().items()  # tied lm_head.weight included
        pairs = [(name, t.detach()) for name, t in named_tensors]
        nbytes = sum(t.numel() * t.element_size() for _, t in pairs)
        t0 = time.perf_counter()

        def reload(worker: Any, weights: list) -> bool:
            runner = worker.model_runner
            if not hasattr(runner, "reload_weights"):
                raise RuntimeError(f"{type(runner).__name__} has no reload_weights (vLLM >= 0.2x layerwise reload)")
            runner.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)
            return True

        self.llm.collective_rpc(reload, args=(pairs,))
        self.last_apply_ms = (time.perf_counter() - t0) * 1e3
        return nbytes

    # ------------------------------------------------------------------------------------------------ generate
    def _sampling_params(self, seed: int | None) -> Any:
        import vllm

        p = self.params
        return vllm.SamplingParams(
            n=1,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k else -1,
            min_p=p.min_p or 0.0,
            repetition_penalty=p.repetition_penalty,
            max_tokens=p.max_new_tokens,
            stop_token_ids=list(p.eos_token_ids),
            logprobs=0,
            seed=seed,
            detokenize=False,
        )

    def generate(self, prompts: list[list[int]], num_generations: int = 1) -> EngineOutput:
        """Sample through vLLM; same output contract as the ``transformers`` engine's ``generate``.

        One vLLM request per completion, each with its own seed (``seed + call x batch + i``): a seed shared by
        the requests of a batch would give every copy of a prompt (TRL repeats each prompt ``num_generations``
        times) the same completion, and GRPO's group advantages would all be zero. Logprobs: see the module
        docstring."""
        _check_prompts(prompts, num_generations)
        filters = self.params.filters()
        flat = [[int(t) for t in p] for p in prompts for _ in range(num_generations)]
        base = None if self.seed is None else int(self.seed) + self._calls * len(flat)
        params = [self._sampling_params(None if base is None else base + i) for i in range(len(flat))]
        self._calls += 1
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in flat], sampling_params=params, use_tqdm=False)
        samples = []
        for req_out in outputs:
            (comp,) = req_out.outputs
            toks = list(comp.token_ids)
            lps = [float(step[tok].logprob) for step, tok in zip(comp.logprobs or [], toks, strict=False)]
            samples.append((toks, lps))
        completions, logprobs = trim_after_eos(samples, self.params.eos_token_ids)
        if filters:  # vLLM's are the filtered distribution's: score with the served weights, temperature only
            logprobs = teacher_forced_logps(
                self.model,
                flat,
                completions,
                temperature=self.params.temperature,
                pad_id=self.params.resolved_pad(),
            )
        return EngineOutput(flat, completions, logprobs)

    def close(self) -> None:
        """Release vLLM's engine and the private config folder (idempotent)."""
        release_llm(self, process_group=getattr(self, "_owns_process_group", False))
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None


def release_llm(owner: Any, *, process_group: bool = False) -> bool:
    """Shut down ``owner.llm`` (a ``vllm.LLM``, then set to None), then vLLM's model-parallel groups and, with
    ``process_group`` (one vLLM created), the default process group; best effort, the process may be exiting.
    Returns whether there was an engine."""
    llm = getattr(owner, "llm", None)
    if llm is None:
        return False
    owner.llm = None
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the engine is dropped either way
        pass
    del llm  # the last reference: vLLM's engine goes before its groups
    try:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        if process_group:
            destroy_distributed_environment()
    except Exception:  # noqa: BLE001
        pass
    return True
