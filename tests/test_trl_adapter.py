"""The TRL adapter on real TRL trainers with the tiny model (CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.marks import require_trl

pytestmark = [require_trl]

UPSTREAM = {"plugins": {"rollout": "upstream", "weight_sync": "upstream", "comm": "upstream"}}


def _cfg(tmp_path, kind="grpo", steps=4, **extra):
    from mrl_plugins.config import load_config

    data = {"train": {"trainer": kind, "model": "tiny", "steps": steps, "output_dir": str(tmp_path)}}
    for key, value in extra.items():
        data[key] = value
    return load_config(data)


def _trainer(tmp_path, kind="grpo", steps=4, **extra):
    import torch

    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    return build_trainer(_cfg(tmp_path, kind, steps, **extra), enable_plugins=False, output_dir=str(tmp_path))


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_upstream_equals_vanilla_per_step(tmp_path, kind):
    import mrl_plugins

    vanilla = _trainer(tmp_path / "vanilla", kind)
    vanilla.train()
    enabled = _trainer(tmp_path / "upstream", kind)
    assert mrl_plugins.enable(enabled, UPSTREAM) is enabled
    enabled.train()
    for key in ("loss", "reward"):
        a, b = _history(vanilla, key), _history(enabled, key)
        assert len(a) == 4 and len(a) == len(b)
        assert a == pytest.approx(b, abs=1e-6), key
    assert enabled.use_vllm is False  # nothing of TRL replaced


def test_bad_config_leaves_trainer_untouched(tmp_path):
    import mrl_plugins
    from mrl_plugins.errors import ConfigError, PluginError

    trainer = _trainer(tmp_path)
    before = (trainer.use_vllm, trainer.get_train_dataloader, trainer.log, trainer.train)
    bad = [
        ({"plugins": {"rollout": "nope", "weight_sync": "upstream", "comm": "upstream"}}, PluginError, "nope"),
        ({"mode": "cluster"}, ConfigError, "colocate"),
        ({"comm": {"codec": "zip"}}, ConfigError, "fp16"),
        ({"rollout": {"pipelin": "async"}}, ConfigError, "pipelin"),
        (
            {"plugins": {"rollout": "upstream", "weight_sync": "mrl", "comm": "upstream"}},
            ConfigError,
            "inference copy",
        ),
        (
            {
                "mode": "hybrid",
                "rollout": {"workers": 2, "colocated_workers": 1, "rebalance": True},
                "weight_sync": {"transport": "broadcast"},
            },
            ConfigError,
            "cannot rejoin",
        ),
    ]
    for config, exc, word in bad:
        with pytest.raises(exc, match=word):
            mrl_plugins.enable(trainer, config)
        assert (trainer.use_vllm, trainer.get_train_dataloader, trainer.log, trainer.train) == before
        assert getattr(trainer, "_mrl_state", None) is None


def test_unsupported_trl_version_and_trainer_type():
    from mrl_plugins.adapters.trl import check_trl_version, trainer_kind
    from mrl_plugins.errors import PluginError, UnsupportedVersionError

    tested = r"tested: TRL 1\.14\.x, 1\.15\.x, 1\.16\.x"
    with pytest.raises(UnsupportedVersionError, match=rf"1\.13\.0.*supported: trl.*{tested}"):
        check_trl_version("1.13.0")
    with pytest.raises(UnsupportedVersionError, match="1.17.0"):
        check_trl_version("1.17.0")
    for ok in ("1.14.0", "1.14.2", "1.15.0", "1.16.3"):
        assert check_trl_version(ok) == ok
    with pytest.raises(PluginError, match="GRPOTrainer"):
        trainer_kind(object())


def test_enable_takes_the_device_the_model_is_on(tmp_path):
    """train.device is where mrl run / compare put the model; enable() follows the model, whatever it says."""
    import mrl_plugins

    trainer = _trainer(tmp_path)
    mrl_plugins.enable(trainer, {**UPSTREAM, "train": {"device": "npu"}})
    assert trainer._mrl_state.ctx.config.device == "cpu"
    mrl_plugins.disable(trainer)


def test_missing_device_is_an_error_before_anything():
    """mrl run / compare: a train.device that is absent is refused before the model is built."""
    from mrl_plugins.errors import DeviceError
    from mrl_plugins.run import preflight

    with pytest.raises(DeviceError, match="npu"):
        preflight({"train": {"device": "npu", "model": "tiny"}}, enable_plugins=False)


@pytest.mark.slow
def test_in_process_engine_generates_with_synced_weights(tmp_path):
    """rollout.workers: 0 -- separate inference copy in the trainer process, weights through shm double buffer."""
    import mrl_plugins

    trainer = _trainer(tmp_path, steps=3)
    mrl_plugins.enable(trainer, {"rollout": {"workers": 0}})
    assert trainer.use_vllm is True
    # the stage asks its host only through the host-neutral interface
    assert isinstance(trainer.vllm_generation, mrl_plugins.hookspecs.RolloutHost)
    trainer.train()
    diffs = _history(trainer, "sampling/sampling_logp_difference/max")
    assert len(diffs) == 3 and max(diffs) < 1e-4  # generation used exactly the trained weights (fp32 on CPU)
    assert all(v >= 0 for v in _history(trainer, "mrl/weights/bytes"))
    assert _history(trainer, "mrl/weights/version")[-1] == 2


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_peft_policy_generates_with_the_merged_trained_weights(tmp_path, workers, monkeypatch):
    """A LoRA policy: the inference copy is the merged base model and every version lands by name.

    workers 0: an in-process copy (fp32, exact); workers 1: a worker process with TRL's logprobs
    through fp16 frames (the comm codec), generation taking turns with training.
    """
    import peft
    import torch
    import trl

    import mrl_plugins
    from mrl_plugins.demo.models import build_dataset, build_model, count_reward, preset
    from mrl_plugins.run import _trl_args
    from mrl_plugins.weight_sync import sources

    model, tok = build_model("tiny")
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = _trl_args(_cfg(tmp_path, "grpo", 3), str(tmp_path))
    trainer = trl.GRPOTrainer(
        model=model,
        processing_class=tok,
        reward_funcs=count_reward,
        args=trl.GRPOConfig(**args),
        train_dataset=build_dataset(64, words=preset("tiny").prompt_words),
        peft_config=peft.LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    )
    published: list[dict] = []
    source = sources.iter_trainer_weights

    def recording(*a, **kw):  # what each sync published, as merged by the source
        out = {n: t.clone() for n, t in source(*a, **kw)}
        published.append(out)
        return iter(out.items())

    monkeypatch.setattr(sources, "iter_trainer_weights", recording)
    rollout = {"workers": workers, "local_warmup": False, "max_staleness": 0, "placement": "fixed"}
    mrl_plugins.enable(trainer, {"rollout": rollout})
    if workers == 0:  # built when train() begins: build it now to look at the inference copy
        trainer._mrl_state.runtime.start()
    served = trainer._mrl_state.runtime.receiver.model if workers == 0 else None
    trainer.train()
    assert len(published) == 3
    last = published[-1]
    assert any(not torch.equal(last[n], base[n]) for n in last if "q_proj" in n)  # the adapters trained
    if served is not None:  # the inference copy holds the last version's merged weights, under base names
        got = dict(served.named_parameters())
        assert set(got) == set(last) and all(torch.equal(got[n], last[n]) for n in last)
    diffs = _history(trainer, "sampling/sampling_logp_difference/max")
    assert len(diffs) == 3 and max(diffs) < (1e-4 if workers == 0 else 5e-3)
    assert _history(trainer, "mrl/weights/version")[-1] == 2
    if workers == 0:
        assert _history(trainer, "mrl/weights/switches") == [1, 1, 1]
        assert _history(trainer, "mrl/weights/active_version") == [0, 1, 2]
    else:
        assert _history(trainer, "mrl/rollout/staleness") == [0, 0, 0]


@pytest.mark.slow
def test_two_workers_take_every_version_through_a_broadcast_group(tmp_path):
    """weight_sync.transport: broadcast with rollout.workers: 2 -- the trainer and both workers form one group;
    generation taking turns with training uses the weights of the step it serves (fp16 frames). The workers'
    idle polling is off (30 s): every sync reaches them through the pool's publish notice, or the trainer's
    publish would wait for them past its 20 s timeout."""
    import time

    import mrl_plugins

    trainer = _trainer(tmp_path, steps=4)
    mrl_plugins.enable(
        trainer,
        {
            "rollout": {
                "workers": 2,
                "local_warmup": False,
                "max_staleness": 0,
                "oversubscribe": True,
                "placement": "fixed",
            },
            "weight_sync": {"transport": "broadcast", "timeout_s": 20, "poll_interval_s": 30},
        },
    )
    t0 = time.monotonic()
    trainer.train()
    assert time.monotonic() - t0 < 60  # no publish waited for a poll
    diffs = _history(trainer, "sampling/sampling_logp_difference/max")
    assert len(diffs) == 4 and max(diffs) < 5e-3
    assert _history(trainer, "mrl/rollout/staleness") == [0, 0, 0, 0]


def _count_forwards_and_inputs(trainer):
    """Wrap TRL's logprob forward (count calls) and compute_loss (keep its inputs)."""
    calls, seen = [], []
    orig_fwd, orig_loss = trainer._get_per_token_logps_and_entropies, trainer.compute_loss

    def fwd(*args, **kwargs):
        calls.append(1)
        return orig_fwd(*args, **kwargs)

    def loss(model, inputs, *args, **kwargs):
        seen.append({k: v.detach().clone() for k, v in inputs.items() if hasattr(v, "detach")})
        return orig_loss(model, inputs, *args, **kwargs)

    trainer._get_per_token_logps_and_entropies, trainer.compute_loss = fwd, loss
    return calls, seen


