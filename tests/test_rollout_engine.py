"""Rollout engines: sampling logprobs against teacher forcing, EOS cut, ordering, seeds, top-k/top-p/min-p."""

from __future__ import annotations

import types

import pytest
import torch

from mrl_plugins.adapters.trl_generation import sampling_params
from mrl_plugins.config import load_config
from mrl_plugins.demo.models import build_model
from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.engine import (
    EngineOutput,
    SamplingParams,
    TransformersEngine,
    cut_after_eos,
    process_logits,
)
from mrl_plugins.rollout.plugin import engine_registrations
from tests.marks import require_trl

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return build_model("tiny", seed=0)


def teacher_forced(model, prompt, completion, temperature, params=None):
    """log-softmax of the processed logits of ``prompt + completion`` at each completion token (one sequence)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    if params is None:
        scores = logits / temperature
    else:
        scores = process_logits(logits, params)
    return torch.log_softmax(scores, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_teacher_forcing(tiny, temperature):
    model, tok = tiny
    eng = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=12, temperature=temperature), seed=1)
    out = eng.generate(PROMPTS, num_generations=3)
    assert len(out.completion_ids) == len(out.logprobs) == 9
    checked = 0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert len(c) == len(lp) >= 1
        ref = teacher_forced(model, p, c, temperature)
        assert (ref - torch.tensor(lp)).abs().max().item() < 1e-4
        checked += len(c)
    assert checked > 9


FILTERS = {
    "top_k": {"top_k": 5},
    "top_p": {"top_p": 0.7},
    "min_p": {"min_p": 0.2},
    "repetition_penalty": {"repetition_penalty": 3.0},
    "combined": {"top_k": 10, "top_p": 0.9, "min_p": 0.01, "repetition_penalty": 1.1},
}


@pytest.mark.parametrize("kwargs", list(FILTERS.values()), ids=list(FILTERS))
def test_with_filters_logprobs_are_the_trainers_temperature_only_ones(tiny, kwargs):
    """With a sampling filter on, the engine still samples from the filtered distribution but reports TRL's
    trainer-side logprob, log_softmax(logits / T) (else TRL's IS correction would shrink or mask every sequence)."""
    model, tok = tiny
    params = SamplingParams(max_new_tokens=10, temperature=0.8, **kwargs)
    assert params.filters() == [k for k in ("top_k", "top_p", "min_p", "repetition_penalty") if k in kwargs]
    out = TransformersEngine(model, tok, params=params, seed=2).generate(PROMPTS, num_generations=3)
    plain = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=10, temperature=0.8), seed=2)
    unfiltered = plain.generate(PROMPTS, num_generations=3)
    assert out.completion_ids != unfiltered.completion_ids  # same seed: the filter changed what was sampled
    shaped = 0.0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert (teacher_forced(model, p, c, 0.8) - torch.tensor(lp)).abs().max().item() < 1e-4
        if "repetition_penalty" not in kwargs:
            processed = teacher_forced(model, p, c, 0.8, params)  # the filtered distribution (no seen-mask needed)
            assert torch.isfinite(processed).all()  # every sampled token was inside the filter
            shaped = max(shaped, (processed - torch.tensor(lp)).abs().max().item())
    if "repetition_penalty" not in kwargs:
        assert shaped > 1e-2  # the filtered distribution's logprobs are a different number


def test_teacher_forced_logps_in_chunks_equal_one_sequence_at_a_time(tiny, monkeypatch):
    import mrl_plugins.rollout.engine as engine_mod

    model, tok = tiny
    prompts = [[3, 4, 5], [6], [7, 8, 9, 10, 11], [12, 13]]
    completions = [[5, 6, 7, 1], [8], [], [9, 9, 9, 9, 9, 9]]
    whole = engine_mod.teacher_forced_logps(model, prompts, completions, temperature=0.7, pad_id=tok.pad_token_id)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(engine_mod, "_SCORE_CHUNK_FLOATS", 7 * vocab)  # one row per forward pass
    chunked = engine_mod.teacher_forced_logps(model, prompts, completions, temperature=0.7, pad_id=tok.pad_token_id)
    assert [len(x) for x in whole] == [len(c) for c in completions] == [len(x) for x in chunked]
    for p, c, a, b in zip(prompts, completions, whole, chunked):
        if c:
            want = teacher_forced(model, p, c, 0.7).tolist()
            assert a == pytest.approx(want, abs=1e-5) and b == pytest.approx(want, abs=1e-5)
    assert model.training is False


