"""The tool task (:mod:`mrl_plugins.demo.tool_task`) on real TRL: its chat template renders tools and TRL's own helpers
parse the calls and append the results; the ``tiny-tools`` preset (SFT in code, cached) calls the tool at a measured
rate; vanilla TRL ``GRPOTrainer`` with ``tools=`` and with ``environment_factory=`` (single and dict, ``get_reward``)
raises the reward. One torch thread throughout.

The slow tests share the preset through the default cache (``$MRL_CACHE_DIR`` or ``~/.cache/mrl_plugins``): the first
process trains it (about 40 s on one quiet core), later ones load it.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time

import pytest

from tests.marks import require_trl, require_vllm
from tests.tool_helpers import logged, tool_call_rate, tool_trainer

pytestmark = require_trl

CALL = '<call> add { "a" : 37 , "b" : 48 } </call> <eos>'
QUESTION = [{"role": "user", "content": "what is 37 + 48"}]


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_model(seed=0):
    from mrl_plugins.demo.models import PRESETS, _llama
    from mrl_plugins.demo.tool_task import build_tool_tokenizer

    tok = build_tool_tokenizer()
    return _llama(PRESETS["tiny-tools"], tok, seed), tok


def _rendered(tok, ds, tools):
    """The dataset's prompts rendered with the tools, padded, as tensors (what a batch of generation takes)."""
    return tok.apply_chat_template(
        list(ds["prompt"]),
        tools=tools,
        add_generation_prompt=True,
        padding=True,
        return_dict=True,
        return_tensors="pt",
    )


def _grpo(tmp_path, model, tok, *, steps, task="tools", variant="sync", seed=0, reward_funcs=None, **args):
    """A vanilla TRL GRPOTrainer on the tool task with the ``tiny-tools`` preset's settings."""
    inputs = {} if reward_funcs is None else {"reward_funcs": reward_funcs}
    return tool_trainer(
        tmp_path, steps=steps, task=task, variant=variant, seed=seed, model=(model, tok), inputs=inputs, **args
    )


# --------------------------------------------------------------------------- template and parsing (no training)


def test_template_renders_tools_and_trl_parses_calls_and_appends_results(tmp_path):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import is_chat_template_prefix_preserving, parse_response, supports_tool_calling

    from mrl_plugins.demo.tool_task import calculator_tools, sft_example

    model, tok = _random_model()
    tools = calculator_tools()
    prompt = tok.apply_chat_template(
        QUESTION, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert tok.convert_ids_to_tokens(prompt) == (
        '<tool> add "a" "b" <tool> subtract "a" "b" <user> what is 37 + 48 <assistant>'.split()
    )
    assert tok.unk_token_id not in prompt
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)

    def parse(text, prefix=prompt):
        return parse_response(tok, tok(text)["input_ids"], prefix=prefix, tools=tools)

    call = parse(CALL)
    assert call["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 37, "b": 48}}}]
    assert call["content"] == ""
    assert parse("85 <eos>") == {"role": "assistant", "content": "85"}
    assert "tool_calls" not in parse('<call> add { "a" : 37 , "b" <eos>')  # malformed JSON: plain text
    two = parse('<call> add { "a" : 1 , "b" : 2 } </call> <call> subtract { "a" : 3 , "b" : 1 } </call> <eos>')
    assert [c["function"]["name"] for c in two["tool_calls"]] == ["add", "subtract"]

    # TRL's own trainer: it accepts the template (tool support, response_template, prefix-preserving: no
    # replacement template) and appends a tool result with its EOS-trimmed prefix logic
    trainer = _grpo(tmp_path, model, tok, steps=1)
    assert trainer.chat_template is None
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": "add", "content": "85"}])
    assert tok.convert_ids_to_tokens(suffix) == ["<result>", "85", "<assistant>"]
    # what SFT trained on is token for token the conversation TRL's tool loop builds
    conversation = [
        *QUESTION,
        {"role": "assistant", "content": "", "tool_calls": call["tool_calls"]},
        {"role": "tool", "name": "add", "content": "85"},
        {"role": "assistant", "content": "85"},
    ]
    rendered = tok.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False)
    assert rendered == prompt + tok(CALL)["input_ids"] + suffix + tok("85 <eos>")["input_ids"]
    assert parse("85 <eos>", prefix=prompt + tok(CALL)["input_ids"] + suffix)["content"] == "85"

    rng = random.Random(5)
    for _ in range(50):
        ids, labels = sft_example(tok, rng, direct_share=0.35, single_tool_share=0.3)
        words = tok.convert_ids_to_tokens(ids)
        if "<call>" in words and words.count("<tool>") == 2:
            break
    a, op, b = words[words.index("what") + 2 : words.index("what") + 5]
    name, answer = {"+": ("add", int(a) + int(b)), "-": ("subtract", int(a) - int(b))}[op]
    example = [
        {"role": "user", "content": f"what is {a} {op} {b}"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {"a": int(a), "b": int(b)}}}]},
        {"role": "tool", "name": name, "content": str(answer)},
        {"role": "assistant", "content": str(answer)},
    ]  # fmt: skip
    assert ids == tok.apply_chat_template(example, tools=tools, tokenize=True, return_dict=False)
    learned = tok.decode([t for t, lab in zip(ids, labels, strict=True) if lab != -100])
    assert learned == f'<call> {name} {{ "a" : {a} , "b" : {b} }} </call> <eos> {answer} <eos>'

    # the saved preset folder reloads with AutoTokenizer to the same template, parser and tokens
    model.save_pretrained(tmp_path / "folder")
    tok.save_pretrained(tmp_path / "folder")
    again = AutoTokenizer.from_pretrained(tmp_path / "folder")
    assert again.chat_template == tok.chat_template and again.response_template == tok.response_template
    assert again.padding_side == "left" and again.get_vocab() == tok.get_vocab()
    assert again.apply_chat_template(QUESTION, tools=tools, add_generation_prompt=True, return_dict=False) == prompt
    assert parse_response(again, tok(CALL)["input_ids"], prefix=prompt, tools=tools) == call