@pytest.mark.slow
def test_engine_logprobs_replace_trls_extra_forward(tmp_path):
    """rollout.old_logps: engine -- the loss takes the sampling logprobs as old logprobs, one forward fewer."""
    import torch

    import mrl_plugins

    counts = {}
    for mode in ("trainer", "engine"):
        trainer = _trainer(tmp_path / mode, steps=3)
        mrl_plugins.enable(trainer, {"rollout": {"workers": 0, "old_logps": mode}})
        calls, seen = _count_forwards_and_inputs(trainer)
        trainer.train()
        counts[mode] = len(calls)
        assert len(seen) == 3
        if mode == "engine":
            for inputs in seen:
                mask = inputs["completion_mask"].bool()
                old, sampled = inputs["old_per_token_logps"], inputs["sampling_per_token_logps"]
                assert torch.equal(old[mask], sampled[mask])
            assert trainer.vllm_importance_sampling_correction is False
            # on-policy here (in-process engine synced every step): the ratio starts at 1, nothing clipped
            assert max(_history(trainer, "clip_ratio/region_mean")) < 1e-6
    assert counts == {"trainer": 6, "engine": 3}  # TRL's no-grad forward per generation is gone


def test_engine_logprobs_refused_where_unsound(tmp_path):
    import mrl_plugins
    from mrl_plugins.errors import ConfigError

    rloo = _trainer(tmp_path / "rloo", "rloo")
    with pytest.raises(ConfigError, match="GRPO only.*valid here: 'trainer'"):
        mrl_plugins.enable(rloo, {"rollout": {"workers": 0, "old_logps": "engine"}})
    top_p = _trainer(tmp_path / "top_p")
    top_p.top_p = 0.9
    with pytest.raises(ConfigError, match="temperature-only.*top_p"):
        mrl_plugins.enable(top_p, {"rollout": {"workers": 0, "old_logps": "engine"}})
    assert getattr(top_p, "_mrl_state", None) is None and top_p.use_vllm is False
    with pytest.raises(ConfigError, match="old_logps: 'both' invalid; valid: 'engine' or 'trainer'"):
        mrl_plugins.enable(top_p, {"rollout": {"old_logps": "both"}})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_worker_pool_async_trains_and_cleans_up(tmp_path, kind):
    import psutil

    import mrl_plugins

    trainer = _trainer(tmp_path, kind, steps=4)
    from mrl_plugins.config import load_config, load_yaml

    cfg = load_yaml("colocate")
    cfg.setdefault("rollout", {})
    cfg["rollout"].update(local_warmup=False, placement="fixed")  # every batch from the worker process
    mrl_plugins.enable(trainer, load_config(cfg))
    pool = trainer._mrl_state.runtime.pool
    pids = list(pool.pids)
    assert pids and all(psutil.pid_exists(p) for p in pids)
    trainer.train()
    rewards = _history(trainer, "reward")
    assert len(rewards) == 4
    assert sum(_history(trainer, "mrl/rollout/lookahead_hits")) >= 2
    assert not _history(trainer, "mrl/rollout/follow_up_turns")  # one turn per batch: every one read ahead
    staleness = _history(trainer, "mrl/rollout/staleness")
    assert staleness and max(staleness) <= 1
    assert any(k.startswith("mrl/comm/") for h in trainer.state.log_history for k in h)
    for pid in pids:  # shut down with train()
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