def test_eos_cut_and_eos_kept(tiny):
    model, tok = tiny
    # make EOS likely: use a frequent token set as EOS ids, compare against the raw (uncut) sampling
    eos = list(range(3, 19, 2))  # half the words end a completion
    params = SamplingParams(max_new_tokens=16, eos_token_ids=eos, pad_token_id=tok.pad_token_id)
    eng = TransformersEngine(model, None, params=params, seed=3)
    out = eng.generate(PROMPTS, num_generations=4)
    ended = 0
    for c in out.completion_ids:
        eos_pos = [i for i, t in enumerate(c) if t in eos]
        # at most one EOS, and only as the last token
        assert eos_pos in ([], [len(c) - 1])
        if eos_pos:
            ended += 1
        else:
            assert len(c) == 16
    assert ended >= 6  # with 8 of 19 tokens as EOS nearly every completion ends early
    assert cut_after_eos([5, 6, 1, 7, 1], [1]) == 3
    assert cut_after_eos([5, 6], [1]) == 2


def test_prompt_major_order(tiny):
    model, tok = tiny
    eng = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=4), seed=0)
    out = eng.generate(PROMPTS, num_generations=3)
    assert out.prompt_ids == [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3 + [PROMPTS[2]] * 3
    # each sequence's logprobs are consistent with ITS prompt (a misordered result would not match)
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert (teacher_forced(model, p, c, 1.0) - torch.tensor(lp)).abs().max().item() < 1e-4


def test_seed_reproducible_and_independent_of_global_rng(tiny):
    model, tok = tiny
    a = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=12), seed=42).generate(PROMPTS, 4)
    torch.manual_seed(999)  # the engine's generator is private
    b = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=12), seed=42).generate(PROMPTS, 4)
    c = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=12), seed=43).generate(PROMPTS, 4)
    assert a.completion_ids == b.completion_ids
    assert a.logprobs == b.logprobs
    assert a.completion_ids != c.completion_ids


def _allowed_sets(model, prompt, completion, params):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    scores = process_logits(logits, params)
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in scores], logits


@pytest.mark.parametrize(
    "kwargs",
    [{"top_k": 3}, {"top_p": 0.5}, {"min_p": 0.8}, {"top_k": 4, "top_p": 0.7, "temperature": 1.3}],
    ids=["top_k", "top_p", "min_p", "combined"],
)
def test_sampled_tokens_within_allowed_set(tiny, kwargs):
    model, tok = tiny
    params = SamplingParams(max_new_tokens=10, **kwargs)
    eng = TransformersEngine(model, tok, params=params, seed=5)
    out = eng.generate(PROMPTS, num_generations=6)
    vocab = model.config.vocab_size
    sizes = []
    for p, c in zip(out.prompt_ids, out.completion_ids):
        allowed, logits = _allowed_sets(model, p, c, params)
        for tok_id, ok, row in zip(c, allowed, logits):
            assert tok_id in ok
            sizes.append(len(ok))
            if "top_k" in kwargs:
                assert len(ok) <= kwargs["top_k"]
                assert ok <= set(torch.topk(row, kwargs["top_k"]).indices.tolist())
    assert min(sizes) < vocab  # the filter actually removed tokens


