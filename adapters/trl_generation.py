"""The TRL side of the rollout stage: what TRL calls where it would call vLLM, and what the stage may ask of TRL.

:class:`MrlGeneration` has the interface of ``trainer.vllm_generation`` (``sync_weights()``,
``generate(prompts, images, num_generations, profiler)``); with ``use_vllm=True`` TRL keeps its own sync schedule
(sync when ``global_step`` changed) and its importance-sampling correction, which uses the logprobs and weight
versions it gets back. To the rollout stage's runtime it is the host (:class:`~mrl_plugins.hookspecs.RolloutHost`):
its version and publishing, the next batch's prompts from TRL's dataloader read ahead (:class:`LookaheadLoader`),
how often TRL generates, its model. :func:`sampling_params` reads TRL's sampling settings; :func:`release_trl_vllm`
frees TRL's own vLLM engine. Every TRL member used here is in :mod:`mrl_plugins.adapters.trl_members`.
"""

from __future__ import annotations

import logging
import numbers
import time
from collections import deque
from collections.abc import Iterator
from contextlib import nullcontext
from typing import Any

from mrl_plugins.errors import ConfigError, PluginError, choices
from mrl_plugins.hookspecs import RolloutResult, StageContext
from mrl_plugins.rollout.arrangement import prompt_key
from mrl_plugins.rollout.engine import GEN_KWARGS, GEN_KWARGS_IGNORED, SamplingParams

log = logging.getLogger("mrl_plugins.adapters.trl")


class LookaheadIterator:
    """Iterator over the trainer's dataloader that can peek at batches it has not handed out yet."""

    def __init__(self, it: Iterator[Any]) -> None:
        self._it = it
        self._buf: deque[Any] = deque()
        self._done = False

    def __iter__(self) -> LookaheadIterator:
        return self

    def __next__(self) -> Any:
        if self._buf:
            return self._buf.popleft()
        return next(self._it)

    def peek(self, k: int) -> list[Any]:
        """Up to ``k`` upcoming batches without consuming them."""
        while len(self._buf) < k and not self._done:
            try:
                self._buf.append(next(self._it))
            except StopIteration:
                self._done = True
        return list(self._buf)[:k]


