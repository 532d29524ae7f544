"""Reference-model scoring on the rollout workers (``rollout.ref_logps: engine``): every worker holds a copy of
the frozen reference model and returns the completions' logprobs under it, so the trainer skips TRL's
reference forward pass. Real worker processes, real TRL trainers on the tiny model."""

from __future__ import annotations

import pytest

from tests.marks import require_trl
from tests.pool_helpers import make_pool

pytestmark = require_trl

PROMPTS = [[3, 4, 5], [6, 7], [8, 9, 10, 11]]


def _perturbed_tiny(seed: int):
    """The tiny model with its weights moved away from the policy's (a stand-in for a trained reference)."""
    import torch

    from mrl_plugins.demo.models import build_model

    model, tok = build_model("tiny")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model, tok


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_score_is_teacher_forced_log_softmax_of_logits_over_temperature(temperature):
    import torch

    from mrl_plugins.rollout.engine import SamplingParams, TransformersEngine

    torch.set_num_threads(1)
    model, tok = _perturbed_tiny(0)
    sp = SamplingParams(max_new_tokens=6, temperature=temperature, eos_token_ids=[tok.eos_token_id])
    engine = TransformersEngine(model, tok, params=sp, seed=0)
    out = engine.generate(PROMPTS, 2)
    scores = engine.score(out.prompt_ids, out.completion_ids)
    assert [len(s) for s in scores] == [len(c) for c in out.completion_ids]
    for s, lp in zip(scores, out.logprobs):  # temperature-only sampling: the sampling logprobs are the same thing
        assert s == pytest.approx(lp, abs=1e-5)
    p, c = out.prompt_ids[0], out.completion_ids[0]
    with torch.no_grad():
        logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : len(p) + len(c) - 1]
    want = torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
    assert scores[0] == pytest.approx(want.tolist(), abs=1e-5)
    assert engine.score([], []) == []
    with pytest.raises(Exception, match="2 prompts for 1 completions"):
        engine.score([[3], [4]], [[5]])


@pytest.mark.slow
def test_pool_workers_score_each_completion_with_their_reference_copy():
    import torch

    from mrl_plugins.rollout.engine import TransformersEngine

    torch.set_num_threads(1)
    ref, _ = _perturbed_tiny(1)
    pool, model, tok, sampling, *_ = make_pool({"comm": {"codec": "raw"}}, score_models={"ref": ref})
    try:
        assert pool.score_with == ("ref",) and not any("/ref/" in k for k in pool.stats())  # scored, never queued
        pool.publish(0, list(ref.named_parameters()), model_id="ref")
        pool.publish(1, list(model.named_parameters()))
        res = pool.collect(pool.submit(PROMPTS, 2, min_version=1))
        assert res.weight_version == 1 and len(res.scores["ref"]) == len(res.completion_ids) == 6
        want = TransformersEngine(ref, tok, params=sampling, seed=0).score(res.prompt_ids, res.completion_ids)
        assert res.scores["ref"] == want  # raw frames: bit for bit
        policy = TransformersEngine(model, tok, params=sampling, seed=0).score(res.prompt_ids, res.completion_ids)
        assert max(abs(a - b) for s, p in zip(res.scores["ref"], policy) for a, b in zip(s, p)) > 0.05
    finally:
        pool.close()