def test_reward_scores_answers_and_calls_and_an_untrained_policy_scores_about_zero():
    import torch
    from trl.chat_template_utils import parse_response

    from mrl_plugins.demo.tool_task import arithmetic_reward, build_tool_dataset, calculator_tools

    def call(name, a, b):
        return {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
            "name": name, "arguments": {"a": a, "b": b}}}]}  # fmt: skip

    solved = [
        call("add", 37, 48),
        {"role": "tool", "name": "add", "content": "85"},
        {"role": "assistant", "content": "85"},
    ]
    right_call = [*solved[:2], {"role": "assistant", "content": "84"}]
    wrong_call = [call("add", 37, 84), {"role": "tool", "name": "add", "content": "121"}]
    wrong_tool = [call("subtract", 37, 48)]
    guessed = [{"role": "assistant", "content": "85"}]  # the right answer without the tool still counts
    rewards = arithmetic_reward(
        [solved, right_call, wrong_call, wrong_tool, guessed, [{"role": "assistant", "content": "12"}]],
        a=[37] * 6,
        b=[48] * 6,
        op=["+"] * 6,
    )
    assert rewards == [1.0, 0.25, 0.0, 0.0, 1.0, 0.0]
    assert arithmetic_reward([[{"role": "assistant", "content": "11"}]], a=[48], b=[37], op=["-"]) == [1.0]

    model, tok = _random_model(seed=1)
    ds = build_tool_dataset(32, seed=3)
    assert set(ds.column_names) == {"prompt", "a", "b", "op", "answer"} and set(ds["op"]) == {"+", "-"}
    tools = calculator_tools()
    batch = _rendered(tok, ds, tools)
    torch.manual_seed(0)
    out = model.generate(**batch, max_new_tokens=24, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    width = batch["input_ids"].shape[1]
    completions = []
    for i in range(len(ds)):
        ids = out[i, width:].tolist()
        ids = ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids
        prefix = [t for t, m in zip(batch["input_ids"][i].tolist(), batch["attention_mask"][i].tolist()) if m]
        completions.append([parse_response(tok, ids, prefix=prefix, tools=tools)])
    assert tool_call_rate(completions) < 0.1
    assert statistics.mean(arithmetic_reward(completions, **{k: list(ds[k]) for k in ("a", "b", "op")})) < 0.05


def test_calculator_variants_and_environments():
    from mrl_plugins.demo.tool_task import (
        AddEnv,
        CalculatorEnv,
        SubtractEnv,
        build_tool_dataset,
        environment_factories,
        trainer_inputs,
    )
    from mrl_plugins.errors import ConfigError
    from tests.tool_helpers import calculator_tools

    for variant in ("sync", "async", "raises", "hangs", "hangs_async"):
        tools = calculator_tools(variant, hang_s=0.05)
        assert [t.__name__ for t in tools] == ["add", "subtract"], variant
        assert all("Args:" in t.__doc__ for t in tools)
    add, sub = calculator_tools()
    assert (add(37, 48), sub(48, 37)) == (85, 11)
    with pytest.raises(TypeError, match="integer"):
        add("37", 48)
    aadd, _ = calculator_tools("async")
    assert asyncio.iscoroutinefunction(aadd) and asyncio.run(aadd(2, 3)) == 5
    radd, _ = calculator_tools("raises")
    with pytest.raises(RuntimeError, match="add is out of order"):
        radd(1, 2)
    hadd, _ = calculator_tools("hangs", hang_s=0.2)
    t0 = time.monotonic()
    assert hadd(1, 2) == 3 and time.monotonic() - t0 >= 0.2
    hasync, _ = calculator_tools("hangs_async", hang_s=0.2)
    t0 = time.monotonic()
    assert asyncio.run(hasync(1, 2)) == 3 and time.monotonic() - t0 >= 0.2
    with pytest.raises(ConfigError, match="'async'"):
        calculator_tools("slow")
    with pytest.raises(ConfigError, match="'environments'"):
        trainer_inputs("tool")

    # environments: reset keeps the problem and appends the numbers to a stem prompt, get_reward reads their state
    rows = build_tool_dataset(8, seed=1, env="dict")
    assert set(rows["prompt"][i][0]["content"] for i in range(8)) == {"what is"}
    assert rows["environment"] == ["add" if op == "+" else "subtract" for op in rows["op"]]
    factories = environment_factories("dict")
    assert factories == {"add": AddEnv, "subtract": SubtractEnv} and environment_factories("single") is CalculatorEnv
    for row in rows:
        env = factories[row.pop("environment")]()
        assert env.reset(**row) == f" {row['a']} {row['op']} {row['b']}"
        assert env.get_reward() == 0.0  # no call yet
        tool = getattr(env, "add" if row["op"] == "+" else "subtract")
        tool(row["a"] + 1, row["b"])
        assert env.get_reward() == 0.0
        assert tool(row["a"], row["b"]) == row["answer"] and env.get_reward() == 1.0
        assert env.reset(**row) and env.calls == [] and env.get_reward() == 0.0  # state is per rollout
    env = CalculatorEnv()
    full = build_tool_dataset(1, seed=2)[0]
    assert env.reset(**full) is None  # the prompt asks the whole question already
    env.add(full["a"], full["b"]) if full["op"] == "+" else env.subtract(full["a"], full["b"])
    assert env.get_reward() == 1.0
    with pytest.raises(TypeError):
        env.add("x", 1)
    assert isinstance(env.calls[-1][3], TypeError) and env.get_reward() == 0.0


def test_task_selection_is_validated_with_the_valid_choices(tmp_path):
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.run import preflight

    def cfg(**train):
        return {"plugins": {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}, "train": train}

    with pytest.raises(ConfigError, match=r"train.task: 'tool' .*'count', 'environment', 'environments' or 'tools'"):
        load_config(cfg(task="tool"))
    with pytest.raises(ConfigError, match="needs train.trainer 'grpo'"):
        load_config(cfg(task="tools", trainer="rloo", model="tiny-tools"))
    with pytest.raises(ConfigError, match="'tiny-tools' or a checkpoint folder saved from it; train.model 'small'"):
        preflight(cfg(task="environment", model="small"), enable_plugins=False)
    with pytest.raises(ConfigError, match="train.task 'count' needs 'qwen2-360m', 'qwen2-tiny', 'small' or 'tiny'"):
        preflight(cfg(model="tiny-tools"), enable_plugins=False)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ConfigError, match="has no chat template"):
        preflight(cfg(task="tools", model=str(folder)), enable_plugins=False)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    assert preflight(cfg(task="tools", model=str(folder)), enable_plugins=False).train.task == "tools"
    assert load_config("compare_tools").train.task == "tools"


