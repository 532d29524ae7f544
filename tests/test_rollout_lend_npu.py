"""``rollout.lend_cores`` on an accelerator: the NPU training stream's core share (torch_npu ``set_stream_limit``)
is raised while the colocated worker is idle and set back before each generation request; CUDA and CPU lend
nothing through the device.

No NPU exists here: torch_npu is a FAKE (tests/fakes/fake_torch_npu.py) that records the calls and keeps the
limits, handed only to the lender (``mrl_plugins.device.npu.npu_namespace``), so the rest of the run stays on the
CPU. The run itself is a real TRL GRPO run with a real rollout worker process; the trainer's device is reported as
``npu:0`` to the lender only. Unverified on hardware.
"""

from __future__ import annotations

import logging
import time
import types

import pytest

from mrl_plugins.device import CpuDevice, CudaDevice, NpuDevice
from mrl_plugins.device import npu as npu_module
from mrl_plugins.device.lending import CUDA_NOTHING_TO_LEND, open_lender, split_share
from mrl_plugins.rollout import arrangement
from tests.fakes import fake_torch_npu
from tests.marks import require_trl

BUDGET = {"npu_cube_cores": 8, "npu_vector_cores": 16}
FULL = {"cube_core_num": fake_torch_npu.DEFAULT_CUBE, "vector_core_num": fake_torch_npu.DEFAULT_VECTOR}
SHARE = {"cube_core_num": fake_torch_npu.DEFAULT_CUBE - 8, "vector_core_num": fake_torch_npu.DEFAULT_VECTOR - 16}


def _fake_for_lender(monkeypatch, **kwargs):
    mod = fake_torch_npu.make_module(**kwargs)
    monkeypatch.setattr(npu_module, "npu_namespace", lambda: mod.npu)
    return mod


def test_split_share_is_the_device_minus_the_colocated_workers():
    assert split_share((24, 48), (8, 16), 1) == ((16, 32), "")
    assert split_share((24, 48), (8, -1), 2) == ((8, -1), "")  # vector cores: nobody limited
    share, why = split_share((24, 48), (8, 16), 3)
    assert share is None and "leave none of the NPU's 24" in why
    assert split_share((24, 48), (-1, -1), 1)[0] is None
    assert split_share((24, 48), (8, 16), 0) == (None, "no rollout worker shares the trainer's NPU")


def test_npu_lender_sets_the_share_lends_the_device_and_sets_it_again(monkeypatch):
    mod = _fake_for_lender(monkeypatch)
    lender, why = open_lender(NpuDevice(index=1), BUDGET, 1)
    assert lender is not None and why == ""
    stream = mod.npu.current_stream(1)
    assert lender.stream is stream and lender.share == (16, 32) and lender.full == (24, 48)
    lender.split()
    lender.split()  # no change: no call
    assert mod.npu.get_stream_limit(stream) == SHARE
    lender.lend()
    assert mod.npu.get_stream_limit(stream) == FULL
    lender.split()
    assert mod.npu.get_stream_limit(stream) == SHARE
    lender.close()
    assert mod.npu.get_stream_limit(stream) == FULL
    limit_calls = [c for c in mod.calls if "stream_limit" in c[0]]
    assert limit_calls == [
        ("set_stream_limit", 0, 16, 32),
        ("reset_stream_limit", 0),
        ("set_stream_limit", 0, 16, 32),
        ("reset_stream_limit", 0),
    ]


def test_npu_lender_feature_detects_the_stream_limit_api(monkeypatch):
    mod = _fake_for_lender(monkeypatch, core_limits=False)
    lender, why = open_lender(NpuDevice(index=0), BUDGET, 1)
    assert lender is None and "no set_stream_limit" in why and mod.calls == []


def test_cuda_and_cpu_lend_nothing_through_the_device(monkeypatch):
    mod = _fake_for_lender(monkeypatch)
    lender, why = open_lender(CudaDevice(index=0), BUDGET, 1)
    assert lender is None and why == CUDA_NOTHING_TO_LEND and "per-stream SM share" in why
    assert open_lender(CpuDevice(), BUDGET, 1)[0] is None
    assert open_lender(NpuDevice(index=0), {}, 1)[0] is None  # the worker's share is not limited: nothing to lend
    assert mod.calls == []


