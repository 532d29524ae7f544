"""``trl grpo --config x.yaml`` with ``MRL_PLUGINS`` in the YAML's ``env:`` block, and ``mrl trl grpo``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.marks import require_trl

pytestmark = [require_trl, pytest.mark.slow]

PROBE = "mrl_plugins_probe"


def _workspace(tmp_path: Path, mrl_value: str | None) -> Path:
    from mrl_plugins.demo.models import build_dataset, build_model

    model, tok = build_model("tiny")
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    data = tmp_path / "data"
    data.mkdir()
    with open(data / "train.jsonl", "w", encoding="utf-8") as fh:
        for row in build_dataset(32):
            fh.write(json.dumps(row) + "\n")
    # a reward function module that also reports whether the plugins were switched on in this process
    (tmp_path / f"{PROBE}.py").write_text(
        "import gc, json, os\n"
        "from mrl_plugins.demo.models import count_reward as _count\n"
        "def reward(completions, **kw):\n"
        "    from trl import GRPOTrainer\n"
        "    trainers = [o for o in gc.get_objects() if isinstance(o, GRPOTrainer)]\n"
        "    st = getattr(trainers[0], '_mrl_state', None) if trainers else None\n"
        "    with open(os.environ['PROBE_OUT'], 'w') as fh:\n"
        "        json.dump(None if st is None else st.pm.selected, fh)\n"
        "    return _count(completions)\n"
    )
    env_block = f"env:\n  MRL_PLUGINS: {mrl_value}\n" if mrl_value else ""
    (tmp_path / "grpo.yaml").write_text(
        f"model_name_or_path: {tmp_path / 'model'}\n"
        f"dataset_name: {data}\n"
        f"reward_funcs: [{PROBE}.reward]\n"
        f"output_dir: {tmp_path / 'out'}\n"
        "max_steps: 2\nper_device_train_batch_size: 4\nnum_generations: 4\nmax_completion_length: 4\n"
        "use_cpu: true\nbf16: false\nreport_to: none\nsave_strategy: 'no'\nlogging_steps: 1\n" + env_block
    )
    return tmp_path


def _run(cmd: list[str], cwd: Path, probe: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MRL_PLUGINS"}
    path = os.pathsep.join([str(cwd), *filter(None, [os.environ.get("PYTHONPATH")])])  # keep tox's (TRL 1.15 on CPU)
    env.update(PROBE_OUT=str(probe), HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", PYTHONPATH=path)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _trl() -> str:
    exe = shutil.which("trl", path=os.path.dirname(sys.executable)) or shutil.which("trl")
    if exe is None:
        pytest.skip("the trl console script is not installed")
    return exe


@pytest.mark.parametrize(("value", "expected"), [(None, None), ("upstream", "upstream"), ("colocate", "mrl")])
def test_trl_cli_env_block(tmp_path, value, expected):
    ws = _workspace(tmp_path, value)
    probe = ws / "probe.json"
    proc = _run([_trl(), "grpo", "--config", str(ws / "grpo.yaml")], ws, probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    selected = json.loads(probe.read_text())
    assert (selected or {}).get("rollout") == expected


def test_mrl_trl_wrapper(tmp_path):
    ws = _workspace(tmp_path, None)
    probe = ws / "probe.json"
    mrl = shutil.which("mrl", path=os.path.dirname(sys.executable)) or "mrl"
    proc = _run([mrl, "trl", "grpo", "--config", str(ws / "grpo.yaml")], ws, probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(probe.read_text())["rollout"] == "mrl"


def test_mrl_trl_checks_the_value_of_the_env_block(tmp_path):
    """The env: block's MRL_PLUGINS is what TRL's processes get (TRL sets it over the environment): `mrl trl` checks
    that value, in seconds, before TRL loads anything; a correct one is the one that runs."""
    ws = _workspace(tmp_path, "colocat")
    probe = ws / "probe.json"
    mrl = shutil.which("mrl", path=os.path.dirname(sys.executable)) or "mrl"
    proc = _run([mrl, "trl", "grpo", "--config", str(ws / "grpo.yaml")], ws, probe)
    assert proc.returncode == 2, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith("mrl trl: error: MRL_PLUGINS=colocat (the env: block of "), errors
    assert "'colocat' not found" in errors[0] and not probe.exists()
    (tmp_path / "ok").mkdir()
    ws = _workspace(tmp_path / "ok", "upstream")
    probe = ws / "probe.json"
    proc = _run([mrl, "trl", "grpo", "--config", str(ws / "grpo.yaml")], ws, probe)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(probe.read_text())["rollout"] == "upstream"
