"""NPU paths of mrl_plugins.device, tested against a FAKE torch_npu (tests/fakes/fake_torch_npu.py).

There is no NPU hardware or CANN toolkit on the test machines, so these tests check that the device layer makes
the documented torch_npu calls with the right arguments and handles missing APIs and broken installs; they do
not show anything about real NPU behaviour (unverified on hardware).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

try:
    from fakes import fake_torch_npu
except ImportError:  # tests/ imported as a package (rootdir-based import modes)
    from tests.fakes import fake_torch_npu

from mrl_plugins.device import (
    ComputeBudget,
    CoreLimitWarning,
    DeviceFallbackWarning,
    NpuDevice,
    apply_compute_budget,
    available_device_types,
    collective_backend,
    core_limit_apis,
    get_device,
    is_torch_npu_available,
    measure_peak,
    probe,
    reserve_memory,
    torch_npu_without_cann,
    versions,
    visible_devices_env,
)
from mrl_plugins.device import base as device_base
from mrl_plugins.errors import ConfigError, DeviceError

GIB = 1 << 30


@pytest.fixture(autouse=True)
def _fresh_warnings():
    device_base._warned.clear()
    yield
    device_base._warned.clear()


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(probe, "is_cuda_available", lambda: False)
    monkeypatch.setattr(probe, "cuda_device_count", lambda: 0)


@pytest.fixture
def with_cuda(monkeypatch):
    """Pretend one CUDA GPU is visible (only selection logic is exercised; no CUDA call is made)."""
    monkeypatch.setattr(probe, "is_cuda_available", lambda: True)
    monkeypatch.setattr(probe, "cuda_device_count", lambda: 1)


def _fallback_warnings(record):
    return [w for w in record if issubclass(w.category, DeviceFallbackWarning)]


# --- selection ---------------------------------------------------------------------------------------------------


def test_auto_prefers_npu_over_cuda_and_cpu(monkeypatch, with_cuda):
    fake_torch_npu.install(monkeypatch, device_count=2)
    assert is_torch_npu_available()
    dev = get_device("auto")
    assert isinstance(dev, NpuDevice) and (dev.type, dev.index) == ("npu", 0)
    assert available_device_types() == ["cpu", "cuda", "npu"]
    assert collective_backend() == "hccl"


def test_auto_order_without_npu(monkeypatch, with_cuda):
    monkeypatch.setattr(probe, "_torch_npu_spec", lambda: None)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        assert get_device("auto").type == "cuda"
    assert _fallback_warnings(rec) == []  # torch_npu simply absent: nothing to warn about


def test_broken_torch_npu_falls_back_with_one_warning(monkeypatch, no_cuda):
    fake_torch_npu.install_broken(monkeypatch, ImportError("libascendcl.so: cannot open shared object file"))
    assert not is_torch_npu_available()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = get_device("auto")
        second = get_device("auto")
        collective_backend()
    assert first.type == second.type == "cpu"
    fallback = _fallback_warnings(rec)
    assert len(fallback) == 1, [str(w.message) for w in fallback]
    msg = str(fallback[0].message)
    assert "libascendcl.so" in msg and "continuing on CPU" in msg


def test_broken_torch_npu_falls_back_to_cuda(monkeypatch, with_cuda):
    fake_torch_npu.install_broken(monkeypatch, RuntimeError("aclInit failed"))
    with pytest.warns(DeviceFallbackWarning, match="continuing on CUDA.*aclInit failed"):
        dev = get_device("auto")
    assert dev.type == "cuda" and collective_backend(dev.type) == "nccl"


def test_installed_without_cards_is_unusable(monkeypatch, no_cuda):
    fake_torch_npu.install(monkeypatch, device_count=0)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "")
    status = probe.npu_status()
    assert status.installed and not status.usable and "ASCEND_RT_VISIBLE_DEVICES=''" in status.reason
    with pytest.warns(DeviceFallbackWarning, match="reports no NPU"):
        assert get_device("auto").type == "cpu"


def test_explicit_npu_when_broken_raises_with_reason_and_choices(monkeypatch, no_cuda):
    fake_torch_npu.install_broken(monkeypatch, ImportError("libhccl.so missing"))
    with pytest.raises(DeviceError) as err:
        get_device("npu")
    msg = str(err.value)
    assert "'npu'" in msg and "libhccl.so missing" in msg and "available: 'auto' or 'cpu'" in msg


def test_cpu_request_never_touches_torch_npu(monkeypatch):
    def _must_not_import():
        raise AssertionError("torch_npu imported for a cpu request")

    monkeypatch.setattr(probe, "_import_torch_npu", _must_not_import)
    assert get_device("cpu").type == "cpu"


def test_absent_cuda_lists_npu_choices(monkeypatch, no_cuda):
    fake_torch_npu.install(monkeypatch, device_count=1)
    with pytest.raises(DeviceError, match=r"'cuda'.*available: 'auto', 'cpu', 'npu' or 'npu:0'"):
        get_device("cuda")


def test_missing_npu_index_names_choices(monkeypatch, no_cuda):
    fake_torch_npu.install(monkeypatch, device_count=2)
    assert get_device("npu:1").index == 1
    with pytest.raises(DeviceError) as err:
        get_device("npu:5")
    msg = str(err.value)
    assert "'npu:5'" in msg and "2 NPU visible" in msg and "'npu:0'" in msg and "'npu:1'" in msg


def test_npu_facts_and_visible_devices(monkeypatch, no_cuda):
    fake_torch_npu.install(monkeypatch)
    dev = get_device("npu")
    assert collective_backend(dev.type) == "hccl"
    assert visible_devices_env(dev.type) == "ASCEND_RT_VISIBLE_DEVICES"


def test_npu_torch_device_in_subprocess():
    """torch.device('npu:1') only parses once torch_npu renamed the PrivateUse1 backend, as the real one does;
    done in a child process because the rename cannot be undone."""
    code = textwrap.dedent(
        """
        import sys, torch
        from fakes import fake_torch_npu
        sys.modules["torch_npu"] = fake_torch_npu.make_module()
        torch.utils.rename_privateuse1_backend("npu")
        from mrl_plugins.device import get_device
        print(get_device("npu:1").torch_device)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "npu:1"


