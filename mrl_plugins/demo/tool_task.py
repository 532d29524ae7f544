"""A task that needs a tool: two-number arithmetic that a calculator answers, built in code (no hub access).

The prompt is a conversation, ``[{"role": "user", "content": "what is 37 + 48"}]``; the tools are ``add(a, b)`` and
``subtract(a, b)``. A solved rollout takes two turns: the policy calls the tool (``<call> add { "a" : 37 , "b" : 48 }
</call> <eos>``), TRL runs it and appends the result (``<result> 85``), and the policy states the answer (``85
<eos>``). :func:`arithmetic_reward` gives 1 for the right final answer, :data:`CALL_CREDIT` for a well-formed call of
the right tool with the right operands that did not end in the right answer, 0 otherwise; the sum of two numbers
below 100 is one of 199 words, so a policy that does not use the tool scores about 0.

The tokenizer (:func:`build_tool_tokenizer`) is word-level: one token per word, every number 0..199 one word, and a
chat template with tool support (``apply_chat_template(..., tools=[...])`` renders each tool's name and parameters).
Its ``response_template`` (transformers >= 5.13) lets ``tokenizer.parse_response`` -- and so TRL's tool loop -- read
the policy's tool calls; the rendering keeps every earlier message's tokens as they were when later messages are
added (TRL's prefix check and ``_get_tool_suffix_ids``). Everything here imports only the standard library at module
level; :mod:`mrl_plugins.demo.models` builds the ``tiny-tools`` preset from it (briefly trained with :func:`sft`).

The tools: :func:`calculator_tools` (the tests' async, raising and hanging variants are in tests/tool_helpers.py) and
the environments :class:`CalculatorEnv` (both tools), :class:`AddEnv` and :class:`SubtractEnv` (one each, for a dict
of factories), whose ``get_reward`` reads only their own state.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

SPECIAL = ("<pad>", "<eos>", "<unk>")
#: the words of the chat format (roles, tool-call markup, JSON punctuation) and of the questions
MARKUP = (
    "<system>", "<user>", "<assistant>", "<result>", "<tool>", "<call>", "</call>",
    "{", "}", ":", ",", '"a"', '"b"', "what", "is", "+", "-", "add", "subtract",
)  # fmt: skip
#: operands are 0..MAX_OPERAND; every number up to twice that is one word
MAX_OPERAND = 99
NUMBERS = tuple(str(i) for i in range(2 * MAX_OPERAND + 1))
#: the two operations: question symbol -> tool name
OPS = {"+": "add", "-": "subtract"}
#: reward of a well-formed call of the right tool with the right operands whose rollout missed the answer
CALL_CREDIT = 0.25

#: Jinja chat template: tokens separated by spaces (the tokenizer splits on whitespace); an assistant turn ends
#: with ``<eos>`` (where generation stops, also after a tool call); each tool result follows as ``<result> ...``
CHAT_TEMPLATE = (
    "{% if tools %}{% for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}"
    "<tool> {{ f.name }} {% if f.parameters is defined and f.parameters.properties is defined %}"
    '{% for p in f.parameters.properties %}"{{ p }}" {% endfor %}{% endif %}{% endfor %}{% endif %}'
    "{% for m in messages %}"
    "{% if m.role == 'system' %}<system> {{ m.content }} "
    "{% elif m.role == 'user' %}<user> {{ m.content }} "
    "{% elif m.role == 'assistant' %}<assistant> {% if m.content %}{{ m.content }} {% endif %}"
    "{% for call in m.tool_calls or [] %}{% set f = call.function if call.function is defined else call %}"
    "<call> {{ f.name }} "
    "{% if f.arguments is string %}{{ f.arguments }} "
    '{% else %}{ {% for k, v in f.arguments.items() %}"{{ k }}" : {{ v | tojson }} {% if not loop.last %}, '
    "{% endif %}{% endfor %}} {% endif %}</call> {% endfor %}<eos> "
    "{% elif m.role == 'tool' %}<result> {{ m.content }} "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<assistant> {% endif %}"
)

#: how ``tokenizer.parse_response`` (transformers >= 5.13) reads an assistant turn: ``<call> NAME {json} </call>``
#: is a tool call (repeatable), the rest up to ``<eos>`` is the content
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<assistant>",
    "fields": {
        "tool_calls": {
            "open_pattern": r"<call>\s*(?P<name>[A-Za-z_][A-Za-z0-9_]*)\s*",
            "close_pattern": r"\s*</call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}},
        },
        "content": {"close_pattern": r"\s*<eos>\s*", "content": "text"},
    },
}


def vocabulary() -> dict[str, int]:
    """Token -> id of the tool tokenizer (special tokens first)."""
    return {tok: i for i, tok in enumerate(SPECIAL + MARKUP + NUMBERS)}


def word_level_tokenizer(tokens: Any) -> Any:
    """A WordLevel tokenizer over ``tokens`` (ids in their order; :data:`SPECIAL` among them) that splits on
    whitespace, wrapped as a left-padding fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tool_tokenizer() -> Any:
    """The word-level tokenizer with :data:`CHAT_TEMPLATE` and :data:`RESPONSE_TEMPLATE` (left padding)."""
    fast = word_level_tokenizer(vocabulary())
    fast.chat_template = CHAT_TEMPLATE
    fast.response_template = RESPONSE_TEMPLATE
    return fast