class LookaheadLoader:
    """Wraps the trainer's dataloader; ``current`` is the iterator the trainer is consuming."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self.current: LookaheadIterator | None = None

    def __iter__(self) -> LookaheadIterator:
        self.current = LookaheadIterator(iter(self._loader))
        return self.current

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


class MrlGeneration:
    """Stands in for ``trainer.vllm_generation``; calls the rollout stage's runtime (``runtime``, set by the adapter
    from ``RolloutStage.open_runtime``)."""

    def __init__(self, ctx: StageContext, trainer: Any) -> None:
        self.ctx = ctx
        self.trainer = trainer
        self.loader: LookaheadLoader | None = None
        self.version = -1
        self.metrics = ctx.metrics
        self.last_result: RolloutResult | None = None  # the latest generation (its ``scores`` feed ref_logps)
        self.runtime: Any = None  # a RolloutRuntime: generate() and publish()
        #: calls of generate() since TRL's rollout of the current batch began (:meth:`begin_rollout`): the first is
        #: the batch's first turn (the one the lookahead prepares), later ones are follow-up turns (TRL's tool loop)
        self.calls = 0
        #: TRL's rollouts are multi-turn here (tools, environments: the adapter calls :meth:`begin_rollout` per batch)
        self.multi_turn = False
        #: every call is a follow-up turn (a user's rollout_func: the plugin cannot know what it asks next)
        self.direct = False
        #: the runtime may read the next batch's prompts ahead (off where a rollout's prompts are not the dataset's)
        self.lookahead = True

    # ---------------------------------------------------------------- the host, as the runtime sees it
    @property
    def model(self) -> Any:
        """The trainer's model (unwrapped from DDP)."""
        return getattr(self.trainer.model, "module", self.trainer.model)

    def generation_interval(self) -> int:
        """Optimizer steps between two TRL generations: ``steps_per_generation x num_iterations / grad_accum``."""
        args = self.trainer.args
        micro = getattr(args, "steps_per_generation", None) or args.gradient_accumulation_steps
        micro *= max(1, getattr(self.trainer, "num_iterations", 1))
        return max(1, micro // max(1, args.gradient_accumulation_steps))

    def upcoming(self) -> list[Any]:
        """The dataloader's batches TRL has not taken yet, as far as the next generation's (peeked, not consumed;
        empty when the loader is not wrapped or not iterated yet)."""
        it = self.loader.current if self.loader is not None else None
        if it is None:
            return []
        args = self.trainer.args
        return it.peek(
            args.gradient_accumulation_steps
            + getattr(args, "steps_per_generation", 1) * max(1, getattr(self.trainer, "num_iterations", 1))
        )

    def next_prompts(self, current: list[list[int]]) -> list[list[int]] | None:
        """The prompt ids of the next batch TRL will generate for after ``current`` (its dataloader read ahead and
        tokenised as TRL tokenises), or None when the loader cannot tell."""
        key = prompt_key(current)
        for batch in self.upcoming():
            ids = self.trainer._tokenize_prompts([x["prompt"] for x in batch])[0]
            if prompt_key(ids) != key:
                return [list(p) for p in ids]
        return None

    def steps_left(self) -> int | None:
        """Optimizer steps TRL has left in this ``train()`` (``state.max_steps - global_step``; None before)."""
        state = getattr(self.trainer, "state", None)
        total = int(getattr(state, "max_steps", 0) or 0)
        return max(0, total - int(state.global_step)) if total > 0 else None

    def begin_rollout(self) -> None:
        """TRL begins generating a batch (its ``_generate``): the next call is that batch's first turn."""
        self.calls = 0

    # ---------------------------------------------------------------- TRL interface
    def sync_weights(self) -> None:
        """Publish the trainer's weights as version ``global_step``.

        Every training rank publishes: each rank owns its inference copy (an in-process engine or its own
        worker pool), so a rank that skipped this would generate with its first weights forever. Under
        ZeRO-3 the iteration is also the collective gather every rank must join.
        """
        from mrl_plugins.weight_sync.sources import iter_trainer_weights

        version = int(self.trainer.state.global_step)
        accelerator = getattr(self.trainer, "accelerator", None)
        t0 = time.perf_counter()
        tensors = iter_trainer_weights(self.trainer.model_wrapped, accelerator)
        rep = self.runtime.publish(version, tensors)
        self.version = version
        self.metrics.add("time/weight_sync_s", time.perf_counter() - t0)
        if rep is not None:
            self.metrics.add("weights/bytes", rep.nbytes)
            self.metrics.gauge("weights/version", version)

    def sync_weights_once(self) -> None:
        """:meth:`sync_weights` unless TRL already synced this ``global_step`` (its ``_last_loaded_step``, which it
        checks in ``_generate_single_turn``), for the places that generate without TRL's own sync point."""
        step = self.trainer.state.global_step
        if self.trainer._last_loaded_step != step:
            self.sync_weights()
            self.trainer._last_loaded_step = step

    def generate(self, prompts: list[list[int]], images: Any, num_generations: int, profiler: Any = None) -> tuple:
        if images is not None and any(i is not None for i in images):
            raise PluginError("mrl rollout: image prompts are not supported; set plugins.rollout: upstream")
        if not all(isinstance(p, list | tuple) and p and isinstance(p[0], numbers.Integral) for p in prompts):
            raise PluginError(
                f"vllm_generation.generate: prompts must be lists of token ids (as TRL passes them), got "
                f"{type(prompts[0]).__name__ if prompts else 'nothing'}; a rollout_func tokenises its prompts first"
            )
        follow_up = self.direct or (self.multi_turn and self.calls > 0)
        self.calls += 1
        with profiler or nullcontext():
            t0 = time.perf_counter()
            turn = getattr(self.runtime, "generate_turn", None) if follow_up else None
            result = turn(prompts, "policy") if turn is not None else self.runtime.generate(prompts, 1, "policy")
            self.metrics.add("time/generate_s", time.perf_counter() - t0)
        if follow_up:
            self.metrics.add("rollout/follow_up_turns", 1)
        self.last_result = result
        self.metrics.gauge("rollout/staleness", max(0, self.version - result.weight_version))
        logprobs = [[[lp] for lp in seq] for seq in result.logprobs]
        completions = [list(c) for c in result.completion_ids]  # TRL's tool loop edits the lists it gets in place
        return result.prompt_ids, completions, logprobs, None


def sampling_params(trainer: Any) -> SamplingParams:
    """A TRL ``GRPOTrainer``/``RLOOTrainer``'s sampling settings (the ones its generate path uses)."""
    args = getattr(trainer, "args", None)

    def pick(name: str, default: Any) -> Any:
        if hasattr(trainer, name):
            return getattr(trainer, name)
        return getattr(args, name, default)

    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)  # processors wrap a tokenizer
    eos = getattr(trainer, "eos_token_ids", None)
    if eos is None:
        eos = [] if getattr(tok, "eos_token_id", None) is None else [tok.eos_token_id]
    pad = getattr(tok, "pad_token_id", None)
    max_new = pick("max_completion_length", None)
    if max_new is None:
        raise ConfigError("sampling: the trainer has no max_completion_length (trainer or trainer.args)")
    values: dict[str, Any] = {
        "max_new_tokens": int(max_new),
        "temperature": float(pick("temperature", 1.0)),
        "top_p": float(pick("top_p", 1.0)),
        "top_k": pick("top_k", 0),
        "min_p": pick("min_p", None),
        "repetition_penalty": float(pick("repetition_penalty", 1.0)),
        "eos_token_ids": [int(t) for t in eos],
        "pad_token_id": None if pad is None else int(pad),
    }
    # TRL lets ``args.generation_kwargs`` override its generation config; honour what we implement
    for key, value in dict(getattr(args, "generation_kwargs", None) or {}).items():
        if key in GEN_KWARGS:
            target = GEN_KWARGS[key]
            if target == "eos_token_ids":
                value = [int(value)] if isinstance(value, int) else [int(v) for v in value]
            values[target] = value
        elif key == "do_sample" and not value:
            raise ConfigError("generation_kwargs.do_sample=False: greedy decoding is not supported by the engine")
        elif key not in GEN_KWARGS_IGNORED:
            raise ConfigError(
                f"generation_kwargs.{key}: not supported by the mrl rollout engine; "
                f"supported: {choices([*GEN_KWARGS, *GEN_KWARGS_IGNORED])}"
            )
    params = SamplingParams(**values)
    params.validate()
    return params


def release_trl_vllm(trainer: Any) -> bool:
    """Shut down the ``vllm.LLM`` that TRL built for a trainer made with ``use_vllm=True, vllm_mode="colocate"``.

    ``enable()`` replaces ``trainer.vllm_generation`` (generation and weight sync); TRL's own engine would otherwise
    keep its weights and KV cache in memory for nothing, and a second vLLM in the same process inherits its
    settings. vLLM's model-parallel groups go with it; the default process group (accelerate's in a multi-rank run)
    stays. Server mode holds no engine here (TRL's client is simply no longer called). Returns whether one was
    released."""
    import gc

    from mrl_plugins.rollout.vllm_engine import release_llm

    gen = getattr(trainer, "vllm_generation", None)
    if gen is None or not release_llm(gen):
        return False
    gc.collect()
    log.info("released TRL's own vLLM engine (use_vllm=True, colocate): the mrl rollout stage replaces it")
    return True