# --- streams, events, memory ---------------------------------------------------------------------------------------


def test_npu_streams_do_not_claim_priority(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    dev = get_device("npu:1")
    high = dev.new_stream("high")
    assert isinstance(high.raw, mod.npu.Stream) and high.raw.device_index == 1
    assert high.priority == "high" and high.priority_honoured is False
    with dev.stream_context(high):
        assert mod.npu.current_stream() is high.raw
    assert mod.npu.current_stream() is not high.raw and mod.npu.current_stream().stream_id == 0  # the default
    dev.synchronize()
    assert ("synchronize", 1) in mod.calls
    with pytest.raises(ConfigError, match="'urgent'.*'high', 'low' or 'normal'"):
        dev.new_stream("urgent")


def test_npu_memory_fraction_and_stats(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch, total_memory=64 * GIB)
    dev = get_device("npu")
    dev.set_memory_fraction(1)  # an int: torch_npu insists on float, the device layer converts
    dev.set_memory_fraction(0.45)
    assert mod.npu._state["fraction"] == {0: 0.45} and dev.memory_fraction == 0.45
    with pytest.raises(ConfigError, match="1.5"):
        dev.set_memory_fraction(1.5)
    assert mod.npu._state["fraction"] == {0: 0.45}

    mod.npu._fake_allocate(3 * GIB)
    stats = dev.memory_stats()
    assert stats == {"peak_bytes": 3 * GIB, "allocated_bytes": 3 * GIB, "total_bytes": 64 * GIB}

    def work():
        mod.npu._fake_allocate(6 * GIB)
        mod.npu._fake_allocate(-4 * GIB)
        return "done"

    result, prof = measure_peak(work, dev)
    assert result == "done" and prof.peak_bytes == 9 * GIB and prof.total_bytes == 64 * GIB
    assert reserve_memory(dev, prof.peak_bytes) == pytest.approx(9 * 1.2 / 64)
    assert mod.npu._state["fraction"][0] == pytest.approx(9 * 1.2 / 64)


# --- compute budget ------------------------------------------------------------------------------------------------


def test_device_budget_reaches_set_device_limit(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    dev = get_device("npu:1")
    applied = apply_compute_budget(ComputeBudget(npu_cube_cores=8, npu_vector_cores=16), dev)
    limit_at = mod.calls.index(("set_device_limit", 1, 8, 16))
    assert mod.calls[limit_at - 1] == ("set_device", 1)  # CANN requires set_device before the limit
    assert applied.npu_device_limit == (8, 16) and applied.stream is None
    assert mod.npu.get_device_limit(1) == {"cube_core_num": 8, "vector_core_num": 16}

    # torch_npu accepts set_device_limit once per process: an identical repeat is a no-op ...
    n_calls = len(mod.calls)
    again = apply_compute_budget(ComputeBudget(npu_cube_cores=8, npu_vector_cores=16), dev)
    assert len(mod.calls) == n_calls and again.npu_device_limit is None and "already" in again.notes[0]
    # ... a different one is a clear error, not torch_npu's RuntimeError.
    with pytest.raises(DeviceError, match="once per process.*set_stream_limit"):
        apply_compute_budget(ComputeBudget(npu_cube_cores=4), dev)
    assert len(mod.calls) == n_calls
    applied.restore()
    assert any("cannot reset" in n for n in applied.notes)


def test_stream_budget_reaches_set_stream_limit_and_restores(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    dev = get_device("npu")
    applied = apply_compute_budget(ComputeBudget(npu_cube_cores=4, npu_vector_cores=8, stream_priority="high"), dev)
    stream = applied.stream
    sid = stream.raw.stream_id
    assert ("set_stream_limit", sid, 4, 8) in mod.calls
    assert mod.npu.get_stream_limit(stream.raw) == {"cube_core_num": 4, "vector_core_num": 8}
    assert not any(c[0] == "set_device_limit" for c in mod.calls)
    applied.restore()
    applied.restore()  # idempotent
    assert mod.calls.count(("reset_stream_limit", sid)) == 1
    assert mod.npu.get_stream_limit(stream.raw) == {"cube_core_num": 24, "vector_core_num": 48}


def test_priority_budget_creates_stream_and_limits_it(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch)
    dev = get_device("npu")
    applied = apply_compute_budget(ComputeBudget(npu_vector_cores=12, stream_priority="high"), dev)
    assert applied.stream is not None and applied.stream.priority == "high"
    assert applied.priority_honoured is False and any("not a hardware priority" in n for n in applied.notes)
    assert ("set_stream_limit", applied.stream.raw.stream_id, -1, 12) in mod.calls


def test_missing_core_limit_api_warns_once_and_continues(monkeypatch, no_cuda):
    mod = fake_torch_npu.install(monkeypatch, core_limits=False, version="2.5.1")
    assert core_limit_apis() == dict.fromkeys(probe.CORE_LIMIT_APIS, False)
    dev = get_device("npu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = apply_compute_budget(ComputeBudget(npu_cube_cores=8), dev)
        b = apply_compute_budget(ComputeBudget(npu_cube_cores=8), dev)
    limit_warnings = [w for w in rec if issubclass(w.category, CoreLimitWarning)]
    assert len(limit_warnings) == 1 and "set_device_limit" in str(limit_warnings[0].message)
    assert a.npu_device_limit is None and b.npu_device_limit is None and "absent" in a.notes[0]
    assert not any("limit" in c[0] for c in mod.calls)


def test_core_limit_apis_with_fake(monkeypatch):
    fake_torch_npu.install(monkeypatch)
    assert core_limit_apis() == dict.fromkeys(probe.CORE_LIMIT_APIS, True)


def test_npu_limits_on_cpu_device_are_skipped_with_warning():
    with pytest.warns(CoreLimitWarning, match="device is cpu"):
        applied = apply_compute_budget(ComputeBudget(npu_cube_cores=8), get_device("cpu"))
    assert applied.npu_device_limit is None and "skipped on cpu" in applied.notes[0]


# --- facts for `mrl doctor` -----------------------------------------------------------------------------------------


def _dist_versions(**known):
    return lambda name: known.get(name.replace("-", "_"))


def test_versions_and_cann_detection(monkeypatch, tmp_path):
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.1.RC1\n"
    )
    monkeypatch.setattr(probe, "_dist_version", _dist_versions(torch="2.7.1", torch_npu="2.7.1.post1"))
    env = {"ASCEND_TOOLKIT_HOME": str(home)}
    v = versions(env)
    assert v["torch_npu"] == "2.7.1.post1" and v["cann"] == "8.1.RC1" and v["torch"] == "2.7.1"
    assert not torch_npu_without_cann(env)


def test_torch_npu_without_cann_hazard(monkeypatch, tmp_path):
    monkeypatch.setattr(probe, "DEFAULT_CANN_HOMES", (str(tmp_path / "nowhere"),))
    monkeypatch.setattr(probe, "_dist_version", _dist_versions(torch_npu="2.7.1"))
    assert torch_npu_without_cann({})
    assert probe.cann_version({}) is None
    v = versions({})
    assert v["torch_npu"] == "2.7.1" and v["cann"] is None
    monkeypatch.setattr(probe, "_dist_version", _dist_versions())
    monkeypatch.setattr(probe, "_torch_npu_spec", lambda: None)
    assert not torch_npu_without_cann({})  # no torch_npu: no hazard


def test_real_broken_torch_npu_package_is_never_imported_at_import_time(tmp_path):
    """A real on-disk torch_npu whose import fails (like one installed without CANN): importing the device
    package must not touch it; probing imports it guarded and falls back with one warning."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\nopen(os.environ['MARKER'], 'a').write('imported\\n')\n"
        "raise ImportError('libascendcl.so: cannot open shared object file')\n"
    )
    marker = tmp_path / "marker"
    code = textwrap.dedent(
        """
        import sys, warnings, os
        import mrl_plugins.device as d
        assert "torch_npu" not in sys.modules
        assert not os.path.exists(os.environ["MARKER"]), "torch_npu imported at package import"
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as rec:
            dev = d.get_device("auto")
            d.get_device("auto")
        msgs = [str(w.message) for w in rec if issubclass(w.category, d.DeviceFallbackWarning)]
        print(dev.type, len(msgs), msgs[0])
        """
    )
    env = dict(os.environ, MARKER=str(marker), PYTHONPATH=str(tmp_path), ASCEND_TOOLKIT_HOME="", ASCEND_HOME_PATH="")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kind, count, msg = out.stdout.strip().split(" ", 2)
    assert (kind, count) == ("cpu", "1")
    assert "libascendcl.so" in msg
    assert marker.read_text().count("imported") >= 1