def _problem(rng: random.Random, op: str) -> tuple[int, int]:
    a, b = rng.randint(0, MAX_OPERAND), rng.randint(0, MAX_OPERAND)
    return (max(a, b), min(a, b)) if op == "-" else (a, b)  # differences stay >= 0


def answer_of(a: int, b: int, op: str) -> int:
    """The right answer to ``a op b``."""
    return a + b if op == "+" else a - b


def question(a: int, b: int, op: str) -> str:
    return f"what is {a} {op} {b}"


ENV_MODES = (None, "single", "dict")


def build_tool_dataset(n: int = 256, *, seed: int = 0, env: str | None = None) -> Any:
    """A ``datasets.Dataset`` of ``n`` problems: columns ``prompt`` (a conversation), ``a``, ``b``, ``op``, ``answer``.

    ``env=None``: the prompt asks the whole question, for ``tools=`` (:func:`calculator_tools`). ``env="single"``
    (:class:`CalculatorEnv`) and ``env="dict"`` (``{"add": AddEnv, "subtract": SubtractEnv}`` by the added
    ``environment`` column): the prompt is only ``what is``, the environment's ``reset`` appends the numbers.
    """
    from datasets import Dataset

    from mrl_plugins.errors import ConfigError, choices

    if env not in ENV_MODES:
        raise ConfigError(f"env: {env!r} is not a dataset kind; valid: None, {choices(m for m in ENV_MODES if m)}")
    rng = random.Random(seed)
    rows: dict[str, list[Any]] = {"prompt": [], "a": [], "b": [], "op": [], "answer": []}
    for _ in range(n):
        op = rng.choice(tuple(OPS))
        a, b = _problem(rng, op)
        text = "what is" if env else question(a, b, op)
        for key, value in (("prompt", [{"role": "user", "content": text}]), ("a", a), ("b", b), ("op", op)):
            rows[key].append(value)
        rows["answer"].append(answer_of(a, b, op))
    if env == "dict":
        rows["environment"] = [OPS[op] for op in rows["op"]]
    return Dataset.from_dict(rows)