def test_preset_cache_trains_once_deterministically_and_is_keyed_by_the_recipe(tmp_path):
    from mrl_plugins.demo.models import FINGERPRINT_FILE, tool_preset_folder
    from mrl_plugins.errors import ConfigError

    short = {"steps": 3, "batch": 4}
    first = tool_preset_folder(seed=1, cache=str(tmp_path / "a"), recipe=short)
    assert os.path.basename(first).startswith("tiny-tools-seed1-")
    stamp = os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns
    assert tool_preset_folder(seed=1, cache=str(tmp_path / "a"), recipe=short) == first  # a hit: not retrained
    assert os.stat(os.path.join(first, "model.safetensors")).st_mtime_ns == stamp
    elsewhere = tool_preset_folder(seed=1, cache=str(tmp_path / "b"), recipe=short)

    def digest(folder):
        with open(os.path.join(folder, FINGERPRINT_FILE), encoding="utf-8") as fh:
            return json.load(fh)["sha256"]

    assert digest(elsewhere) == digest(first)  # trained again elsewhere: the same weights
    other = tool_preset_folder(seed=1, cache=str(tmp_path / "a"), recipe={**short, "steps": 4})
    assert other != first and len(os.listdir(tmp_path / "a" / "presets")) == 4  # two folders, two lock files
    with pytest.raises(ConfigError, match="unknown keys \\['step'\\]"):
        tool_preset_folder(cache=str(tmp_path / "a"), recipe={"step": 3})


