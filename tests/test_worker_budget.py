"""Every rollout worker applies its compute budget through the device layer and reports what it applied.

CPU: a real worker process (affinity and threads it reports = the configured ones = what the kernel shows).
NPU: there is no NPU here, so the worker's own budget function runs against the FAKE torch_npu (tests/fakes), which
records the calls that would reach torch_npu: the configured core limits reach set_device_limit / set_stream_limit.
"""

from __future__ import annotations

import os
import time

import pytest

from mrl_plugins.config import load_config
from mrl_plugins.errors import ConfigError
from mrl_plugins.rollout.worker import WorkerSpec, apply_worker_budget, budget_metrics
from tests.fakes import fake_torch_npu
from tests.marks import require_trl


def _spec(config: dict, device: str, cores=None, threads=1) -> WorkerSpec:
    return WorkerSpec(
        index=0, config=load_config(config), models={}, sampling=None, engine_factory=None, comm_handle=None,
        cores=cores, threads=threads, plugin_factory=None, device=device,
    )  # fmt: skip


@pytest.fixture
def no_cuda(monkeypatch):
    from mrl_plugins.device import probe

    monkeypatch.setattr(probe, "is_cuda_available", lambda: False)
    monkeypatch.setattr(probe, "cuda_device_count", lambda: 0)


def test_npu_worker_budget_reaches_torch_npu_core_limits(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    spec = _spec({"rollout": {"engine_budget": {"npu_cube_cores": 8, "npu_vector_cores": 16}}}, "npu:1")
    device, applied = apply_worker_budget(spec)
    assert device.type == "npu" and ("set_device_limit", 1, 8, 16) in mod.calls
    report = budget_metrics({0: {"budget": applied.as_dict()}})
    assert report["rollout/budget_npu_cube_cores/0"] == 8 and report["rollout/budget_npu_vector_cores/0"] == 16


def test_npu_worker_with_a_priority_stream_limits_that_stream(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    cfg = {"rollout": {"engine_budget": {"npu_cube_cores": 4, "npu_vector_cores": 8, "stream_priority": "high"}}}
    _device, applied = apply_worker_budget(_spec(cfg, "npu:0"))
    assert applied.stream is not None
    assert [c for c in mod.calls if c[0] == "set_stream_limit"][-1][2:] == (4, 8)


def test_engine_budget_keys_are_checked_with_the_config():
    with pytest.raises(ConfigError, match="unknown rollout.engine_budget key 'npu_cubes'"):
        load_config({"rollout": {"engine_budget": {"npu_cubes": 8}}})
    with pytest.raises(
        ConfigError, match=r"cores are those outside rollout\.trainer_cores, their threads rollout\.eng"
    ):
        load_config({"rollout": {"engine_budget": {"cores": [0]}}})
    for named in ("rollout.trainer_cores", "rollout.engine_threads"):  # settable keys, not internal ones
        load_config({"rollout": {named.split(".")[1]: 1 if named.endswith("threads") else [0]}})
    with pytest.raises(ConfigError, match="stream_priority: 'urgent' invalid; valid: 'high', 'low' or 'normal'"):
        load_config({"rollout": {"engine_budget": {"stream_priority": "urgent"}}})


@require_trl
@pytest.mark.slow
def test_a_cpu_worker_reports_the_budget_it_applied():
    import psutil

    from tests.pool_helpers import make_pool

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    pool, model, *_ = make_pool(placements=[{"cores": [1], "threads": 1}])
    try:
        pool.publish(0, list(model.named_parameters()))
        pool.collect(pool.submit([[3, 4, 5]], 2))
        deadline = time.monotonic() + 30
        while "memory" not in pool.budgets.get(0, {}) and time.monotonic() < deadline:  # sent after the batch
            time.sleep(0.05)
            pool.stats()
        stats = pool.stats()
        reported = pool.budgets[0]["budget"]
        assert reported["cores"] == [1] and reported["threads"] == 1
        assert psutil.Process(reported["pid"]).cpu_affinity() == [1]  # what the kernel says
        assert stats["rollout/budget_cores/0"] == 1 and stats["rollout/budget_threads/0"] == 1
        assert pool.budgets[0]["memory"]["peak_bytes"] > 0  # measured at the first generation
        assert stats["rollout/budget_memory_fraction/0"] == 0.0  # CPU: measured, nothing capped
    finally:
        pool.close()
