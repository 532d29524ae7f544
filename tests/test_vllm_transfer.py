"""``weight_sync.transport: vllm``: trainer weights into the workers' vLLM engines through vLLM's own weight-transfer
protocol. The end-to-end runs on real vLLM are in ``tests/test_vllm_engine.py`` (the worker-pool test's
``vllm-weight-transfer`` case, a GRPO run); here the configuration and the ends' errors.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from mrl_plugins.errors import ConfigError, MrlError
from mrl_plugins.rollout.engine import SamplingParams
from mrl_plugins.weight_sync.vllm_transfer import VLLMTransferHandle, resolve_backend
from tests.marks import require_vllm


def test_auto_backend_follows_the_trainers_device():
    assert resolve_backend("auto", "cpu") == "mrl_gloo"
    assert resolve_backend("auto", "cuda") == "nccl"
    assert resolve_backend("auto", "npu") == "hccl"
    assert resolve_backend("nccl", "cpu") == "nccl"  # an explicit name is taken as given (checked against vLLM)


def test_vllm_backend_without_the_vllm_transport_is_refused():
    from mrl_plugins.config import load_config

    with pytest.raises(ConfigError, match="read by weight_sync.transport 'vllm' only"):
        load_config({"weight_sync": {"vllm_backend": "nccl"}})
    with pytest.raises(ConfigError, match="vllm_backend must be"):
        load_config({"weight_sync": {"transport": "vllm", "vllm_backend": ""}})


def test_the_engines_weight_transfer_config_is_the_transports_not_an_engine_option():
    from mrl_plugins.config import load_config

    with pytest.raises(ConfigError, match="weight_transfer_config"):
        load_config({"rollout": {"engine": "vllm", "engine_options": {"weight_transfer_config": {"backend": "nccl"}}}})


def test_the_vllm_transport_with_another_engine_fails_before_any_worker_starts():
    from tests.pool_helpers import make_pool

    with pytest.raises(ConfigError, match="needs rollout.engine: vllm"):
        make_pool({"weight_sync": {"transport": "vllm"}})


def test_sampling_filters_are_refused_by_the_receiver():
    """The rounds load vLLM's weights only; filtered sampling scores with the worker's own (stale) model copy."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=False)
    handle = VLLMTransferHandle("127.0.0.1", store.port, 2, "mrl_gloo", 5.0)
    receiver = handle.attach(1)
    engine = SimpleNamespace(params=SamplingParams(max_new_tokens=4, top_k=10))
    with pytest.raises(ConfigError, match="top_k"):
        receiver.bind_engine(engine)
    receiver.bind_engine(SimpleNamespace(params=SamplingParams(max_new_tokens=4)))  # no filter: bound
    assert receiver.poll() is None  # nothing announced: no round, no wait
    with pytest.raises(MrlError, match="receiver rank"):
        handle.attach(2)


@require_vllm
def test_a_backend_vllm_does_not_have_is_one_clear_error():
    from mrl_plugins.weight_sync.vllm_transfer import check_backend

    with pytest.raises(ConfigError, match=r"'hccl'.*vllm-ascend.*registered: .*mrl_gloo.*nccl"):
        check_backend("hccl")
    check_backend("nccl")  # vLLM's own: registered (it needs CUDA to run, not to be named)


@require_vllm
def test_a_publish_nobody_receives_times_out_naming_the_group():
    import torch

    from mrl_plugins.weight_sync.config import WeightSyncConfig
    from mrl_plugins.weight_sync.vllm_transfer import VLLMTransferSender

    sender = VLLMTransferSender(WeightSyncConfig(transport="vllm", timeout_s=2.0), world_size=2, device_type="cpu")
    t0 = time.monotonic()
    try:
        with pytest.raises(MrlError, match=r"weight_sync 'vllm': the mrl_gloo weight-transfer group of 2"):
            sender.publish(0, [("w", torch.zeros(3))])
    finally:
        sender.close()
    assert time.monotonic() - t0 < 30