# --------------------------------------------------------------------------- the trained preset (slow)


@pytest.mark.slow
def test_sft_preset_calls_the_tool_most_of_the_time_and_leaves_room_to_learn():
    import torch
    from trl.chat_template_utils import parse_response

    from mrl_plugins.demo.models import build_model, cache_dir
    from mrl_plugins.demo.tool_task import OPS, build_tool_dataset, calculator_tools

    model, tok = build_model("tiny-tools")
    assert os.path.dirname(model.name_or_path) == os.path.join(cache_dir(), "presets")
    ds = build_tool_dataset(128, seed=11)
    tools = calculator_tools()
    batch = _rendered(tok, ds, tools)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    width = batch["input_ids"].shape[1]
    completions, right = [], 0
    for i, row in enumerate(ds):
        ids = out[i, width:].tolist()
        ids = ids[: ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids
        prefix = [t for t, m in zip(batch["input_ids"][i].tolist(), batch["attention_mask"][i].tolist()) if m]
        message = parse_response(tok, ids, prefix=prefix, tools=tools)
        completions.append([message])
        calls = message.get("tool_calls") or []
        right += [c["function"] for c in calls] == [
            {"name": OPS[row["op"]], "arguments": {"a": row["a"], "b": row["b"]}}
        ]
    rate = tool_call_rate(completions)
    print(f"tool-call rate {rate:.2f}, right call {right / len(ds):.2f} (128 prompts, temperature 1)")
    assert 0.5 <= rate <= 0.9  # most of the time, not always: GRPO has the rest to learn
    assert right >= 0.85 * rate * len(ds)  # a call it makes is well formed, right tool, right operands


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tools", "environment"])
def test_vanilla_grpo_learns_the_tool_task(tmp_path, task):
    """TRL's GRPOTrainer with tools=[add, subtract] (reward: the answer) or environment_factory=CalculatorEnv (reward:
    its get_reward) raises the reward and the tool-call frequency: 60 steps (about 15 s on a quiet core) against the
    same trainer with learning rate 0 (the preset's own reward, 8 steps of 32 rollouts)."""
    from mrl_plugins.demo.models import build_model

    model, tok = build_model("tiny-tools")
    control = _grpo(tmp_path / "control", model, tok, steps=8, task=task, learning_rate=0.0)
    control.train()
    before = statistics.mean(logged(control, "reward"))
    calls_before = statistics.mean(logged(control, "tools/call_frequency"))
    trainer = _grpo(tmp_path / "train", model, tok, steps=60, task=task)
    trainer.train()
    rewards, calls = logged(trainer, "reward"), logged(trainer, "tools/call_frequency")
    assert len(rewards) == len(calls) == 60
    after = statistics.mean(rewards[-20:])
    print(f"{task}: reward {before:.2f} (lr 0) -> {after:.2f} (last 20 of 60 steps), tool calls {calls_before:.2f} -> "
          f"{statistics.mean(calls[-20:]):.2f}; per step: {[round(r, 2) for r in rewards]}")  # fmt: skip
    assert 0.5 <= before <= 0.85  # the preset: room to learn
    assert after >= before + 0.1
    assert statistics.mean(calls[-20:]) >= calls_before + 0.1
    # failing calls (bad arguments) stay rare: a step may have a few (one step of 60 had 6 of 32 on an AVX-512 host)
    assert statistics.mean(logged(trainer, "tools/failure_frequency")) <= 0.05
    if task == "environment":
        assert logged(trainer, "rewards/CalculatorEnv/mean") == rewards  # the environment's reward is the reward


@pytest.mark.slow
def test_dict_of_environments_async_and_raising_tools_run_in_trl(tmp_path):
    """A dict of two environment factories routes each row to its own (both reward columns logged, each prompt shows
    only its environment's tool); async tools answer; a raising tool's error lands in the conversation and the run
    goes on."""
    from mrl_plugins.demo.models import build_model
    from mrl_plugins.demo.tool_task import arithmetic_reward

    model, tok = build_model("tiny-tools")
    trainer = _grpo(tmp_path / "dict", model, tok, steps=3, task="environments")
    trainer.train()
    assert statistics.mean(logged(trainer, "reward")) > 0.5  # reset's observation reached the prompts
    assert any(logged(trainer, "rewards/AddEnv/mean")) and any(logged(trainer, "rewards/SubtractEnv/mean"))
    assert {e for pool in trainer._environment_pool.values() for e in map(type, pool)} == {
        type(e) for e in trainer.environments
    }

    seen = []

    def recording(completions, **kw):
        seen.extend(completions)
        return arithmetic_reward(completions, **kw)

    model, tok = build_model("tiny-tools")
    trainer = _grpo(tmp_path / "async", model, tok, steps=2, variant="async", reward_funcs=recording)
    trainer.train()
    assert min(logged(trainer, "tools/call_frequency")) > 0.4 and max(logged(trainer, "tools/failure_frequency")) == 0
    assert statistics.mean(logged(trainer, "reward")) > 0.4

    seen.clear()
    model, tok = build_model("tiny-tools")
    trainer = _grpo(tmp_path / "raises", model, tok, steps=2, variant="raises", reward_funcs=recording)
    trainer.train()
    assert logged(trainer, "tools/failure_frequency") == [1.0, 1.0]
    results = [m["content"] for c in seen for m in c if m["role"] == "tool"]
    assert results and all(r in ("{'error': 'add is out of order'}", "{'error': 'subtract is out of order'}")
                           for r in results)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("task", ["tools", "environments"])
def test_embedded_job_runs_a_tool_task(tmp_path, task):
    """``mrl run`` on the bundled compare_tools config (plain TRL), as a tools= task and as a dict of environments."""
    from mrl_plugins.config import load_yaml
    from mrl_plugins.run import run_training

    data = load_yaml("compare_tools")
    data["train"].update(task=task, steps=2, threads=1, output_dir=str(tmp_path), num_prompts=64)
    result = run_training(data, enable_plugins=False)
    assert result.steps == 2 and len(result.rewards) == 2 and result.final_reward > 0.3
    assert result.plugins == {"rollout": "vanilla"}


@require_vllm
def test_vllm_serves_the_preset_and_its_two_turns_parse():
    """vLLM's CPU backend serves ``tiny-tools`` (head_dim 32): first turns parse into tool calls at the preset's rate,
    second turns after TRL's tool suffix state the result, and every sampled token's logprob is the teacher-forced
    one on the whole two-turn sequence (what a multi-turn rollout's logprobs must be). In the vllm tox env this is
    also the transformers 5.19 check of the template and the parser."""
    import torch
    from trl.chat_template_utils import parse_response

    from mrl_plugins.demo.models import build_model
    from mrl_plugins.demo.tool_task import OPS, build_tool_dataset, calculator_tools
    from mrl_plugins.rollout.engine import SamplingParams
    from mrl_plugins.rollout.vllm_engine import VLLMEngine, check_vllm_servable

    model, tok = build_model("tiny-tools")
    check_vllm_servable(model.config)
    tools = calculator_tools()
    ds = build_tool_dataset(48, seed=13)
    prompts = [
        tok.apply_chat_template(p, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False)
        for p in ds["prompt"]
    ]
    eng = VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=24), seed=0)
    try:
        first = eng.generate(prompts, 1)
        messages = [parse_response(tok, c, prefix=p, tools=tools) for p, c in zip(prompts, first.completion_ids)]
        assert 0.5 <= tool_call_rate([[m] for m in messages]) <= 0.95
        follow, expected = [], []
        for m, row, p, c in zip(messages, ds, prompts, first.completion_ids, strict=True):
            calls = [x["function"] for x in m.get("tool_calls") or []]
            if calls == [{"name": OPS[row["op"]], "arguments": {"a": row["a"], "b": row["b"]}}]:
                follow.append(p + c + tok(f"<result> {row['answer']} <assistant>")["input_ids"])
                expected.append(str(row["answer"]))
        assert len(follow) >= 0.4 * len(ds)
        second = eng.generate(follow, 1)
    finally:
        eng.close()
    answers = [parse_response(tok, c, prefix=p, tools=tools)["content"] for p, c in zip(follow, second.completion_ids)]
    assert sum(a == e for a, e in zip(answers, expected)) >= 0.8 * len(follow)
    with torch.no_grad():
        for out in (first, second):
            for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs, strict=True):
                logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
                forced = torch.log_softmax(logits, -1).gather(1, torch.tensor(c).unsqueeze(1)).squeeze(1)
                assert (forced - torch.tensor(lp)).abs().max().item() <= 1e-4
