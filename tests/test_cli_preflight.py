"""``mrl run`` / ``mrl compare`` / ``mrl trl`` refuse a bad config before anything expensive is built.

Each case runs the real command in a fresh interpreter under ``python -X importtime``: the error must be one
line (exit 2, no traceback) and the process must never have imported ``transformers`` or ``trl``, i.e. no model,
tokenizer or trainer was built before the check. The worker-count check also runs with its opt-in, for real.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.config import RolloutConfig
from tests.marks import require_trl

pytestmark = require_trl

CORES = sorted(os.sched_getaffinity(0))
#: what the TRL adapter leaves to workers on CPU: every core but the trainer's (one core: shared)
FREE = len(CORES) - 1 if len(CORES) > 1 else 1


def _mrl(*args: str, cwd: Path, env_extra: dict[str, str] | None = None, timeout: float = 300):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    env.update(TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", **(env_extra or {}))
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mrl_plugins.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    imported = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", proc.stderr, re.M)}
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    return proc, imported, errors


def _assert_refused_early(proc, imported, errors, *expected: str) -> None:
    assert proc.returncode == 2, "\n".join(errors[-30:])
    assert len(errors) == 1, errors[-30:]
    assert all(e in errors[0] for e in expected), errors[0]
    assert imported, "no -X importtime output: the import check would pass vacuously"
    built = sorted(m for m in imported if m.split(".")[0] in ("transformers", "trl", "datasets"))
    assert not built, f"imported {built[:5]} before refusing: the model or trainer was being built"


def _cuda_or_npu_present() -> bool:
    from mrl_plugins.device import available_device_types

    return len(available_device_types()) > 1


BAD = {
    "rollout_plugin": ("plugins: {rollout: mlr}\n", ["plugins.rollout: unknown plugin 'mlr'", "'mrl'", "'upstream'"]),
    "comm_codec": ("comm: {codec: fp61}\n", ["comm.codec: unknown comm codec 'fp61'", "'fp16'"]),
    "comm_transport": ("comm: {transport: shmm}\n", ["comm.transport: unknown comm transport 'shmm'", "'shm'"]),
    "weight_transport": ("weight_sync: {transport: shmm}\n", ["weight_sync.transport: unknown", "'shmm'", "'shm'"]),
    "engine": ("rollout: {engine: transformerz}\n", ["rollout.engine: unknown", "'transformerz'", "'transformers'"]),
    "combination": ("plugins: {rollout: upstream, weight_sync: mrl, comm: upstream}\n", ["plugins.weight_sync"]),
    "model": ("train: {model: nope}\n", ["train.model: 'nope' is neither a preset", "'tiny'"]),
    "disable": ("disable: [mrl.bogus]\n", ["disable: unknown plugin 'mrl.bogus'", "'mrl.comm'", "'upstream'"]),
    "threads": ("train: {threads: 1, device: cpu}\n", ["train.threads: 1 would be overridden", "train.threads: 0"]),
    "trl_args_owned": ("train: {trl_args: {max_steps: 4}}\n", ["train.trl_args: 'max_steps' is set by train.steps"]),
    "old_logps_rloo": (
        "rollout: {old_logps: engine}\ntrain: {trainer: rloo}\n",
        ["rollout.old_logps: 'engine' is supported for GRPO only", "valid here: 'trainer'"],
    ),
    "workers": (
        f"rollout: {{workers: {FREE + 1}}}\n",
        [f"{FREE + 1} rollout worker(s) but only {FREE} CPU core(s)", f"may use {len(CORES)} core", "lower rollout"],
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_mrl_run_refuses_before_building_the_model(tmp_path, case):
    text, expected = BAD[case]
    (tmp_path / "bad.yaml").write_text(text)
    model = [] if case == "model" else ["--model", "tiny"]  # --model would override train.model
    _assert_refused_early(*_mrl("run", "--config", "bad.yaml", *model, cwd=tmp_path), "mrl run:", *expected)


@pytest.mark.parametrize("vanilla", [False, True])
def test_mrl_run_refuses_an_unknown_trl_argument_before_building_the_model(tmp_path, vanilla):
    """train.trl_args is checked against the installed TRL's GRPOConfig (which imports TRL, so the last check), with
    the close names, before the preset is built and saved into the output folder."""
    (tmp_path / "bad.yaml").write_text(
        f"train: {{trl_args: {{num_generationz: 4}}, output_dir: {tmp_path / 'out'}}}\n"
    )
    args = ["run", "--config", "bad.yaml", "--model", "tiny", *(["--vanilla"] if vanilla else [])]
    proc, _imported, errors = _mrl(*args, cwd=tmp_path)
    assert proc.returncode == 2 and len(errors) == 1, errors[-30:]
    assert "train.trl_args: 'num_generationz' is not a GRPOConfig argument (TRL " in errors[0]
    assert "did you mean 'num_generations'" in errors[0] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", ["npu", "npu:1", "cuda:3"])
def test_mrl_run_absent_device_is_the_plugins_device_error(tmp_path, device):
    if _cuda_or_npu_present():
        pytest.skip("an accelerator is present: the absent-device case needs a CPU-only machine")
    (tmp_path / "dev.yaml").write_text(f"train: {{device: '{device}'}}\n")
    proc, imported, errors = _mrl("run", "dev.yaml", "--model", "tiny", cwd=tmp_path)  # positional CONFIG kept
    _assert_refused_early(proc, imported, errors, f"device {device!r} is not present", "available: 'auto' or 'cpu'")
    assert "bf16" not in proc.stderr  # TRL's own refusal never ran


def test_mrl_run_vanilla_checks_the_device_too(tmp_path):
    if _cuda_or_npu_present():
        pytest.skip("needs a CPU-only machine")
    (tmp_path / "dev.yaml").write_text("train: {device: npu}\n")
    _assert_refused_early(*_mrl("run", "--config", "dev.yaml", "--vanilla", cwd=tmp_path), "device 'npu'")


def test_mrl_run_env_disable_typo(tmp_path):
    proc, imported, errors = _mrl(
        "run", "--config", "colocate", "--model", "tiny", cwd=tmp_path, env_extra={"MRL_DISABLED_PLUGINS": "mrl.comms"}
    )
    _assert_refused_early(proc, imported, errors, "MRL_DISABLED_PLUGINS: unknown plugin 'mrl.comms'", "'mrl.comm'")


def test_mrl_run_two_different_configs_is_a_usage_error(tmp_path):
    proc, _, errors = _mrl("run", "colocate", "--config", "hybrid", cwd=tmp_path)
    assert proc.returncode == 2 and "two configs given" in errors[-1]


def test_mrl_run_config_option_takes_bundled_names(tmp_path):
    """--config colocate resolves the bundled file (it gets as far as the model check)."""
    _assert_refused_early(*_mrl("run", "--config", "colocate", "--model", "nope", cwd=tmp_path), "train.model: 'nope'")


@pytest.mark.parametrize("case", ["comm_codec", "weight_transport", "workers", "model"])
def test_mrl_compare_refuses_before_the_first_run(tmp_path, case):
    text, expected = BAD[case]
    (tmp_path / "bad.yaml").write_text(text)
    out = tmp_path / "out"
    model = [] if case == "model" else ["--model", "tiny"]
    proc, imported, errors = _mrl("compare", "--config", "bad.yaml", *model, "--out", str(out), cwd=tmp_path)
    _assert_refused_early(proc, imported, errors, "mrl compare:", *expected)
    assert not out.exists()  # refused before the output folder, let alone a run, was made


def test_mrl_compare_positional_config(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD["comm_codec"][0])
    proc, imported, errors = _mrl("compare", "bad.yaml", "--out", str(tmp_path / "o"), cwd=tmp_path)
    _assert_refused_early(proc, imported, errors, "comm.codec")


def test_mrl_trl_checks_mrl_plugins_before_trl_starts(tmp_path):
    (tmp_path / "bad.yaml").write_text(BAD["rollout_plugin"][0])
    proc, imported, errors = _mrl(
        "trl", "grpo", "--config", "grpo.yaml", cwd=tmp_path, env_extra={"MRL_PLUGINS": str(tmp_path / "bad.yaml")}
    )
    _assert_refused_early(proc, imported, errors, "mrl trl: error: MRL_PLUGINS=", "unknown plugin 'mlr'")


def test_plugins_env_typo_in_mrl_trl(tmp_path):
    proc, imported, errors = _mrl("trl", "grpo", cwd=tmp_path, env_extra={"MRL_PLUGINS": "rollout=mlr"})
    _assert_refused_early(proc, imported, errors, "MRL_PLUGINS=rollout=mlr", "unknown plugin 'mlr'")


@pytest.mark.slow
def test_oversubscribe_opt_in_runs(tmp_path):
    """The same worker count with rollout.oversubscribe (internal: the tests' and benchmarks' way to let workers
    share cores on a small machine) trains and uses the workers."""
    n = FREE + 1
    (tmp_path / "over.yaml").write_text(
        f"rollout: {{workers: {n}, oversubscribe: true, local_warmup: false, placement: fixed}}\n"
        "train: {model: tiny, steps: 2}\n"
    )
    proc, _, errors = _mrl(
        "run", "--config", "over.yaml", "--json", "r.json", "--quiet", cwd=tmp_path, timeout=600,
        env_extra={"MRL_ALLOW_INTERNAL_KEYS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, "\n".join(errors[-40:])
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 2 and result["plugins"]["rollout"] == "mrl"
    assert result["mrl_metrics"]["mrl/comm/frames"] > 0  # the batches came from the workers


# -------------------------------------------------------------------------------------------------------------------
# the placement rule itself (accelerator counts cannot be produced on this machine: the rule is pure)
# -------------------------------------------------------------------------------------------------------------------


def test_placement_rule_cpu():
    rc = RolloutConfig(workers=3)
    with pytest.raises(ConfigError, match=r"3 rollout worker\(s\) but only 1 CPU core\(s\)"):
        rc.check_placement("colocate", "cpu", [0, 1])
    rc.check_placement("colocate", "cpu", [0, 1, 2, 3])  # 3 free cores
    RolloutConfig(workers=3, oversubscribe=True).check_placement("colocate", "cpu", [0, 1])
    RolloutConfig(workers=1).check_placement("colocate", "cpu", [0])  # one core: shared by design
    # hybrid: colocated workers share the trainer's cores, only the dedicated ones need free cores
    RolloutConfig(workers=2, colocated_workers=1).check_placement("hybrid", "cpu", [0, 1])
    with pytest.raises(ConfigError, match=r"rollout.engine_cores lists 1"):
        RolloutConfig(workers=2, engine_cores=[1]).check_placement("colocate", "cpu", [0, 1, 2])
    # counted as device.placement places them: a worker core the trainer also keeps is not the worker's own
    with pytest.raises(ConfigError, match=r"2 rollout worker\(s\) but only 1 CPU core\(s\)"):
        RolloutConfig(workers=2, engine_cores=[0, 1], trainer_cores=[0]).check_placement("colocate", "cpu", [0, 1, 2])
    with pytest.raises(ConfigError, match=r"only 1 CPU core\(s\).*the trainer keeps 2"):
        RolloutConfig(workers=2, trainer_cores=[0, 1]).check_placement("colocate", "cpu", [0, 1, 2])


def test_placement_rule_devices():
    with pytest.raises(ConfigError, match=r"2 dedicated worker\(s\).*devices 1\.\.2.*only 2 cuda device"):
        RolloutConfig(workers=2).check_placement("disaggregated", "cuda", [0, 1], devices=2)
    RolloutConfig(workers=1).check_placement("disaggregated", "cuda", [0, 1], devices=2)
    RolloutConfig(workers=8).check_placement("colocate", "npu", [0, 1], devices=1)  # all share the trainer's card
    with pytest.raises(ConfigError, match=r"after the trainer's 1\) but only 2 npu"):
        RolloutConfig(workers=1).check_placement("disaggregated", "npu", [0], devices=2, device_index=1)


def test_train_threads_is_refused_wherever_the_placement_sets_the_trainers_threads():
    """Local or remote workers alike: on a CPU with cores to split the trainer gets its own cores and threads, so a
    train.threads would be overridden; without workers it is the run's."""
    from mrl_plugins.errors import ConfigError
    from mrl_plugins.run import preflight

    remote = {"workers": 0, "remote_workers": 1, "rendezvous": "127.0.0.1:29555"}
    for rollout in ({"workers": 1}, remote):
        data = {"rollout": rollout, "train": {"threads": 2, "device": "cpu", "model": "tiny"}}
        if len(CORES) > 1:
            with pytest.raises(ConfigError, match=r"^train\.threads: 2 would be overridden"):
                preflight(data)
    preflight({"rollout": {"workers": 0}, "train": {"threads": 2, "device": "cpu", "model": "tiny"}})
