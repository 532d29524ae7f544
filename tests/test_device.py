"""CPU paths of mrl_plugins.device, tested for real on this machine; CUDA paths only where no GPU is needed.

CUDA streams, events, memory fraction and stats are unverified here (no GPU on the test machines).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import textwrap

import pytest

from benchmarks.engine_server import is_out_of_memory
from mrl_plugins.device import (
    ComputeBudget,
    CpuDevice,
    CudaDevice,
    allowed_cores,
    apply_compute_budget,
    available_device_types,
    collective_backend,
    get_device,
    is_cuda_available,
    measure_peak,
    parse_device_spec,
    reservation_fraction,
    reserve_memory,
    split_cores,
    visible_devices_env,
)
from mrl_plugins.device.cuda import cuda_priority_number
from mrl_plugins.errors import ConfigError, DeviceError

MIB = 1 << 20
GIB = 1 << 30


# --- selection and facts ------------------------------------------------------------------------------------------


def test_cpu_device_facts():
    import torch

    dev = get_device("cpu")
    assert isinstance(dev, CpuDevice) and dev.type == "cpu" and dev.index is None
    assert dev.torch_device == torch.device("cpu")
    assert collective_backend(dev.type) == "gloo" and visible_devices_env(dev.type) is None
    assert dev == get_device("cpu") and str(dev) == "cpu"
    assert "cpu" in available_device_types() and available_device_types()[0] == "cpu"
    assert collective_backend("cpu") == "gloo"
    assert collective_backend("cuda") == "nccl" and collective_backend("npu") == "hccl"


def test_auto_on_this_machine_matches_what_is_present():
    expected = "npu" if "npu" in available_device_types() else ("cuda" if is_cuda_available() else "cpu")
    assert get_device("auto").type == expected
    assert get_device().type == expected


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cpu:1", "npu:-1", "", "auto:0"])
def test_malformed_specs_name_valid_forms(spec):
    with pytest.raises(ConfigError) as err:
        get_device(spec)
    assert "valid forms" in str(err.value) and "'npu:N'" in str(err.value)


def test_spec_parsing():
    assert parse_device_spec("auto") == ("auto", None)
    assert parse_device_spec("NPU:3") == ("npu", 3)
    assert parse_device_spec("cuda") == ("cuda", None)


@pytest.mark.skipif(is_cuda_available(), reason="checks the error on machines without CUDA")
def test_absent_cuda_is_a_device_error_with_choices():
    with pytest.raises(DeviceError) as err:
        get_device("cuda:1")
    msg = str(err.value)
    assert "'cuda:1'" in msg and "available:" in msg and "'cpu'" in msg


def test_cuda_facts_without_gpu():
    dev = CudaDevice(index=1)
    assert collective_backend(dev.type) == "nccl" and visible_devices_env(dev.type) == "CUDA_VISIBLE_DEVICES"
    assert dev.spec == "cuda:1"
    # torch.cuda.Stream.priority_range() -> (least, greatest); lower number = higher priority
    assert cuda_priority_number("high", (0, -5)) == -5
    assert cuda_priority_number("normal", (0, -5)) == 0
    assert cuda_priority_number("low", (-5, 0)) == 0
    with pytest.raises(ConfigError):
        cuda_priority_number("max", (0, -5))


def test_visible_devices_env():
    assert visible_devices_env("npu") == "ASCEND_RT_VISIBLE_DEVICES"
    assert visible_devices_env("cuda") == "CUDA_VISIBLE_DEVICES"
    assert visible_devices_env("cpu") is None
    with pytest.raises(ConfigError, match="'tpu'.*'cpu', 'cuda' or 'npu'"):
        visible_devices_env("tpu")


# --- CPU streams and memory -------------------------------------------------------------------------------


def test_cpu_stream_is_a_usable_no_op():
    dev = get_device("cpu")
    stream = dev.new_stream("high")
    assert stream.raw is None and stream.priority_honoured is False
    with dev.stream_context(stream) as s:
        assert s is stream
        sum(range(20000))
    stream.synchronize()
    dev.synchronize()


def test_cpu_memory_stats_are_real():
    dev = get_device("cpu")
    stats = dev.memory_stats()
    assert set(stats) == {"peak_bytes", "allocated_bytes", "total_bytes"}
    assert 10 * MIB < stats["allocated_bytes"] <= stats["peak_bytes"] < stats["total_bytes"]
    assert stats["total_bytes"] > 256 * MIB


def test_cpu_memory_fraction_recorded_not_enforced():
    dev = get_device("cpu")
    dev.set_memory_fraction(0.3)
    assert dev.memory_fraction == 0.3
    for bad in (0, 1.2, -0.1, "0.5", True):
        with pytest.raises(ConfigError):
            dev.set_memory_fraction(bad)
    assert dev.memory_fraction == 0.3


def test_measure_peak_sees_a_real_allocation():
    import torch

    dev = get_device("cpu")
    size = 160 * MIB

    def work():
        t = torch.ones(size // 4, dtype=torch.float32)  # touches every page
        return float(t[-1])

    if not dev.reset_peak_memory():
        pytest.skip("kernel does not allow resetting peak RSS here (/proc/self/clear_refs)")
    before = dev.memory_stats()["allocated_bytes"]
    result, prof = measure_peak(work, dev)
    assert result == 1.0
    assert prof.peak_bytes >= before + 0.9 * size, prof
    assert 0 < reservation_fraction(prof.peak_bytes, prof.total_bytes) < 1


# --- reservation math ---------------------------------------------------------------------------------------------


def test_reservation_fraction_math():
    assert reservation_fraction(8 * GIB, 64 * GIB) == pytest.approx(0.15)
    assert reservation_fraction(10 * GIB, 40 * GIB, headroom=0.5) == pytest.approx(0.375)
    assert reservation_fraction(0, 40 * GIB) == 0.0
    assert reservation_fraction(50, 60, headroom=0.2) == pytest.approx(1.0)


def test_reservation_over_one_is_an_error_naming_the_numbers():
    with pytest.raises(ConfigError) as err:
        reservation_fraction(60 * GIB, 64 * GIB)
    msg = str(err.value)
    assert str(60 * GIB) in msg and str(64 * GIB) in msg and "1.125" in msg
    with pytest.raises(ConfigError):
        reservation_fraction(1, 0)
    with pytest.raises(ConfigError):
        reservation_fraction(1, 10, headroom=-0.1)


def test_reserve_memory_on_cpu_records_the_fraction():
    dev = get_device("cpu")
    total = dev.memory_stats()["total_bytes"]
    fraction = reserve_memory(dev, 1 * GIB)
    assert fraction == pytest.approx(1.2 * GIB / total) and dev.memory_fraction == fraction
    fresh = get_device("cpu")
    with pytest.raises(ConfigError, match="does not fit"):
        reserve_memory(fresh, total)
    assert fresh.memory_fraction is None  # nothing set when it does not fit


def test_out_of_memory_detection_on_a_real_allocation_failure():
    import torch

    with pytest.raises(RuntimeError) as err:
        torch.empty(1 << 50, dtype=torch.uint8)  # 1 PiB: the CPU allocator refuses
    assert is_out_of_memory(err.value)
    assert is_out_of_memory(torch.OutOfMemoryError("NPU out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_out_of_memory(ValueError("out of memory"))


# --- compute budget -----------------------------------------------------------------------------------------------


def test_split_cores():
    assert split_cores(2, [0, 1]) == [[0], [1]]
    assert split_cores(2, [0, 1, 2, 3, 4]) == [[0, 1, 2], [3, 4]]
    assert split_cores(1, [3, 5]) == [[3, 5]]
    assert sum(split_cores(1), []) == sorted(os.sched_getaffinity(0))
    with pytest.raises(ConfigError, match="2 cores.*3 parts"):
        split_cores(3, [0, 1])
    with pytest.raises(ConfigError):
        split_cores(0, [0, 1])


def test_budget_validation_and_from_dict():
    b = ComputeBudget.from_dict({"cores": [0], "threads": 1, "stream_priority": "high"})
    assert b.cores == [0] and b.threads == 1 and b.stream_priority == "high"
    with pytest.raises(ConfigError, match="unknown budget key 'thread'.*'threads'"):
        ComputeBudget.from_dict({"thread": 1})
    bad = [
        {"cores": []},
        {"cores": [0, 0]},
        {"cores": [-1]},
        {"threads": 0},
        {"npu_cube_cores": 0},
        {"stream_priority": "urgent"},
    ]
    for d in bad:
        with pytest.raises(ConfigError):
            ComputeBudget.from_dict(d)


def test_invalid_core_is_refused_before_anything_changes():
    import torch

    before_aff, before_threads = os.sched_getaffinity(0), torch.get_num_threads()
    with pytest.raises(ConfigError) as err:
        apply_compute_budget(ComputeBudget(cores=[0, 4096], threads=1), get_device("cpu"))
    assert "[4096]" in str(err.value) and f"valid cores: {allowed_cores()}" in str(err.value)
    with pytest.raises(ConfigError, match="threads=8 exceeds the 1 cores"):
        apply_compute_budget(ComputeBudget(cores=[0], threads=8), get_device("cpu"))
    assert os.sched_getaffinity(0) == before_aff and torch.get_num_threads() == before_threads


def _budget_child(queue, core: int) -> None:
    """Runs in a spawned process: apply a real CPU budget, observe it, restore it, report."""
    import threading

    import torch

    from mrl_plugins.device import ComputeBudget, apply_compute_budget, get_device

    out: dict = {}
    try:
        dev = get_device("cpu")
        torch.set_num_threads(len(os.sched_getaffinity(0)))  # the default: one thread per core
        worker_ready, stop = threading.Event(), threading.Event()
        worker_aff: dict = {}

        def worker():
            worker_aff["tid"] = threading.get_native_id()
            worker_ready.set()
            stop.wait(30)

        t = threading.Thread(target=worker)
        t.start()
        worker_ready.wait(30)
        out["before"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())

        applied = apply_compute_budget(ComputeBudget(cores=[core], threads=1), dev)
        out["during"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        out["worker_during"] = sorted(os.sched_getaffinity(worker_aff["tid"]))
        out["matmul"] = float((torch.ones(64, 64) @ torch.ones(64, 64))[0, 0])
        out["applied"] = applied.as_dict()
        applied.restore()
        out["after"] = (sorted(os.sched_getaffinity(0)), torch.get_num_threads())
        out["worker_after"] = sorted(os.sched_getaffinity(worker_aff["tid"]))
        stop.set()
        t.join(30)
    except BaseException as exc:  # report instead of dying silently
        out["error"] = repr(exc)
    queue.put(out)


@pytest.mark.slow
def test_cpu_budget_really_changes_affinity_and_threads_then_restores():
    cores = sorted(os.sched_getaffinity(0))
    core = cores[-1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_budget_child, args=(queue, core))
    proc.start()
    try:
        out = queue.get(timeout=120)
        proc.join(timeout=60)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        queue.close()
        queue.join_thread()
    assert "error" not in out, out.get("error")
    assert out["before"] == (cores, len(cores))
    assert out["during"] == ([core], 1)
    assert out["worker_during"] == [core]  # pins threads that already existed
    assert out["matmul"] == 64.0
    assert out["applied"]["cores"] == [core] and out["applied"]["threads"] == 1
    assert out["after"] == (cores, len(cores))
    assert out["worker_after"] == cores


def test_package_import_is_cheap_and_lazy():
    """Importing the package imports neither torch nor torch_npu (torch costs ~2 s; torch_npu can break)."""
    code = textwrap.dedent(
        """
        import sys
        import mrl_plugins
        had_torch = "torch" in sys.modules
        before = set(sys.modules)
        import mrl_plugins.device
        assert "torch_npu" not in sys.modules
        assert had_torch or "torch" not in sys.modules, "mrl_plugins.device imported torch"
        assert "importlib.metadata" not in sys.modules or "importlib.metadata" in before
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