SCRIPT = textwrap.dedent(
    """
    import os, sys
    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    from trl import GRPOConfig, GRPOTrainer
    from mrl_plugins.demo.models import build_model, build_dataset, count_reward
    m, t = build_model("tiny")
    args = GRPOConfig(output_dir=sys.argv[1], max_steps=1, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=4, report_to=[], use_cpu=True, save_strategy="no")
    cls = GRPOTrainer
    if sys.argv[2:] == ["subclass"]:  # a script's own trainer class: enabled once its __init__ has run
        class MyTrainer(GRPOTrainer):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.mine = True
        cls = MyTrainer
    tr = cls(model=m, processing_class=t, reward_funcs=count_reward, args=args, train_dataset=build_dataset(16))
    state = getattr(tr, "_mrl_state", None)
    print("ENABLED", None if state is None else state.pm.selected)
    """
)


@pytest.mark.slow
def test_env_variable_switches_plugins_on_at_startup(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "MRL_PLUGINS"}
    off = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    assert "ENABLED None" in off.stdout, off.stderr[-2000:]
    env["MRL_PLUGINS"] = "upstream"
    on = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "subclass"], env=env, capture_output=True, text=True, timeout=300
    )
    assert "ENABLED {'rollout': 'upstream', 'weight_sync': 'upstream', 'comm': 'upstream'}" in on.stdout, on.stderr[
        -2000:
    ]
    # one visible line says what is replaced (nothing here) and where it runs
    line = "mrl-plugins: rollout=upstream (TRL generates with the training model), weight_sync=upstream, comm=upstream"
    assert on.stderr.count("mrl-plugins: ") == 1 and line in on.stderr, on.stderr[-2000:]
    assert "mrl-plugins: " not in off.stderr
    if len(os.sched_getaffinity(0)) >= 2:  # the bundled colocate config: one worker on core 1, the trainer on 0
        env["MRL_PLUGINS"] = "colocate"
        colocate = subprocess.run(
            [sys.executable, str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
        )
        line = (  # placement auto, the default: the run measures and keeps the faster arrangement
            "mrl-plugins: rollout=mrl (1 worker, cores [1]; trainer cores [0]; placement auto: this split or taking "
            "turns on all cores, from measured stage times), weight_sync=shm, comm=shm/raw"
        )
        assert line in colocate.stderr, colocate.stderr[-2000:]


@pytest.mark.slow
def test_trainer_model_answers_while_workers_start(tmp_path):
    """local_warmup: the first batches come from the trainer's own model; training mode is kept."""
    import mrl_plugins
    from mrl_plugins.config import load_config, load_yaml

    trainer = _trainer(tmp_path, steps=3)
    cfg = load_yaml("disaggregated")
    cfg.setdefault("rollout", {})
    cfg["rollout"]["start_method"] = "spawn"  # a worker that takes seconds to start (a forked one is ready at once)
    cfg["rollout"]["placement"] = "fixed"  # the split from the start: its warm-up
    cfg.pop("train", None)
    mrl_plugins.enable(trainer, load_config(cfg))
    trainer.train()
    assert len(_history(trainer, "reward")) == 3  # logged as training steps, not eval_*
    assert sum(_history(trainer, "mrl/rollout/local_batches")) >= 1
    assert trainer.model.training


def test_enable_refuses_more_workers_than_cores_before_anything_changes(tmp_path):
    import mrl_plugins
    from mrl_plugins.errors import ConfigError

    if len(os.sched_getaffinity(0)) > 8:
        pytest.skip("needs a machine with at most 8 cores")
    trainer = _trainer(tmp_path)
    before = (trainer.use_vllm, trainer.get_train_dataloader, trainer.train)
    with pytest.raises(ConfigError, match=r"rollout.workers: 50 rollout worker\(s\) but only \d+ CPU core"):
        mrl_plugins.enable(trainer, {"rollout": {"workers": 50}})
    assert (trainer.use_vllm, trainer.get_train_dataloader, trainer.train) == before
    assert getattr(trainer, "_mrl_state", None) is None


def test_upstream_rollout_runtime_is_trls_own_generation(tmp_path):
    """``rollout: upstream`` opens a runtime that declares ``replaces_host = False``: the adapter leaves TRL's
    generation in place (no ``vllm_generation`` patch) and never asks the runtime to generate."""
    import mrl_plugins
    from mrl_plugins.errors import PluginError
    from mrl_plugins.upstream import TrainerGeneration

    trainer = _trainer(tmp_path, steps=1)
    mrl_plugins.enable(trainer, UPSTREAM)
    runtime = trainer._mrl_state.runtime
    assert isinstance(runtime, TrainerGeneration) and runtime.replaces_host is False
    assert trainer.use_vllm is False and "vllm_generation" not in trainer.__dict__
    with pytest.raises(PluginError, match="leaves TRL's own generation in place"):
        runtime.generate([[1, 2]], 2, "policy")
    assert runtime.publish(1, []) is None  # it generates with the training model: nothing to sync
    mrl_plugins.disable(trainer)


def test_startup_variable_errors_name_the_variable_and_its_valid_values(tmp_path, monkeypatch):
    """A trainer built while MRL_PLUGINS is set and wrong: the error says it came from MRL_PLUGINS, and a value
    that reads as "off" says how the plugins are switched off and what the variable takes."""
    from mrl_plugins.adapters.trl import enable_from_env
    from mrl_plugins.errors import ConfigError

    trainer = _trainer(tmp_path, steps=1)
    monkeypatch.setenv("MRL_PLUGINS", str(tmp_path / "nosuch.yaml"))
    with pytest.raises(ConfigError, match=rf"^MRL_PLUGINS={tmp_path / 'nosuch.yaml'}: config file .* not found"):
        enable_from_env(trainer)
    monkeypatch.setenv("MRL_PLUGINS", "off")
    with pytest.raises(ConfigError, match=r"^MRL_PLUGINS=off: the plugins are off when MRL_PLUGINS is unset.*1 / tr"):
        enable_from_env(trainer)
    assert getattr(trainer, "_mrl_state", None) is None