def _rloo(tmp_path, steps: int):
    import torch

    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    cfg = load_config({"train": {"model": "tiny", "trainer": "rloo", "steps": steps, "output_dir": str(tmp_path)}})
    return build_trainer(cfg, enable_plugins=False, output_dir=str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("comm", "tol"),
    [
        ({"codec": "raw"}, 1e-5),
        ({"codec": "fp16"}, 2**-7),  # the scores travel as fp16
        ({"codec": "fp16", "lossless_fields": ["score_ref"]}, 1e-5),
    ],
)
def test_rloo_takes_its_reference_logprobs_from_the_workers(tmp_path, comm, tol):
    import mrl_plugins

    trainer = _rloo(tmp_path, 3)
    assert trainer.beta > 0 and trainer.ref_model is not None  # RLOO's default KL term
    mrl_plugins.enable(
        trainer,
        {
            "mode": "disaggregated",
            "rollout": {"workers": 1, "local_warmup": False, "ref_logps": "engine", "placement": "fixed"},
            "comm": comm,
        },
    )
    served = trainer._get_per_token_logps_and_entropies
    trl_own = type(trainer)._get_per_token_logps_and_entropies.__get__(trainer)
    diffs = []

    def spy(model, input_ids, attention_mask, logits_to_keep, *a, **kw):
        out = served(model, input_ids, attention_mask, logits_to_keep, *a, **kw)
        if model is trainer.ref_model:  # what TRL itself would have computed for the same batch
            want = trl_own(model, input_ids, attention_mask, logits_to_keep, *a, **kw)[0]
            mask = attention_mask[:, -logits_to_keep:].bool()
            diffs.append(float((out[0] - want)[mask].abs().max()))
        return out

    trainer._get_per_token_logps_and_entropies = spy
    trainer.train()
    hist = [h for h in trainer.state.log_history if "loss" in h]
    assert len(diffs) == 3 and max(diffs) <= tol, diffs
    assert sum(h.get("mrl/rollout/ref_logps_engine", 0) for h in hist) == 3
    assert sum(h.get("mrl/rollout/ref_logps_trainer", 0) for h in hist) == 0


def test_ref_logps_engine_is_refused_where_it_cannot_apply(tmp_path):
    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.run import build_trainer

    with pytest.raises(ConfigError, match=r"rollout\.ref_logps: 'bogus' invalid; valid: 'engine' or 'trainer'"):
        load_config({"rollout": {"ref_logps": "bogus"}})
    grpo = build_trainer(
        load_config({"train": {"model": "tiny", "steps": 1, "output_dir": str(tmp_path / "g")}}),
        enable_plugins=False,
        output_dir=str(tmp_path / "g"),
    )
    with pytest.raises(ConfigError, match=r"no KL term \(beta = 0\).*valid here: 'trainer'"):
        mrl_plugins.enable(grpo, {"rollout": {"workers": 1, "ref_logps": "engine"}})
    rloo = _rloo(tmp_path / "r", 1)
    with pytest.raises(ConfigError, match="needs rollout workers"):
        mrl_plugins.enable(rloo, {"rollout": {"workers": 0, "ref_logps": "engine"}})
    assert getattr(grpo, "_mrl_state", None) is None and getattr(rloo, "_mrl_state", None) is None  # untouched


def test_worker_scores_are_used_only_for_the_completions_they_belong_to():
    import torch

    from mrl_plugins.adapters.trl import _engine_ref_logps
    from mrl_plugins.hookspecs import RolloutResult

    res = RolloutResult(
        prompt_ids=[[3, 4], [3, 4]],
        completion_ids=[[7, 8, 2], [9]],
        logprobs=[[-0.1, -0.2, -0.3], [-0.4]],
        weight_version=1,
        scores={"ref": [[-1.0, -2.0, -3.0], [-4.0]]},
    )
    pad = 0
    # TRL's layout: left-padded prompt, right-padded completion, logits_to_keep = the completion width
    ids = torch.tensor([[3, 4, 7, 8, 2], [3, 4, 9, pad, pad]])
    got = _engine_ref_logps(res, ids, 3)
    assert torch.equal(got, torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]))
    other = ids.clone()
    other[1, 2] = 10  # not the completion the workers scored: TRL computes it itself
    assert _engine_ref_logps(res, other, 3) is None
    assert _engine_ref_logps(res, ids[:1], 3) is None  # another batch size
    assert _engine_ref_logps(RolloutResult([[3]], [[5]], [[-0.1]], 0), ids[:1, :3], 1) is None  # no scores
