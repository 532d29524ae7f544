"""Sampling filters (top-p, top-k, min-p, repetition penalty) through real TRL GRPO trainers with the plugin on.

The engines sample from the filtered distribution but report the trainer's temperature-only logprobs, so TRL's
importance-sampling correction (``vllm_importance_sampling_mode``, default ``sequence_mask``) sees only staleness.
Reporting the filtered logprobs made every sequence ratio an artefact of the filter (~0.01 to 0.7 on the first
step, before any weight changed) and could mask every sequence (a run that trains on nothing).
"""

from __future__ import annotations

import pytest

from tests.marks import require_trl

pytestmark = [require_trl]

FILTERS = {"top_p": 0.9, "top_k": 10, "min_p": 0.01, "repetition_penalty": 1.1}
#: 3 prompts x 3 generations, 8 tokens, lr 0.1: the settings the issue reported
SHAPE = {"per_device_train_batch_size": 9, "num_generations": 3, "max_completion_length": 8}


def _trainer(tmp_path, steps=3, seed=0):
    import torch

    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    data = {
        "train": {
            "trainer": "grpo", "model": "tiny", "steps": steps, "seed": seed, "learning_rate": 0.1,
            "logging_steps": 1, "num_prompts": 64, "output_dir": str(tmp_path), "trl_args": {**FILTERS, **SHAPE},
        }
    }  # fmt: skip
    return build_trainer(load_config(data), enable_plugins=False, output_dir=str(tmp_path))


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


def _colocate(workers: int) -> dict:
    from mrl_plugins.config import load_yaml

    cfg = load_yaml("colocate")
    cfg.setdefault("rollout", {})
    cfg.pop("train", None)
    cfg["rollout"].update(workers=workers, placement="fixed")
    if workers:  # every batch from the worker, generated with the trainer's current weights
        cfg["rollout"].update(max_staleness=0, local_warmup=False, start_timeout_s=240)
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_filtered_sampling_learns_and_is_correction_masks_nothing(tmp_path, workers):
    import torch

    import mrl_plugins

    trainer = _trainer(tmp_path)
    assert (trainer.top_p, trainer.top_k, trainer.min_p, trainer.repetition_penalty) == (0.9, 10, 0.01, 1.1)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    mrl_plugins.enable(trainer, _colocate(workers))
    assert trainer.use_vllm and trainer.vllm_importance_sampling_correction
    assert trainer.vllm_importance_sampling_mode == "sequence_mask"  # TRL 1.16's default
    trainer.train()

    after = dict(trainer.model.named_parameters())
    assert not torch.equal(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"].detach())
    assert all(not torch.equal(before[n], p.detach()) for n, p in after.items())
    if workers:
        assert not _history(trainer, "mrl/rollout/local_batches")  # logged only when > 0: the worker generated all
        assert _history(trainer, "mrl/comm/frames")[-1] >= 3
    # TRL's own IS metrics: sequence ratios exp(sum(trainer - sampling)) after masking (a masked sequence is 0).
    # Generated with the weights the trainer holds, they are 1 up to numerics (fp16 logprobs over the worker's shm)
    lo, hi = (
        _history(trainer, "sampling/importance_sampling_ratio/min"),
        _history(trainer, "sampling/importance_sampling_ratio/max"),
    )
    assert len(lo) == len(hi) == 3
    assert min(lo) > 0.97 and max(hi) < 1.03, (lo, hi)
    assert max(_history(trainer, "sampling/sampling_logp_difference/max")) < 0.02


@pytest.mark.slow
def test_async_worker_with_filters_masks_no_step_entirely(tmp_path):
    """The async pipeline (one version of staleness): the IS correction now sees staleness only; on the first
    step, before any weight changed, the ratios are 1, and no step loses every sequence."""
    import mrl_plugins

    trainer = _trainer(tmp_path, steps=4)
    cfg = _colocate(0)
    cfg["rollout"].update(workers=1, local_warmup=False, start_timeout_s=240)
    mrl_plugins.enable(trainer, cfg)
    trainer.train()
    assert not _history(trainer, "mrl/rollout/local_batches")
    lo, hi = (
        _history(trainer, "sampling/importance_sampling_ratio/min"),
        _history(trainer, "sampling/importance_sampling_ratio/max"),
    )
    assert len(hi) == 4
    assert 0.97 < lo[0] <= hi[0] < 1.03, (lo, hi)
    assert min(hi) > 0, (lo, hi)


def test_engine_old_logps_still_refuse_every_filter(tmp_path):
    """rollout.old_logps: engine stays temperature-only (adapters/trl.py _check_engine_logps), filter by filter."""
    import mrl_plugins
    from mrl_plugins.errors import ConfigError

    trainer = _trainer(tmp_path)
    for name in FILTERS:
        for key, off in {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0}.items():
            setattr(trainer, key, off)
        setattr(trainer, name, FILTERS[name])
        with pytest.raises(ConfigError, match=f"temperature-only.*but {name} is set"):
            mrl_plugins.enable(trainer, {"rollout": {"workers": 0, "old_logps": "engine"}})
        assert getattr(trainer, "_mrl_state", None) is None and trainer.use_vllm is False
