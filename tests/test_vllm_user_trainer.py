"""A user's own ``GRPOTrainer(..., use_vllm=True, vllm_mode="colocate")`` switched by ``enable()`` to the plugin's vLLM
engine: a 40-step run generates every batch with vLLM (not with the trainer's own model while vLLM starts), the
wait is said on stderr, the logprobs equal teacher forcing under each batch's weight version, the reward learns. The
worker is spawned here: a vLLM worker forked from a process where TRL's own vLLM engine ran hung at its first
request (measured), so start_method 'auto' spawns it."""

from __future__ import annotations

import pytest
import torch

from tests.marks import require_vllm
from tests.teacher import VersionRecorder

#: set by TRL's colocate vLLM init in this process; a test must leave them as they were
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _history(trainer, key):
    return [log[key] for log in trainer.state.log_history if key in log]


@require_vllm
@pytest.mark.slow
def test_a_40_step_use_vllm_trainer_generates_every_batch_with_vllm_and_learns(tmp_path, monkeypatch, capfd):
    for name in DIST_ENV:
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)
    from trl import GRPOConfig, GRPOTrainer

    import mrl_plugins
    from mrl_plugins.demo.models import build_dataset, build_model, count_reward, save_preset

    torch.set_num_threads(1)
    model, tok = build_model("tiny", seed=0)
    save_preset(model, tok, str(tmp_path / "preset"))  # TRL builds its own vLLM from model.name_or_path
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=40, learning_rate=1e-2, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, logging_steps=5, report_to=[], save_strategy="no", use_cpu=True, bf16=False,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=count_reward, args=args, train_dataset=build_dataset(512)
    )
    capfd.readouterr()
    mrl_plugins.enable(trainer, {"rollout": {"engine": "vllm", "start_timeout_s": 300}})  # local_warmup: 'auto'
    assert "until ready: the first generation waits" in capfd.readouterr().err
    recorder = VersionRecorder(trainer)
    import psutil
    from transformers import TrainerCallback

    started = {}

    class Probe(TrainerCallback):  # TRL's engine ran in this process (and left its process group): spawned
        def on_step_end(self, args, state, control, **kwargs):
            if not started:
                (pid,) = trainer._mrl_state.runtime.pool.pids
                started["spawned"] = "--multiprocessing-fork" in psutil.Process(pid).cmdline()

    trainer.add_callback(Probe())
    trainer.train()
    assert started == {"spawned": True}
    err = capfd.readouterr().err
    assert "rollout worker (vllm engine) ready" in err, err[-3000:]
    assert sum(_history(trainer, "mrl/rollout/worker_batches")) == 40  # every generation: the vLLM worker's
    assert not _history(trainer, "mrl/rollout/local_batches")
    assert len(recorder.batches) == 40 and max(recorder.versions()) >= 30
    assert recorder.max_error() < 1e-4  # vLLM's logprobs = teacher forcing under each batch's version
    rewards = _history(trainer, "reward")
    assert rewards[-1] > rewards[0] + 0.3, rewards
