"""Third-party plugins replace each stage: ``tests/plugins/mrl_example_plugins`` is pip-installed (its own
pyproject, entry points in the ``mrl_plugins`` group) and selected by name for a GRPO run on the tiny model,
one stage at a time; the complete example of docs/plugins.md (linked from the README) is that package's comm
plugin, verbatim."""

from __future__ import annotations

import importlib
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import doc_blocks
from tests.marks import require_trl

REPO_ROOT = Path(__file__).resolve().parents[1]
PACKAGE = REPO_ROOT / "tests" / "plugins" / "mrl_example_plugins"
NAMES = {"example-comm": ("comm",), "example-weights": ("weight_sync",), "example-rollout": ("rollout",)}


@pytest.fixture(scope="module")
def example_site(tmp_path_factory):
    """``pip install`` of the example package (built from its pyproject by setuptools) into a folder of its own."""
    src = tmp_path_factory.mktemp("example-src") / "mrl_example_plugins"
    shutil.copytree(PACKAGE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("example-site")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index"]
    proc = subprocess.run([*cmd, "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (target / "mrl_example_plugins" / "comm.py").is_file()
    return target


@pytest.fixture
def example_plugins(example_site, monkeypatch):
    """The installed package on ``sys.path`` for one test (spawned rollout workers inherit it)."""
    monkeypatch.syspath_prepend(str(example_site))
    importlib.invalidate_caches()
    yield example_site
    for name in [m for m in sys.modules if m.startswith("mrl_example_plugins")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_installed_plugins_are_found_through_their_entry_points(fresh_pm, example_plugins):
    selection = {stage: name for name, (stage,) in NAMES.items()}
    mgr = fresh_pm({"plugins": selection})
    infos = {row.name: row for row in mgr.plugin_infos() if not row.blocked}
    for name, stages in NAMES.items():
        assert infos[name].source == "entrypoint" and infos[name].stages == stages == infos[name].active_for
    assert str(example_plugins) in sys.modules["mrl_example_plugins.comm"].__file__  # the pip-installed copy
    assert mgr.capabilities("comm").rejoinable and not mgr.capabilities("weight_sync").collective


def _history(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h and "train_runtime" not in h]


@require_trl
@pytest.mark.slow
@pytest.mark.parametrize(
    ("stage", "name", "extra", "evidence"),
    [
        ("comm", "example-comm", {"rollout": {"workers": 1}}, "mrl/comm/received"),
        ("weight_sync", "example-weights", {"rollout": {"workers": 1}}, "mrl/weights/published"),
        ("rollout", "example-rollout", {"rollout": {"workers": 0}}, "mrl/example/generations"),
    ],
)
def test_grpo_runs_with_a_third_party_plugin_for_one_stage(tmp_path, example_plugins, stage, name, extra, evidence):
    """``plugins.<stage>: <entry point>`` with the built-in plugins on the other stages: GRPO trains, the
    third-party plugin's ends carry every batch / version (its counters reach TRL's logs), and the sampling
    logprobs match the trainer's own (the served weights are the trained ones: fp16 frames, 5e-3)."""
    import torch

    import mrl_plugins
    from mrl_plugins.config import load_config
    from mrl_plugins.run import build_trainer

    torch.set_num_threads(1)
    steps = 3
    data = {"train": {"trainer": "grpo", "model": "tiny", "steps": steps, "output_dir": str(tmp_path)}}
    trainer = build_trainer(load_config(data), enable_plugins=False, output_dir=str(tmp_path))
    rollout = {"local_warmup": False, "max_staleness": 0, "placement": "fixed", **extra["rollout"]}
    mrl_plugins.enable(trainer, {"plugins": {stage: name}, "rollout": rollout})
    assert trainer._mrl_state.pm.selected[stage] == name
    trainer.train()
    losses = _history(trainer, "loss")
    assert len(losses) == steps and all(math.isfinite(v) for v in losses)
    seen = _history(trainer, evidence)
    assert len(seen) == steps and all(v >= 1 for v in seen), (evidence, seen)
    diffs = _history(trainer, "sampling/sampling_logp_difference/max")
    assert len(diffs) == steps and max(diffs) < 5e-3, diffs


@pytest.mark.slow
def test_a_registered_codec_is_used_end_to_end(example_plugins):
    """``comm.codec: example-bf16`` (a third-party ``CommCodec`` registration): the rollout worker's producer and
    the trainer's consumer build it from the registry; the logprobs arrive bf16-rounded (shm would send them raw)."""
    import torch

    from tests.pool_helpers import make_pool

    pool, model, _tok, _sampling, _pm, _ctx = make_pool({"comm": {"transport": "shm", "codec": "example-bf16"}})
    try:
        assert type(pool.consumer._codec).__name__ == "ExampleBf16"
        pool.publish(0, list(model.named_parameters()))
        res = pool.collect(pool.submit([[5, 6, 7], [8, 9]], 2, min_version=0))
        lps = torch.tensor([lp for seq in res.logprobs for lp in seq])
        assert len(lps) > 0 and bool((lps < 0).any())
        assert torch.equal(lps, lps.to(torch.bfloat16).float())  # every value survived a bf16 cast unchanged
    finally:
        pool.close(timeout=2)


def test_docs_plugin_example_is_the_tested_package():
    """docs/plugins.md's complete example shows the example comm plugin and its entry points, exactly."""
    section = doc_blocks.section("A complete example: the tested comm plugin", "docs/plugins.md")
    blocks = dict(re.findall(r"^```(\w+)\n(.*?)^```", section, re.S | re.M))
    assert sorted(blocks) == ["python", "toml"], sorted(blocks)
    assert blocks["python"] == (PACKAGE / "mrl_example_plugins" / "comm.py").read_text(encoding="utf-8")
    toml = (PACKAGE / "pyproject.toml").read_text(encoding="utf-8")
    assert blocks["toml"].strip() in toml
