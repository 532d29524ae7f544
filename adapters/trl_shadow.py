"""The next batch's whole multi-turn rollout, run ahead while the trainer trains: TRL tools and environments.

:class:`ShadowLookahead` runs **TRL's own code** for the next batch in a background thread of the trainer process, on
a *shadow* of the trainer: an object of the trainer's class whose per-batch attributes (the environment pool, the
batch's environments and tool dicts, the metrics, the token count) are its own and whose other attributes are the
trainer's. TRL is stopped right after ``_generate`` returns; when the trainer comes to that batch, its
``_generate_and_score_completions`` runs as usual on the shadow's environment instances and ``_generate`` result
(step by step: docs/agentic.md). Environment instances come from two sets used in turn, so the batch being trained on
and the one rolled out ahead never share one.

Where it runs: one training process (``accelerator.gather`` in TRL's rollout is then no collective), GRPO, the
split arrangement (the workers on their own cores; while taking turns the trainer's own model generates and nothing
runs ahead). The first batch, a batch the rollout ahead does not match, one too stale and image prompts take TRL's
own path on the main thread (follow-up turns still on the workers).
"""

from __future__ import annotations

import copy
import threading
import time
import types
from collections import defaultdict
from contextlib import contextmanager
from typing import Any

from mrl_plugins.errors import PluginError, StageTimeoutError


class _RolloutDone(Exception):  # noqa: N818 - control flow, not an error
    """Raised by the shadow's ``_generate`` to stop TRL right after the rollout (before scoring)."""

    def __init__(self, prompts: list[Any], out: tuple) -> None:
        super().__init__("rollout done")
        self.prompts, self.out = prompts, out


def batch_key(inputs: list[dict[str, Any]]) -> tuple[str, ...]:
    """A generation batch (the dataloader's rows) as a comparable key."""
    return tuple(repr(sorted(row.items(), key=lambda kv: kv[0])) for row in inputs)


class Rollout:
    """One batch rolled out ahead: its thread, TRL's ``_generate`` result, the environments it played, the
    observations their ``reset()`` returned, the metrics and token count TRL recorded, and one entry per generated
    turn ``(prompt_ids, completion_ids, logprobs, version)``."""

    def __init__(self, inputs: list[dict[str, Any]], index: int) -> None:
        self.key = batch_key(inputs)
        self.inputs = inputs
        self.index = index
        self.prompts: list[Any] | None = None
        self.out: tuple | None = None
        self.environments: list[Any] | None = None
        self.names: list[Any] = []
        self.observations: dict[int, Any] = {}  # id(environment) -> what its reset() answered
        self.metrics: dict[str, dict[str, list]] = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.tokens = 0
        self.turns: list[tuple[list[list[int]], list[list[int]], list[list[float]], int]] = []
        self.error: BaseException | None = None
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.cpu_s = 0.0
        self.thread: threading.Thread | None = None

    def oldest_version(self) -> int:
        return min((t[3] for t in self.turns), default=-1)

    def engine_s(self) -> float:
        return (self.finished or time.perf_counter()) - self.started