def test_top_k_set_matches_hf_warpers():
    """Our processing equals Hugging Face's own warpers chained in generate's order."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 50, generator=g) * 3
    params = SamplingParams(max_new_tokens=1, temperature=0.7, top_k=10, top_p=0.8, min_p=0.05)
    ours = process_logits(scores, params)
    ref = scores
    for w in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(10), TopPLogitsWarper(0.8), MinPLogitsWarper(0.05)):
        ref = w(None, ref)
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    assert torch.allclose(ours[torch.isfinite(ours)], ref[torch.isfinite(ref)])


def test_repetition_penalty_matches_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(1)
    scores = torch.randn(2, 20, generator=g)
    input_ids = torch.tensor([[3, 4, 5, 3], [7, 8, 9, 10]])
    seen = torch.zeros(2, 20, dtype=torch.bool).scatter_(1, input_ids, True)
    params = SamplingParams(max_new_tokens=1, repetition_penalty=1.3)
    ref = RepetitionPenaltyLogitsProcessor(1.3)(input_ids, scores.clone())
    assert torch.allclose(process_logits(scores, params, seen), ref)


def test_repetition_penalty_in_engine_lowers_repeats(tiny):
    model, tok = tiny
    base = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=16), seed=7).generate(PROMPTS, 6)
    pen = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=16, repetition_penalty=50.0), seed=7)
    out = pen.generate(PROMPTS, 6)

    def repeats(o: EngineOutput) -> int:
        return sum(len(c) - len(set(c)) for c in o.completion_ids)

    assert repeats(out) < repeats(base)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_bad_params_rejected(kwargs, key):
    params = SamplingParams(**{"max_new_tokens": 4, **kwargs})
    with pytest.raises(ConfigError, match=f"sampling.{key}"):
        params.validate()


def test_bad_prompts_rejected(tiny):
    model, tok = tiny
    eng = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=2))
    with pytest.raises(ConfigError, match="prompts"):
        eng.generate([], 1)
    with pytest.raises(ConfigError, match=r"prompts\[1\]"):
        eng.generate([[3], []], 1)
    with pytest.raises(ConfigError, match="num_generations"):
        eng.generate([[3]], 0)


def test_sampling_params_read_trl_attributes():
    """A stand-in object with the attributes GRPOTrainer sets in __init__ (a real trainer is built in the
    adapter tests; building one here would cost seconds)."""
    tok = types.SimpleNamespace(eos_token_id=1, pad_token_id=0)
    trainer = types.SimpleNamespace(
        temperature=0.9,
        top_p=0.95,
        top_k=20,
        min_p=None,
        repetition_penalty=1.1,
        max_completion_length=32,
        eos_token_ids=[1, 5],
        processing_class=tok,
        args=types.SimpleNamespace(max_completion_length=99),
    )
    p = sampling_params(trainer)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (0.9, 0.95, 20, None, 1.1)
    assert p.max_new_tokens == 32 and p.eos_token_ids == [1, 5] and p.pad_token_id == 0
    del trainer.eos_token_ids
    assert sampling_params(trainer).eos_token_ids == [1]
    trainer.args.generation_kwargs = {"top_k": 7, "eos_token_id": [1, 2], "do_sample": True}
    p = sampling_params(trainer)
    assert p.top_k == 7 and p.eos_token_ids == [1, 2]
    trainer.args.generation_kwargs = {"num_beams": 4}
    with pytest.raises(ConfigError, match="generation_kwargs.num_beams: not supported"):
        sampling_params(trainer)
    trainer.args.generation_kwargs = {"do_sample": False}
    with pytest.raises(ConfigError, match="greedy"):
        sampling_params(trainer)


@pytest.mark.slow
@require_trl
def test_sampling_params_on_real_grpo_trainer(tmp_path, tiny):
    from trl import GRPOConfig, GRPOTrainer

    from mrl_plugins.demo.models import build_dataset, count_reward

    model, tok = build_model("tiny", seed=0)
    args = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=7,
        temperature=0.8,
        top_k=3,
        report_to="none",
        use_cpu=True,
        max_steps=1,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=count_reward, args=args, train_dataset=build_dataset(8), processing_class=tok
    )
    p = sampling_params(trainer)
    assert (p.max_new_tokens, p.temperature, p.top_k) == (7, 0.8, 3)
    assert p.eos_token_ids == trainer.eos_token_ids and p.pad_token_id == tok.pad_token_id


def test_registrations():
    regs = {r.name: r for r in engine_registrations()}
    assert set(regs) == {"transformers", "vllm"}
    model, tok = build_model("tiny", seed=0)
    eng = regs["transformers"].factory(model, tok, params=SamplingParams(max_new_tokens=3), device="cpu", seed=0)
    assert isinstance(eng, TransformersEngine)
    assert len(eng.generate([[3, 4]], 2).completion_ids) == 2


def test_generate_uses_eval_mode_and_restores_train_mode():
    """A model shared with a trainer (train mode, dropout on) still gives teacher-forcing-exact logprobs."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _, tok = build_model("tiny", seed=0)
    cfg = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attention_dropout=0.5, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    eng = TransformersEngine(model, tok, params=SamplingParams(max_new_tokens=8), seed=0)
    model.train()
    out = eng.generate(PROMPTS, 2)
    assert model.training
    model.eval()
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs):
        assert (teacher_forced(model, p, c, 1.0) - torch.tensor(lp)).abs().max().item() < 1e-4