def _calls(completion: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for message in completion:
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            out.append((function.get("name"), function.get("arguments")))
    return out


def final_answer(completion: list[dict[str, Any]] | str) -> str | None:
    """The content of the completion's last assistant message (stripped), or ``None`` without one."""
    if isinstance(completion, str):
        return completion.replace("<eos>", " ").strip()
    for message in reversed(completion):
        if message.get("role") == "assistant":
            return str(message.get("content") or "").replace("<eos>", " ").strip()
    return None


def arithmetic_reward(completions: list[Any], a: list[int], b: list[int], op: list[str], **kwargs: Any) -> list[float]:
    """1.0 for the right final answer, :data:`CALL_CREDIT` for a right call (tool and operands) without it, else 0."""
    out = []
    for completion, x, y, o in zip(completions, a, b, op, strict=True):
        if final_answer(completion) == str(answer_of(x, y, o)):
            out.append(1.0)
        elif not isinstance(completion, str) and (OPS[o], {"a": x, "b": y}) in _calls(completion):
            out.append(CALL_CREDIT)
        else:
            out.append(0.0)
    return out


def _check_operands(a: int, b: int) -> None:
    for name, value in (("a", a), ("b", b)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an integer, got {value!r}")


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    _check_operands(a, b)
    return a + b


def subtract(a: int, b: int) -> int:
    """Subtract the second number from the first.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    _check_operands(a, b)
    return a - b


def calculator_tools() -> list[Callable[..., Any]]:
    """``[add, subtract]`` as TRL's ``tools=`` takes them (plain functions)."""
    return [add, subtract]


class _ArithmeticEnv:
    """Base of the environments: ``reset`` keeps the problem (the target stays hidden from the policy) and returns
    the numbers as an observation TRL appends to the prompt; ``get_reward`` is 1.0 when the last tool call of the
    rollout was the right tool on the right operands (its result is the hidden target), else 0.0. On a prompt that
    already asks the whole question (``build_tool_dataset(env=None)``) ``reset`` returns None. Public methods
    of the subclasses are the tools; ``calls`` records every call ``(name, a, b, result)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any, Any, Any]] = []
        self.problem: tuple[int, int, str] | None = None

    def reset(self, a: int, b: int, op: str, prompt: Any = None, **example: Any) -> str | None:
        self.calls = []
        self.problem = (int(a), int(b), op)
        asked = prompt[-1]["content"] if isinstance(prompt, list) and prompt else prompt
        if isinstance(asked, str) and asked.endswith(question(a, b, op)):
            return None  # the prompt asks the whole question already (a tools= dataset)
        return f" {a} {op} {b}"

    def get_reward(self) -> float:
        if self.problem is None or not self.calls:
            return 0.0
        a, b, op = self.problem
        name, x, y, result = self.calls[-1]
        return 1.0 if (name, x, y) == (OPS[op], a, b) and result == answer_of(a, b, op) else 0.0

    def _call(self, fn: Callable[[int, int], int], a: int, b: int) -> int:
        try:
            result = fn(a, b)
        except Exception as e:
            self.calls.append((fn.__name__, a, b, e))
            raise
        self.calls.append((fn.__name__, a, b, result))
        return result


class AddEnv(_ArithmeticEnv):
    """Only ``add``; with :class:`SubtractEnv` in ``{"add": AddEnv, "subtract": SubtractEnv}`` (``env="dict"``)."""

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return self._call(add, a, b)


class SubtractEnv(_ArithmeticEnv):
    """Only ``subtract``; see :class:`AddEnv`."""

    def subtract(self, a: int, b: int) -> int:
        """Subtract the second number from the first.

        Args:
            a: The number to subtract from.
            b: The number to subtract.
        """
        return self._call(subtract, a, b)


class CalculatorEnv(AddEnv, SubtractEnv):
    """Both tools (TRL lists an environment's tools on its class, inherited ones included); for
    ``environment_factory=CalculatorEnv`` on ``build_tool_dataset(env="single")``."""


def environment_factories(env: str = "single") -> Any:
    """What ``environment_factory=`` takes for a :func:`build_tool_dataset` of that ``env`` kind."""
    from mrl_plugins.errors import ConfigError, choices

    if env == "single":
        return CalculatorEnv
    if env == "dict":
        return {"add": AddEnv, "subtract": SubtractEnv}
    raise ConfigError(f"env: {env!r} is not an environment kind; valid: {choices(m for m in ENV_MODES if m)}")


#: the tool tasks of the embedded job (``train.task``): TRL gets the tools as ``tools=`` or ``environment_factory=``
TASKS = ("tools", "environment", "environments")


def trainer_inputs(task: str = "tools", *, n: int = 512, seed: int = 0) -> dict[str, Any]:
    """The ``GRPOTrainer`` keyword arguments of a tool task: ``train_dataset``, ``reward_funcs`` and ``tools``
    (:func:`calculator_tools`) or ``environment_factory``.

    ``tools``: :func:`arithmetic_reward` scores the answer. ``environment`` (one :class:`CalculatorEnv` factory) and
    ``environments`` (``{"add": AddEnv, "subtract": SubtractEnv}``, routed by the dataset's ``environment``
    column): the environments own the reward (``get_reward``), ``reward_funcs`` is empty.
    """
    from mrl_plugins.errors import ConfigError, choices

    if task not in TASKS:
        raise ConfigError(f"task: {task!r} is not a tool task; valid: {choices(TASKS)}")
    if task == "tools":
        return {
            "train_dataset": build_tool_dataset(n, seed=seed),
            "reward_funcs": arithmetic_reward,
            "tools": calculator_tools(),
        }
    env = "single" if task == "environment" else "dict"
    return {
        "train_dataset": build_tool_dataset(n, seed=seed, env=env),
        "reward_funcs": [],
        "environment_factory": environment_factories(env),
    }


#: the SFT recipe of the ``tiny-tools`` preset (part of its cache key): AdamW, linear warm-up then cosine decay;
#: ``direct_share`` of the examples answer at once with a guess (no tool), so the preset calls the tool only about
#: two times in three and GRPO has something to learn. Version 2 decays the learning rate to 0 over 1000 steps: at a
#: constant 3e-3 for 600 the result depended on the host's floating-point sums (an AVX-512/AMX host ended at a
#: tool-call rate of 0.26 where others had 0.5-0.9); decayed over 600, the calls converged (0.66-0.72) but the answer
#: after a tool's result was right 0.80 of the time; over 1000, 0.98-1.0 (seeds 0 and 1, 2026-12-04)
SFT_RECIPE: dict[str, Any] = {
    "version": 2,
    "steps": 1000,
    "batch": 32,
    "lr": 3e-3,
    "warmup": 30,
    "decay": True,
    "direct_share": 0.35,
    "single_tool_share": 0.3,
}


def tool_schemas() -> list[dict[str, Any]]:
    """The JSON schemas ``apply_chat_template`` renders for :func:`calculator_tools`."""
    from transformers.utils import get_json_schema

    return [get_json_schema(t) for t in calculator_tools()]


def sft_example(
    tokenizer: Any, rng: random.Random, *, direct_share: float, single_tool_share: float, schemas: list | None = None
) -> tuple[list[int], list[int]]:
    """One SFT sequence ``(input_ids, labels)`` as TRL's tool loop builds it: prompt (rendered with both tools, or
    with ``single_tool_share`` only the one it needs, as in a dict of environments), call turn, tool suffix, answer
    turn; labels are -100 on the prompt and on the tool result (the model learns only its own turns). With
    ``direct_share`` the assistant answers at once with a random guess instead (no tool)."""
    schemas = schemas or tool_schemas()
    op = rng.choice(tuple(OPS))
    a, b = _problem(rng, op)
    tools = [s for s in schemas if s["function"]["name"] == OPS[op]] if rng.random() < single_tool_share else schemas
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question(a, b, op)}],
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    answer = answer_of(a, b, op)
    if rng.random() < direct_share:
        guess = tokenizer(f"{rng.randint(0, 2 * MAX_OPERAND)} <eos>")["input_ids"]
        return prompt + guess, [-100] * len(prompt) + guess
    call = tokenizer(f'<call> {OPS[op]} {{ "a" : {a} , "b" : {b} }} </call> <eos>')["input_ids"]
    suffix = tokenizer(f"<result> {answer} <assistant>")["input_ids"]
    final = tokenizer(f"{answer} <eos>")["input_ids"]
    return prompt + call + suffix + final, [-100] * len(prompt) + call + [-100] * len(suffix) + final


def sft(model: Any, tokenizer: Any, *, seed: int = 0, recipe: dict[str, Any] | None = None) -> list[float]:
    """Train ``model`` in place on :func:`sft_example` batches; returns the loss per step.

    Deterministic given ``seed``: the data come from ``random.Random(seed)``, torch's RNG is forked and seeded, and
    the run uses one torch thread (restored afterwards) so that the sums come out the same on any host.
    """
    import math

    import torch

    r = {**SFT_RECIPE, **(recipe or {})}
    rng = random.Random(seed)
    schemas = tool_schemas()
    threads = torch.get_num_threads()
    losses = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        try:
            opt = torch.optim.AdamW(model.parameters(), lr=r["lr"], weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(
                opt,
                lambda s: (
                    min(1.0, (s + 1) / r["warmup"])
                    * (0.5 * (1 + math.cos(math.pi * min(1.0, s / max(1, r["steps"])))) if r["decay"] else 1.0)
                ),
            )
            model.train()
            for _ in range(r["steps"]):
                rows = [
                    sft_example(
                        tokenizer,
                        rng,
                        direct_share=r["direct_share"],
                        single_tool_share=r["single_tool_share"],
                        schemas=schemas,
                    )
                    for _ in range(r["batch"])
                ]
                width = max(len(ids) for ids, _ in rows)
                ids = torch.full((len(rows), width), tokenizer.pad_token_id)
                labels = torch.full((len(rows), width), -100)
                mask = torch.zeros((len(rows), width), dtype=torch.long)
                for i, (x, y) in enumerate(rows):  # right padding: positions match an unpadded prompt's
                    ids[i, : len(x)], labels[i, : len(y)], mask[i, : len(x)] = torch.tensor(x), torch.tensor(y), 1
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                losses.append(loss.item())
        finally:
            torch.set_num_threads(threads)
    model.eval()
    return losses