def _share(device_type: str) -> arrangement.TrainerShare:
    """The trainer's share of a placement-auto run on ``device_type`` (the run-level test uses PoolRuntime)."""
    rollout = types.SimpleNamespace(lend_cores=True, workers=1, colocated_workers=0, engine_budget=BUDGET)
    ctx = types.SimpleNamespace(config=types.SimpleNamespace(mode="colocate", rollout=rollout))
    return arrangement.TrainerShare(ctx, lambda: device_type, None, lend=True, idle=lambda: True)


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_runtime_opens_no_device_lender_on_cpu_or_cuda(kind, monkeypatch, caplog):
    mod = _fake_for_lender(monkeypatch)
    devices = {"cpu": CpuDevice(), "cuda": CudaDevice(index=0)}
    monkeypatch.setattr(arrangement, "trainer_device", lambda model: devices[model])
    share = _share(kind)
    with caplog.at_level(logging.INFO, logger="mrl_plugins.rollout"):
        assert share.device() is None and share.device() is None
    assert mod.calls == []
    said = [r.getMessage() for r in caplog.records if "lend_cores" in r.getMessage()]
    assert said == ([] if kind == "cpu" else [f"mrl-plugins rollout.lend_cores on cuda:0: {CUDA_NOTHING_TO_LEND}"])


@pytest.mark.slow
@require_trl
def test_npu_split_lends_the_stream_share_and_sets_it_back_before_each_request(
    tmp_path, monkeypatch, caplog, keep_arrangement
):
    from transformers import TrainerCallback

    from tests.test_rollout_autoplace import placement_run

    mod = _fake_for_lender(monkeypatch)
    monkeypatch.setattr(arrangement, "trainer_device", lambda model: NpuDevice(index=0))
    steps = 10
    # spawned: a forked worker would inherit this test's fake NPU (and pytest's warnings-as-errors for its
    # "NPU core limits on a CPU worker" warning); the fake stands for the trainer's device only
    rollout = {"workers": 1, "placement": "auto", "placement_start": "split", "engine_budget": BUDGET,
               "start_method": "spawn"}  # fmt: skip
    trainer = placement_run(tmp_path, steps, rollout, slow_reward=True)
    runtime = trainer._mrl_state.runtime
    at_submit: list[dict] = []  # the training stream's limit when each generation request goes out
    while_lent: list[dict] = []  # ... right after each lend

    def limit() -> dict:
        return dict(mod.npu.get_stream_limit(share.device_lender.stream))

    share = runtime.where.share
    orig_factory, orig_check = runtime._pool_factory, share.check

    def factory():
        pool = orig_factory()
        orig_submit = pool.submit

        def submit(*a, **k):
            at_submit.append(limit())
            return orig_submit(*a, **k)

        pool.submit = submit
        return pool

    streams = []

    def lend_check(*a):
        was = share.now
        orig_check(*a)
        if was == "split" and share.now == "lent":
            while_lent.append(limit())
            streams.append(share.device_lender.stream)

    runtime._pool_factory, share.check = factory, lend_check

    class WaitForWorker(TrainerCallback):
        def on_step_end(self, args, st, control, **kw):
            if st.global_step == 1:
                deadline = time.monotonic() + 120
                while not runtime.pool.ready and time.monotonic() < deadline:
                    time.sleep(0.05)

    trainer.add_callback(WaitForWorker())
    with caplog.at_level(logging.INFO, logger="mrl_plugins.rollout"):
        trainer.train()
    assert len([h for h in trainer.state.log_history if "loss" in h]) == steps
    assert any("lend_cores on npu:0 (unverified on hardware)" in r.getMessage() for r in caplog.records)
    assert len(while_lent) >= 2, (while_lent, at_submit)  # lent in most split steps
    assert all(x == FULL for x in while_lent)  # the whole device while the worker is idle
    assert at_submit and all(x == SHARE for x in at_submit)  # its own share again before every request
    limit_calls = [c[0] for c in mod.calls if "stream_limit" in c[0]]
    assert limit_calls.count("reset_stream_limit") >= len(while_lent)
    assert trainer._mrl_state.ctx.metrics.totals["rollout/lends"] >= len(while_lent)
    # train() ended: the training stream is back to the whole device, the lender gone
    assert share.device_lender is None and dict(mod.npu.get_stream_limit(streams[-1])) == FULL