def test_what_an_engine_can_do_is_declared_on_its_registration_not_read_from_its_name():
    """The stage reads RolloutEngine's declared capabilities: a third-party engine that declares options, scoring,
    a long start and a warm-up gets them; the built-ins declare theirs."""
    from mrl_plugins.hookspecs import RolloutEngine, hookimpl
    from mrl_plugins.manager import get_plugin_manager
    from mrl_plugins.rollout.lifecycle import start_method

    regs = {r.name: r for r in engine_registrations()}
    assert (regs["transformers"].scores, regs["transformers"].warmup, regs["transformers"].options) == (1, 1, 0)
    assert (regs["vllm"].options, regs["vllm"].scores, regs["vllm"].warmup, regs["vllm"].start_s) == (1, 0, 0, 300)
    assert regs["vllm"].check is not None and regs["transformers"].check is None

    class Plugin:
        @hookimpl
        def mrl_rollout_register_engines(self):
            return [
                RolloutEngine(name="mine", factory=dict, options=True, scores=True, warmup=True, start_s=900.0),
                RolloutEngine(name="plain", factory=dict),
            ]

    cfg = {"rollout": {"engine": "mine", "engine_options": {"x": 1}, "ref_logps": "engine"}}
    rc = get_plugin_manager(cfg, plugins=[("mine", Plugin())]).config.rollout
    assert rc.start_timeout_s == 900 and rc.local_warmup is True and rc.warmup
    rc = get_plugin_manager({"rollout": {"engine": "plain"}}, plugins=[("mine", Plugin())]).config.rollout
    assert rc.start_timeout_s == 180 and rc.local_warmup is False  # 1.5 x timeout_s; no warm-up declared
    with pytest.raises(ConfigError, match="engine 'plain' takes no options.*engines that do: 'mine' or 'vllm'"):
        get_plugin_manager({"rollout": {"engine": "plain", "engine_options": {"x": 1}}}, plugins=[("mine", Plugin())])
    with pytest.raises(ConfigError, match="engine 'plain' cannot score.*can: 'mine' or 'transformers'"):
        get_plugin_manager({"rollout": {"engine": "plain", "ref_logps": "engine"}}, plugins=[("mine", Plugin())])
    set_by_user = get_plugin_manager({"rollout": {"local_warmup": False}}).config.rollout
    assert set_by_user.local_warmup is False  # 'auto' only is resolved from the engine
    mine = load_config({"rollout": {"engine": "mine"}})  # what a run resolves stays in its copy
    assert get_plugin_manager(mine, plugins=[("mine", Plugin())]).config.rollout.start_timeout_s == 900
    assert (mine.rollout.start_timeout_s, mine.rollout.local_warmup) == (180, "auto")
    plain = RolloutEngine(name="plain", factory=dict)
    method, why = start_method("auto", device="cpu", threads=1, engine=plain)
    assert method == "spawn" and "'plain' is not registered as safe in a forked worker" in why