class ShadowLookahead:
    """Runs the next batch's rollout ahead (see the module docstring)."""

    def __init__(self, trainer: Any, state: Any, gen: Any, timeout: float) -> None:
        self.trainer, self.state, self.gen = trainer, state, gen
        self.timeout = timeout
        self.sets: list[dict[Any, list[Any]]] = [{}, {}]  # two environment sets, used in turn
        self.count = 0
        self.current: Rollout | None = None
        self.scheduled: tuple[list[dict[str, Any]], int] | None = None  # (inputs, optimizer step to start at)
        self.installed: Rollout | None = None  # the rollout TRL is consuming right now
        self._tokenizer: Any = None

    # ---------------------------------------------------------------- the batches
    current_key: tuple[str, ...] | None = None

    def note_current(self, inputs: list[dict[str, Any]]) -> None:
        """The generation batch TRL is on now (the next one is the first different batch the dataloader holds)."""
        self.current_key = batch_key(inputs)

    def next_inputs(self) -> list[dict[str, Any]] | None:
        """The next generation batch, read ahead in the trainer's dataloader (None where there is none)."""
        if self.current_key is None:
            return None
        for batch in self.gen.upcoming():
            if batch_key(batch) != self.current_key:
                return list(batch)
        return None

    # ---------------------------------------------------------------- starting
    def schedule(self, inputs: list[dict[str, Any]] | None) -> None:
        """After TRL generated a batch: run ``inputs`` (the next generation batch) ahead, now or one optimizer step
        before it is needed (TRL generates every ``steps_per_generation x num_iterations`` steps)."""
        if inputs is None or not self.gen.runtime.can_run_ahead():
            return
        every = self.gen.runtime.generation_interval()
        left = self.gen.steps_left()
        if left is not None and every >= left:
            return  # the run ends before that batch would be trained on
        step = int(self.trainer.state.global_step)
        if every <= 1:
            self._start(inputs)
        else:
            self.scheduled = (inputs, step + every - 1)

    def on_step_end(self, global_step: int) -> None:
        """After an optimizer step: publish it at once while a rollout runs ahead (its next turns use it), start a
        scheduled one that is due."""
        due = self.scheduled is not None and global_step >= self.scheduled[1]
        running = self.current is not None and self.current.finished is None
        if not (due or running):
            return
        self.gen.sync_weights_once()
        if due and self.gen.runtime.can_run_ahead():
            inputs, _ = self.scheduled
            self.scheduled = None
            self._start(inputs)

    def _start(self, inputs: list[dict[str, Any]]) -> None:
        if self.current is not None and self.current.thread is not None:
            self.current.thread.join(self.timeout)  # an unused one (data order changed): let it end first
        self.count += 1
        rollout = Rollout(inputs, self.count)
        self.current = rollout
        rollout.thread = threading.Thread(target=self._run, args=(rollout,), name="mrl-rollout-ahead", daemon=True)
        rollout.thread.start()

    # ---------------------------------------------------------------- the rollout (background thread)
    def _run(self, rollout: Rollout) -> None:
        cpu = time.thread_time()
        try:
            shadow = self._shadow(rollout)
            try:
                type(self.trainer)._generate_and_score_completions(shadow, rollout.inputs)
                raise RuntimeError("TRL's _generate_and_score_completions returned without generating")
            except _RolloutDone as done:
                rollout.prompts, rollout.out = done.prompts, done.out
            rollout.environments = shadow.__dict__.get("environments")
            rollout.names = list(shadow.__dict__.get("_batch_environments") or [])
            rollout.tokens = int(shadow.state.num_input_tokens_seen)
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread when it takes the batch
            rollout.error = exc
        finally:
            rollout.finished = time.perf_counter()
            rollout.cpu_s = time.thread_time() - cpu  # what the thread took of the trainer's cores
            for instances in self.sets[rollout.index % 2].values():
                for env in instances:
                    env.__dict__.pop("reset", None)  # the recording wrapper

    def _shadow(self, rollout: Rollout) -> Any:
        """The trainer's stand-in for this batch (its per-batch attributes its own, see the module docstring)."""
        from mrl_plugins.adapters.trl_tools import bound_tool_dicts

        trainer, gen = self.trainer, self.gen
        cls = type(trainer)
        if self._tokenizer is None:  # the trainer's thread tokenises meanwhile: a fast tokenizer is not shareable
            self._tokenizer = copy.deepcopy(trainer.processing_class)
        tok = self._tokenizer
        shadow_cls = type(f"Shadow{cls.__name__}", (cls,), {"__getattr__": _forward})
        shadow = object.__new__(shadow_cls)
        pool = self.sets[rollout.index % 2]
        shadow.__dict__.update(
            **self._schemas(),
            _mrl_host=trainer,
            _metrics=rollout.metrics,
            state=types.SimpleNamespace(num_input_tokens_seen=0, global_step=int(trainer.state.global_step)),
            processing_class=tok,
            _tokenizer=getattr(tok, "tokenizer", tok),
            _environment_pool=pool,
            environments=None,
        )

        def generate(prompts: list[Any]) -> Any:  # TRL's environments are reset: roll out, then stop TRL
            raise _RolloutDone(prompts, cls._generate(shadow, prompts))

        def tool_call_loop(*args: Any, **kwargs: Any) -> Any:
            bound_tool_dicts(shadow, self.state.ctx.config.rollout.tool_timeout_s)
            return cls._tool_call_loop(shadow, *args, **kwargs)

        def generate_single_turn(prompt_ids: list[list[int]], images: Any, *rest: Any, **kw: Any) -> tuple:
            result = gen.runtime.generate_turn([list(p) for p in prompt_ids], "policy", ahead=True)
            rollout.turns.append((result.prompt_ids, result.completion_ids, result.logprobs, result.weight_version))
            return [list(c) for c in result.completion_ids], [list(lp) for lp in result.logprobs]  # TRL edits them

        shadow.__dict__.update(
            _generate=generate, _tool_call_loop=tool_call_loop, _generate_single_turn=generate_single_turn
        )
        self._record_resets(shadow, rollout)
        return shadow

    _tool_schemas: dict[str, Any] | None = None

    def _schemas(self) -> dict[str, Any]:
        """The trainer's ``tools`` / ``_env_tools`` as JSON schemas, made once: the functions are only rendered into
        prompts and read back by the parser, which otherwise convert every function's type hints and docstring again
        for every completion of every turn (measured: a sixth of the thread's CPU time on the tool task). The tool
        dicts TRL calls keep the functions themselves."""
        if self._tool_schemas is None:
            from transformers.utils import get_json_schema

            def convert(tools: Any) -> Any:
                return [t if isinstance(t, dict) else get_json_schema(t) for t in tools] if tools else tools

            trainer = self.trainer
            try:
                out = {"tools": convert(trainer.tools)}
                env_tools = getattr(trainer, "_env_tools", None)
                if env_tools:
                    out["_env_tools"] = {name: convert(tools) for name, tools in env_tools.items()}
            except Exception:  # noqa: BLE001 - a tool transformers cannot describe: TRL converts it each time
                out = {}
            self._tool_schemas = out
        return self._tool_schemas

    def _record_resets(self, shadow: Any, rollout: Rollout) -> None:
        """Give the shadow's pool as many instances of each environment as the batch draws (so TRL creates none),
        each with a ``reset`` that records what it answers (an instance attribute, removed after the rollout)."""
        factories = self.trainer.environment_factories
        if not factories:
            return
        multi = bool(getattr(self.trainer, "_multi_environment", False))
        pool = shadow.__dict__["_environment_pool"]
        need: dict[Any, int] = {}
        for row in rollout.inputs:
            name = row.get("environment") if multi else None
            need[name] = need.get(name, 0) + 1
        for name, count in need.items():
            if name not in factories:
                continue  # TRL's own check names the unknown environment
            instances = pool.setdefault(name, [])
            while len(instances) < count:
                instances.append(factories[name]())
            for env in instances:
                env.reset = _recording(env, rollout)

    # ---------------------------------------------------------------- consuming (the trainer's thread)
    def take(self, inputs: list[dict[str, Any]]) -> Rollout | None:
        """The rollout run ahead for ``inputs`` (waited for, at most the rollout timeout), or None."""
        rollout = self.current
        if rollout is None or rollout.key != batch_key(inputs):
            return None
        self.current = None
        rollout.thread.join(self.timeout)
        if rollout.thread.is_alive():
            raise StageTimeoutError(
                f"rollout ahead: batch not rolled out within {self.timeout:.0f} s (timeout_s): a tool or a "
                "turn is still running"
            )
        if rollout.error is not None:
            from mrl_plugins.rollout.runtime import AheadUnavailable

            if isinstance(rollout.error, AheadUnavailable):  # e.g. an eval batch switched the run to taking turns
                self.state.ctx.metrics.add("rollout/ahead_abandoned", 1)
                return None
            raise rollout.error
        return rollout

    @contextmanager
    def consuming(self, rollout: Rollout) -> Any:
        """TRL takes ``rollout`` for this call: its environments drawn in order, their resets answered as before,
        ``_generate`` answered by the installed rollout (see :meth:`answer`)."""
        trainer = self.trainer
        saved_pool = trainer.__dict__.get("_environment_pool", _MISSING)
        envs = rollout.environments or []
        if envs:
            order: dict[Any, list[Any]] = {}
            for name, env in zip(rollout.names, envs, strict=True):
                order.setdefault(name, []).append(env)
            trainer._environment_pool = order
            for env in envs:
                env.reset = _answer(rollout.observations.get(id(env)))
        self.installed = rollout
        try:
            yield
        finally:
            self.installed = None
            for env in envs:
                env.__dict__.pop("reset", None)
            if saved_pool is _MISSING:
                trainer.__dict__.pop("_environment_pool", None)
            else:
                trainer._environment_pool = saved_pool

    def answer(self, prompts: list[Any]) -> tuple | None:
        """``_generate``'s result for the rollout being consumed (its metrics added to the trainer's), or None."""
        rollout = self.installed
        if rollout is None:
            return None
        if prompts != rollout.prompts:
            raise PluginError("rollout ahead: TRL's prompts differ from the ones rolled out (environment reset?)")
        trainer = self.trainer
        trainer.state.num_input_tokens_seen += rollout.tokens
        for key, values in rollout.metrics["train"].items():
            if key != "num_tokens":
                trainer._metrics["train"][key].extend(values)
        trainer._metrics["train"]["num_tokens"] = [trainer.state.num_input_tokens_seen]
        return rollout.out

    def close(self) -> None:
        """No more rollouts ahead; one in flight gets a few seconds to end (its thread is a daemon)."""
        rollout, self.current, self.scheduled = self.current, None, None
        if rollout is not None and rollout.thread is not None:
            rollout.thread.join(min(self.timeout, CLOSE_GRACE_S))


_MISSING = object()
#: seconds a rollout in flight gets to end when the run does
CLOSE_GRACE_S = 5.0


def _forward(self: Any, name: str) -> Any:
    """The shadow's attributes it does not hold itself are the trainer's."""
    host = self.__dict__.get("_mrl_host")
    if host is None:
        raise AttributeError(name)
    return getattr(host, name)


def _recording(env: Any, rollout: Rollout) -> Any:
    """``env``'s own ``reset``, recording what it returns under ``id(env)``."""
    original = type(env).reset

    def reset(**kwargs: Any) -> Any:
        observation = original(env, **kwargs)
        rollout.observations[id(env)] = observation
        return observation

    return reset


def _answer(observation: Any) -> Any:
    def reset(**kwargs: Any) -> Any:
        return observation

    return reset


__all__ = ["Rollout", "ShadowLookahead", "batch_key"]
