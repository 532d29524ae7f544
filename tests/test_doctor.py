"""``mrl doctor``: pre-run checks and post-run triage.

The CPU checks run for real on this machine (real port binding, real core count, real torch threads, the real
device probes). The NPU checks (torch_npu-without-CANN hazard, visible NPUs, core-limit APIs, version matrix)
run against a FAKE NPU environment -- there is no NPU or CANN here: a fake ``torch_npu`` module
(tests/fakes/fake_torch_npu.py), faked package versions through ``probe._dist_version`` and a fake CANN folder
in tmp_path. They show what doctor reports for such an environment, not anything about real NPU behaviour.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys

import pytest

try:
    from fakes import fake_torch_npu
except ImportError:  # tests/ imported as a package (rootdir-based import modes)
    from tests.fakes import fake_torch_npu

from mrl_plugins.cli import doctor_checks
from mrl_plugins.cli.doctor import cli, load_report, triage
from mrl_plugins.cli.doctor_checks import check_memory, check_ports, check_threads
from mrl_plugins.device import base as device_base
from mrl_plugins.device import probe
from mrl_plugins.errors import ConfigError

LINE = re.compile(r"^(ok|warn|fail) +[a-zA-Z_+ ]+: \S")


@pytest.fixture(autouse=True)
def _fresh_warnings():
    device_base._warned.clear()
    yield
    device_base._warned.clear()


def _lines(out: str) -> dict[str, list[str]]:
    """Check lines grouped by check name -> list of statuses."""
    result: dict[str, list[str]] = {}
    for line in out.splitlines():
        if LINE.match(line):
            status, rest = line.split(None, 1)
            result.setdefault(rest.split(":", 1)[0], []).append(status)
    return result


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------------------------
# CPU, for real
# ---------------------------------------------------------------------------------------------------------------------


def test_cpu_defaults_all_ok(capsys):
    cores = doctor_checks.available_cores()
    rc = cli(["--device", "cpu", "--threads", "1"], env={})
    out = capsys.readouterr().out
    checks = _lines(out)
    assert rc == 0, out
    for name in ("torch_npu+CANN", "versions", "backend", "visible devices", "ports", "memory", "core limits"):
        assert checks[name] == ["ok"], out
    assert checks["threads"] == ["ok"] and f"<= {cores} cores" in out
    assert "device 'cpu' present" in out and "torch 2." in out
    assert all(LINE.match(line) for line in out.splitlines()[:-1])  # every line but the summary is a check
    assert cli(["--threads", "1"], env={}) == 0  # auto: NPU, else CUDA, else CPU -- nothing fails on this machine
    assert "device 'auto' -> " in capsys.readouterr().out


def test_requested_npu_absent_fails(capsys):
    rc = cli(["--device", "npu"], env={})
    out = capsys.readouterr().out
    assert rc == 1
    assert _lines(out)["backend"] == ["fail"] and "torch_npu is not installed" in out


def test_bad_device_spec_is_an_input_error(capsys):
    assert cli(["--device", "tpu"], env={}) == 2
    err = capsys.readouterr().err
    assert "tpu" in err and "npu:N" in err


def test_port_collision_fails_and_busy_port_warns(capsys):
    free = _free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        checks = check_ports({"master": free, "weights": busy})
        assert [c.status for c in checks] == ["warn"] and f"weights={busy} (in use)" in checks[0].detail
        checks = check_ports({"master": free, "store": free, "weights": busy})
        assert [c.status for c in checks] == ["fail", "warn"]
        assert f"port {free} assigned to master and store: collision" in checks[0].detail
        rc = cli(["--ports", f"master={free},store={free}", "--threads", "1"], env={})
    out = capsys.readouterr().out
    assert rc == 1 and _lines(out)["ports"] == ["fail"]
    ok = check_ports({"master": free})
    assert [c.status for c in ok] == ["ok"] and f"master={free}" in ok[0].detail


def test_ports_need_a_table_for_several_processes():
    needs = check_ports({}, network=["comm.transport=torch_distributed"])
    assert needs[0].status == "warn" and "comm.transport=torch_distributed" in needs[0].detail
    assert check_ports({})[0].status == "ok"  # shared-memory transports need no port


@pytest.mark.parametrize("argv", [["--ports", "master"], ["--ports", "a=1,a=2"], ["--ports", "a=0"]])
def test_bad_port_table_is_an_input_error(argv, capsys):
    assert cli(argv, env={}) == 2
    assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["0", "70000", "x", "-1"])
def test_a_port_outside_1_to_65535_is_refused(bad, capsys):
    assert cli(["--ports", f"a={bad}"], env={}) == 2
    assert "is not an integer in 1..65535" in capsys.readouterr().err


def test_memory_reservations():
    assert [c.status for c in check_memory(0.1, {"trainer": 0.5, "rollout": 0.3}, False)] == ["ok", "ok"]
    assert [c.status for c in check_memory(0.2, {}, False)] == ["ok"]  # exactly 20% is allowed
    over_root = check_memory(0.25, {"trainer": 0.5}, False)
    assert [c.status for c in over_root] == ["fail", "ok"] and "0.25" in over_root[0].detail
    over_sum = check_memory(0.1, {"trainer": 0.6, "rollout": 0.4}, False)
    assert [c.status for c in over_sum] == ["ok", "fail"]
    assert "trainer 0.6 + rollout 0.4 + root 0.1" in over_sum[1].detail
    assert check_memory(None, {}, cards_shared=True)[0].status == "warn"
    assert check_memory(None, {}, cards_shared=False)[0].status == "ok"
    with pytest.raises(ConfigError, match=r"outside \(0, 1\]"):
        check_memory(None, {"trainer": 1.5}, False)


def test_memory_from_measured_peaks(capsys):
    rc = cli(["--peak", "trainer=8GiB,rollout=16GiB", "--device-memory", "64GiB", "--threads", "1"], env={})
    out = capsys.readouterr().out
    assert rc == 0 and "trainer 0.15 + rollout 0.3" in out  # 8 x 1.2 / 64, 16 x 1.2 / 64
    rc = cli(["--peak", "trainer=60GiB", "--device-memory", "64GiB"], env={})
    assert rc == 2 and "does not fit" in capsys.readouterr().err
    assert cli(["--peak", "trainer=8GiB"], env={}) == 2
    assert "--device-memory" in capsys.readouterr().err
    rc = cli(["--reserve", "trainer=0.8", "--reserve-root", "0.3", "--threads", "1"], env={})
    assert rc == 1 and _lines(capsys.readouterr().out)["memory"] == ["fail", "fail"]


def test_thread_budget_against_real_cores(capsys):
    cores = doctor_checks.available_cores()
    assert check_threads([1] * cores, cores).status == "ok"
    over = check_threads([2, 2], 2)
    assert over.status == "warn" and "15x slower" in over.detail and "2+2 = 4" in over.detail
    rc = cli(["--processes", str(cores + 1), "--threads", "1", "--mode", "colocate"], env={})
    out = capsys.readouterr().out
    assert rc == 0 and _lines(out)["threads"] == ["warn"]
    rc = cli(["--processes", "2"], env={"OMP_NUM_THREADS": "1"})
    out = capsys.readouterr().out
    assert ("1+1 = 2" in out) and (_lines(out)["threads"] == ["ok" if cores >= 2 else "warn"])
    assert cli(["--processes", "2"], env={"OMP_NUM_THREADS": "many"}) == 2
    assert cli(["--processes", "2", "--threads", "1,1,1"], env={}) == 2


def test_torch_default_threads_used_when_nothing_set(capsys):
    import torch

    n = torch.get_num_threads()
    cores = doctor_checks.available_cores()
    cli(["--processes", "2"], env={})
    out = capsys.readouterr().out
    assert f"{n}+{n} = {2 * n}" in out and "torch default" in out
    assert _lines(out)["threads"] == ["warn" if 2 * n > cores else "ok"]


def test_config_file(tmp_path, capsys):
    port = _free_port()
    cfg = tmp_path / "run.yaml"
    cfg.write_text("mode: disaggregated\nrollout:\n  workers: 1\n  engine_threads: 1\ntrain:\n  device: cpu\n")
    rc = cli(["--config", str(cfg), "--ports", f"master={port},weights={port}"], env={})
    out = capsys.readouterr().out
    assert rc == 1  # the port collision
    assert f"port {port} assigned to master and weights" in out
    trainer = "trainer: rollout.trainer_cores, workers: rollout.engine_threads"  # the adapter's CPU placement
    assert f"1+1 = 2 threads over 2 process(es) ({trainer})" in out
    assert "device 'cpu' present" in out
    other = _free_port()
    rc = cli(["--config", str(cfg), "--ports", f"master={port},weights={other}"], env={})
    assert rc == 0, capsys.readouterr().out
    old = tmp_path / "old.yaml"  # a key of an earlier release: the same error as a run's
    old.write_text(f"ports:\n  master: {port}\n")
    assert cli(["--config", str(old)], env={}) == 2
    assert "ports was removed" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: split\n")
    assert cli(["--config", str(bad)], env={}) == 2
    assert "'colocate', 'disaggregated' or 'hybrid'" in capsys.readouterr().err
    assert cli(["--config", str(tmp_path / "missing.yaml")], env={}) == 2
    net = tmp_path / "net.yaml"
    net.write_text("mode: disaggregated\ntrain: {device: cpu}\ncomm: {transport: torch_distributed}\n")
    assert cli(["--config", str(net)], env={}) == 0
    out = capsys.readouterr().out
    assert _lines(out)["ports"] == ["warn"] and "comm.transport=torch_distributed need(s) rendezvous ports" in out
    remote = tmp_path / "remote.yaml"  # remote workers only: the placement gives the trainer its one thread
    remote.write_text(
        "rollout: {workers: 0, remote_workers: 2, rendezvous: '127.0.0.1:29555'}\ntrain: {device: cpu}\n"
    )
    cli(["--config", str(remote)], env={})
    out = capsys.readouterr().out
    assert "1 = 1 threads over 1 process(es) (trainer: rollout.trainer_cores; 2 remote worker(s) not counted" in out


def test_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.doctor", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok    backend:" in proc.stdout and re.search(r"\d+ checks: 0 fail", proc.stdout)


# ---------------------------------------------------------------------------------------------------------------------
# FAKE NPU environment (no NPU or CANN exists here)
# ---------------------------------------------------------------------------------------------------------------------


def _dist_versions(**known):
    return lambda name: known.get(name.replace("-", "_"))


@pytest.fixture
def fake_npu(monkeypatch, tmp_path):
    """FAKE: a torch_npu module with 2 NPUs, torch/torch_npu 2.7.1 metadata and a CANN 8.1.RC1 folder; no CUDA."""
    home = tmp_path / "ascend-toolkit" / "latest"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text("version=8.1.RC1\n")
    monkeypatch.setattr(probe, "is_cuda_available", lambda: False)
    monkeypatch.setattr(probe, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(probe, "_dist_version", _dist_versions(torch="2.7.1", torch_npu="2.7.1"))

    def install(**kwargs):
        return fake_torch_npu.install(monkeypatch, **kwargs)

    install()
    return {"ASCEND_TOOLKIT_HOME": str(home)}, install


def test_fake_npu_torch_npu_without_cann_fails_with_fix(monkeypatch, tmp_path, capsys):
    """FAKE: torch_npu 2.7.1 'installed' (package metadata) but no CANN toolkit anywhere."""
    monkeypatch.setattr(probe, "DEFAULT_CANN_HOMES", (str(tmp_path / "nowhere"),))
    monkeypatch.setattr(probe, "_dist_version", _dist_versions(torch="2.7.1", torch_npu="2.7.1"))
    hazard = doctor_checks.check_torch_npu_hazard({})
    assert hazard.status == "fail" and "set_env.sh" in hazard.detail and "pip uninstall torch_npu" in hazard.detail
    rc = cli(["--threads", "1"], env={})
    out = capsys.readouterr().out
    assert rc == 1
    assert _lines(out)["torch_npu+CANN"] == ["fail"] and "import torch` fails" in out
    assert _lines(out)["backend"] == ["warn"]  # not probed: importing torch_npu there could break the process
    monkeypatch.setattr(probe, "DEFAULT_CANN_HOMES", (str(tmp_path),))  # a CANN folder exists: no hazard
    assert doctor_checks.check_torch_npu_hazard({}).status == "ok"


def test_fake_npu_backend_versions_and_core_limits(fake_npu, capsys):
    env, _ = fake_npu
    rc = cli(["--device", "npu:1", "--threads", "1"], env=env | {"ASCEND_RT_VISIBLE_DEVICES": "0,1"})
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "torch_npu 2.7.1, CANN 8.1.RC1" in out and "found: cpu, npu x2" in out
    assert _lines(out)["version matrix"] == ["ok"]
    assert "present: set_device_limit, get_device_limit, set_stream_limit" in out
    assert cli(["--device", "npu:2"], env=env) == 1
    assert "only 2 NPU visible" in capsys.readouterr().out


def test_fake_npu_old_torch_npu_lacks_core_limits(fake_npu, monkeypatch):
    """FAKE: a torch_npu 2.5.1 without set_device_limit / set_stream_limit, with torch 2.7.1 (mismatch)."""
    env, install = fake_npu
    install(core_limits=False, version="2.5.1")
    monkeypatch.setattr(probe, "_dist_version", _dist_versions(torch="2.7.1", torch_npu="2.5.1"))
    limits = doctor_checks.check_core_limits("npu")
    assert limits.status == "warn" and "set_device_limit, set_stream_limit" in limits.detail
    checks, kind = doctor_checks.check_backend("auto", env)
    assert kind == "npu"
    matrix = [c for c in checks if c.name == "version matrix"][0]
    assert matrix.status == "fail" and "built for torch 2.5.x" in matrix.detail


@pytest.mark.parametrize(
    ("visible", "processes", "mode", "status", "shared", "text"),
    [
        ("0,1", 2, "disaggregated", "ok", False, "process 0 -> card 0, process 1 -> card 1"),
        ("4,5,6", 2, None, "ok", False, "process 1 -> card 5"),
        ("0,1", 3, "disaggregated", "fail", True, "two processes on one card"),
        ("0,1", 3, "colocate", "warn", True, "shared by design in colocate mode"),
        ("0", 2, None, "fail", True, "sudden OOM or slowdown"),
        (None, 1, None, "warn", False, "unset"),
        (None, 2, "hybrid", "warn", True, "uses card 0 unless"),
        (None, 2, "disaggregated", "fail", True, "uses card 0 unless"),
        ("1,0", 2, None, "fail", False, "not ascending"),
        ("0,x", 1, None, "fail", False, "not a comma-separated list"),
    ],
)
def test_fake_npu_visible_devices_from_env(fake_npu, visible, processes, mode, status, shared, text):
    env, _ = fake_npu
    if visible is not None:
        env = env | {"ASCEND_RT_VISIBLE_DEVICES": visible}
    check, is_shared = doctor_checks.check_visible_devices("npu", processes, mode, env)
    assert (check.status, is_shared) == (status, shared), check.detail
    assert text in check.detail and "ASCEND_RT_VISIBLE_DEVICES" in check.detail


def test_fake_npu_visible_devices_explicit_per_process(fake_npu, capsys):
    env, _ = fake_npu
    rc = cli(["--visible-devices", "0;1", "--threads", "1"], env=env)
    out = capsys.readouterr().out
    assert rc == 0 and "process 0: ASCEND_RT_VISIBLE_DEVICES=0; process 1: ASCEND_RT_VISIBLE_DEVICES=1" in out
    rc = cli(["--visible-devices", "0;0,1", "--threads", "1", "--mode", "disaggregated"], env=env)
    out = capsys.readouterr().out
    assert rc == 1 and "processes 0 and 1 both get card 0" in out
    # shared in colocate mode without a memory reservation: warn twice (visible devices, memory)
    rc = cli(["--visible-devices", "0;0", "--threads", "1", "--mode", "colocate"], env=env)
    checks = _lines(capsys.readouterr().out)
    assert rc == 0 and checks["visible devices"] == ["warn"] and checks["memory"] == ["warn"]
    assert cli(["--visible-devices", "0;1", "--processes", "3"], env=env) == 2
    assert "2 assignments for 3 processes" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("yaml_text", "visible", "status", "text"),
    [
        ("mode: disaggregated\nrollout: {workers: 2}\n", "4,5,6", "ok", "ASCEND_RT_VISIBLE_DEVICES=4; process 1: "),
        ("mode: disaggregated\nrollout: {workers: 2}\n", "4,5", "fail", "needs device index 2 but"),
        ("mode: disaggregated\ntrain: {device: npu:1}\nrollout: {workers: 1}\n", "0,1,2", "ok", "process 1: "),
        ("mode: colocate\nrollout: {workers: 1}\n", "3", "warn", "both get card 3"),
        ("mode: hybrid\nrollout: {workers: 2, colocated_workers: 1}\n", "0,1", "warn", "processes 0 and 1 both"),
        ("mode: colocate\nrollout: {workers: 0}\n", "0", "ok", "process 0: ASCEND_RT_VISIBLE_DEVICES=0 (no card"),
    ],
)
def test_fake_npu_config_card_plan(fake_npu, tmp_path, capsys, yaml_text, visible, status, text):
    """FAKE NPUs: the config's placement (trainer on its index, workers colocated or on the next cards)."""
    env, _ = fake_npu
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    cli(["--config", str(cfg)], env=env | {"ASCEND_RT_VISIBLE_DEVICES": visible})
    out = capsys.readouterr().out
    line = [x for x in out.splitlines() if x.startswith(f"{status:<5} visible devices:")]
    assert line and text in line[0], out
    if "device: npu:1" in yaml_text:  # train: {device: npu:1}
        assert "process 0: ASCEND_RT_VISIBLE_DEVICES=1; process 1: ASCEND_RT_VISIBLE_DEVICES=2" in out


def test_cuda_variable_named_for_cuda():
    """CUDA_VISIBLE_DEVICES is the variable for CUDA devices (no GPU needed: only the env is read)."""
    check, shared = doctor_checks.check_visible_devices("cuda", 2, None, {"CUDA_VISIBLE_DEVICES": "3,2"})
    assert check.status == "ok" and "CUDA_VISIBLE_DEVICES=3,2" in check.detail and not shared  # order free on CUDA
    uuids = {"CUDA_VISIBLE_DEVICES": "GPU-8f3c2d1e,GPU-77aa01bc"}
    check, shared = doctor_checks.check_visible_devices("cuda", 2, None, uuids)
    assert check.status == "ok" and "process 1 -> card GPU-77aa01bc" in check.detail
    check, shared = doctor_checks.check_visible_devices("cuda", 3, "disaggregated", uuids)
    assert check.status == "fail" and shared
    npu_ids = {"ASCEND_RT_VISIBLE_DEVICES": "GPU-1"}
    assert doctor_checks.check_visible_devices("npu", 1, None, npu_ids)[0].status == "fail"


# ---------------------------------------------------------------------------------------------------------------------
# post-run triage (synthetic reports)
# ---------------------------------------------------------------------------------------------------------------------


def _run(generate, train, wall, weight_sync=0.0, transfer=0.0, wait=0.0, **extra):
    split = {"generate": generate, "weight_sync": weight_sync, "transfer": transfer, "train": train, "wait": wait}
    return {"time_split": split, "wall_s": wall, **extra}


def test_triage_scheduling():
    t = triage("all", _run(2.0, 1.0, 10.0, weight_sync=0.2, transfer=0.3, wait=6.0, steps_per_s=0.5))
    assert t.verdict == "scheduling" and t.status == "warn"
    assert t.utilisation == pytest.approx(0.3) and t.comm_share == pytest.approx(0.05)
    line = t.line()
    assert "utilisation 30%" in line and "comm wait 5%" in line and "idle wait 60%" in line
    assert "uneven arrivals or small batches" in line and "x 1 lane(s)" in line


def test_triage_communication_first():
    t = triage("all", _run(3.0, 3.0, 10.0, weight_sync=2.0, transfer=2.0))
    assert t.verdict == "communication" and t.comm_share == pytest.approx(0.4)
    assert "compress first" in t.advice and "then overlap" in t.advice and "mostly weight sync" in t.advice
    assert "mostly experience transfer" in triage("x", _run(3.0, 3.0, 10.0, weight_sync=1.0, transfer=3.0)).advice
    assert triage("x", _run(3.0, 3.0, 10.0, weight_sync=1.5, transfer=1.5)).verdict != "communication"  # 30%


def test_triage_kernels_needs_low_throughput():
    run = _run(5.0, 4.5, 10.0, steps_per_s=0.5, tokens_per_s=900.0)
    t = triage("all", run, target_steps_per_s=1.0)
    assert t.verdict == "kernels" and t.utilisation == pytest.approx(0.95) and "0.5 steps/s < target 1" in t.advice
    assert triage("all", run | {"target_tokens_per_s": 1000.0}).verdict == "kernels"
    assert triage("all", run, target_steps_per_s=0.4).verdict == "compute-bound"
    assert triage("all", run).verdict == "compute-bound"
    assert triage("all", _run(3.0, 3.0, 10.0)).verdict == "no clear bottleneck"


def test_triage_utilisation_definitions():
    overlapped = _run(8.0, 7.0, 10.0)  # async: generate and train overlap -> at least 2 lanes
    t = triage("async", overlapped)
    assert t.utilisation == pytest.approx(0.75) and "x 2 lane(s)" in t.utilisation_from
    assert triage("async", overlapped, lanes=4).verdict == "scheduling"  # 15 / 40
    assert triage("async", overlapped | {"lanes": 3}).utilisation == pytest.approx(0.5)
    measured = triage("npu", _run(8.0, 7.0, 10.0, utilization=0.3))
    assert measured.utilisation == 0.3 and measured.utilisation_from == "measured" and measured.verdict == "scheduling"


def test_triage_reads_the_run_module_layout():
    """``mrl_plugins.run`` results: ``transfer_wait`` (trainer idle waiting for experience) and ``train_s``."""
    run = {
        "wall_s": 30.0,
        "train_s": 20.0,  # the training loop; wall_s also counts model loading
        "steps_per_s": 0.4,
        "time_split": {"generate": 4.0, "weight_sync": 0.5, "transfer_wait": 11.0, "train": 4.5},
        "mrl_metrics": {"mrl/time/wait_s": 11.0},
    }
    t = triage("all", run)
    assert t.verdict == "scheduling" and t.utilisation == pytest.approx(8.5 / 20)
    assert t.wait_share == pytest.approx(11 / 20) and t.comm_share == pytest.approx(0.5 / 20)
    assert "train_s 20 s x 1 lane(s)" in t.utilisation_from
    both = dict(run, time_split={"generate": 1.0, "train": 1.0, "wait": 1.0, "transfer_wait": 1.0})
    with pytest.raises(ConfigError, match="both 'transfer_wait' and 'wait'"):
        triage("all", both)
    with pytest.raises(ConfigError, match="exceeds train_s 20 s x 1 lane"):
        triage("all", dict(run, time_split={"generate": 15.0, "train": 10.0}), lanes=1)


@pytest.mark.parametrize(
    ("run", "match"),
    [
        ({"wall_s": 10.0}, "time_split"),
        ({"time_split": {"generate": 1.0}, "wall_s": 10.0}, "lacks 'train'"),
        ({"time_split": {"generate": 1.0, "train": 1.0, "idle": 2.0}, "wall_s": 1.0}, "'wait'"),
        ({"time_split": {"generate": 1.0, "train": 1.0}}, "wall_s"),
        ({"time_split": {"generate": 1.0, "train": 1.0}, "wall_s": 0}, "must be > 0"),
        ({"time_split": {"generate": -1.0, "train": 1.0}, "wall_s": 5}, "non-negative"),
        ({"time_split": {"generate": 1.0, "train": 1.0}, "wall_s": 5, "utilization": 1.5}, "0..1"),
        ({"time_split": {"generate": 1.0, "train": 1.0}, "wall_s": 5, "target_steps_per_s": "fast"}, "target"),
    ],
)
def test_triage_bad_runs(run, match):
    with pytest.raises(ConfigError, match=match):
        triage("r", run)


def test_report_cli_compare_layout(tmp_path, capsys):
    report = tmp_path / "report.json"
    runs = {
        "upstream": _run(2.0, 1.0, 10.0, wait=6.0),
        "all": _run(5.0, 4.5, 10.0, steps_per_s=0.5),
        "comm": _run(3.0, 3.0, 10.0, transfer=4.0),
    }
    report.write_text(json.dumps({"speedup": 1.2, "runs": runs}))
    out_json = tmp_path / "triage.json"
    rc = cli(["--report", str(report), "--target-steps-per-s", "1", "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "warn  triage upstream: scheduling" in out
    assert "warn  triage all: kernels" in out
    assert "warn  triage comm: communication" in out
    saved = {r["run"]: r for r in json.loads(out_json.read_text())}
    assert saved["comm"]["comm_share"] == pytest.approx(0.4)
    report.write_text(json.dumps({"runs": [dict(runs["all"], name="listed")]}))
    assert cli(["--report", str(report)]) == 0 and "triage listed: compute-bound" in capsys.readouterr().out


def test_report_reads_what_a_run_writes(tmp_path, capsys):
    """``mrl run --json``'s result is one run; a file of TRL log metrics holds no run's time split and is refused
    naming the files that do."""
    import dataclasses

    from mrl_plugins.run import RunResult

    result = RunResult(
        name="all", plugins={"rollout": "mrl"}, steps=3, wall_s=12.0, train_s=10.0, steps_per_s=0.3,
        tokens_per_s=50.0, peak_rss_bytes=1, final_reward=0.5, rewards=[0.5], threads=1,
        time_split={"generate": 4.0, "weight_sync": 1.0, "transfer_wait": 0.5, "train": 5.0,
                    "generate_overlapped": 1.0},
        mrl_metrics={"mrl/time/generate_s": 2.0, "mrl/rollout/generate_s": 4.0},
    )  # fmt: skip
    path = tmp_path / "result.json"
    path.write_text(json.dumps(dataclasses.asdict(result)))
    ((name, run),) = load_report(path)
    assert name == "result" and run["steps_per_s"] == 0.3
    assert cli(["--report", str(path)]) == 0
    assert "triage result: " in capsys.readouterr().out
    metrics = tmp_path / "metrics.json"
    metrics.write_text(json.dumps({"mrl/time/generate_s": 1, "train_runtime": 10}))
    assert cli(["--report", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "needs 'time_split'" in err and "mrl compare's report.json and mrl run --json's result" in err


def test_report_bad_input_exits_2(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert cli(["--report", str(bad)]) == 2 and "not valid JSON" in capsys.readouterr().err
    bad.write_text(json.dumps({"runs": {"a": {"time_split": {"generate": 1, "train": 1}}}}))
    assert cli(["--report", str(bad)]) == 2 and "'wall_s'" in capsys.readouterr().err
    assert cli(["--report", str(tmp_path / "missing.json")]) == 2


def _report(tmp_path) -> str:
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"runs": {"all": _run(5.0, 4.0, 10.0)}}))  # utilisation 90% on 1 lane
    return str(path)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lanes", "0"], "argument --lanes: must be an integer >= 1, got '0'"),  # was a ZeroDivisionError
        (["--lanes", "-1"], "argument --lanes: must be an integer >= 1, got '-1'"),  # was "utilisation -90%"
        (["--lanes", "1.5"], "argument --lanes: must be an integer >= 1, got '1.5'"),
        (["--high-util", "5"], "argument --high-util: must be a fraction in [0.5, 1]"),
        (["--high-util", "nan"], "argument --high-util: must be a fraction in [0.5, 1]"),
        (["--high-util", "0.3"], "argument --high-util: must be a fraction in [0.5, 1]"),
        (["--target-steps-per-s", "-1"], "argument --target-steps-per-s: must be a finite number > 0, got '-1'"),
        (["--target-tokens-per-s", "nan"], "argument --target-tokens-per-s: must be a finite number > 0"),
    ],
)
def test_triage_flags_are_checked_before_the_report_is_read(tmp_path, capsys, argv, says):
    assert cli(["--report", _report(tmp_path), *argv]) == 2
    out, err = capsys.readouterr()
    assert says in err and out == ""


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--peak", "trainer=8GiB", "--device-memory", "64GiB", "--headroom", "nan"], "argument --headroom: must be a"
         " number in [0, 4]"),  # was "memory fraction trainer=nan is outside (0, 1]"
        (["--peak", "trainer=8GiB", "--device-memory", "64GiB", "--headroom", "-0.1"], "argument --headroom"),
        (["--reserve-root", "nan"], "argument --reserve-root: must be a fraction of device memory in (0, 1]"),
        (["--processes", "0"], "argument --processes: must be an integer >= 1, got '0'"),
        (["--ports", "x"], "--ports: 'x' is not name=value (expected e.g. 'master=29500,weights=29501')"),
        (["--ports", ""], "--ports: '' is not name=value"),  # was an empty table
        (["--reserve", "x"], "--reserve: 'x' is not name=value (expected e.g. 'trainer=0.5,rollout=0.3')"),
        (["--peak", "x", "--device-memory", "64GiB"], "--peak: 'x' is not name=value (expected e.g. 'trainer=8GiB')"),
        (["--lanes", "2"], "--lanes: post-run triage flag(s), used only with --report PATH"),
        (["--high-util", "0.9"], "--high-util: post-run triage flag(s), used only with --report PATH"),
        (["--headroom", "0.5"], "--headroom: size(s) the reservations of --peak, which was not given"),
        (["--device-memory", "64GiB"], "--device-memory: size(s) the reservations of --peak"),
    ],
)  # fmt: skip
def test_pre_run_flags_are_checked_with_the_flag_and_its_example_named(capsys, argv, says):
    assert cli([*argv, "--threads", "1"], env={}) == 2
    out, err = capsys.readouterr()
    assert says in err and out == "", err
    assert "'trainer=0.5,rollout=0.3'" not in err or argv[0] == "--reserve"


@pytest.mark.parametrize(
    "argv",
    [["--config", "colocate"], ["--device", "cpu"], ["--config", "colocate", "--device", "cpu", "--ports", "a=1"]],
)
def test_report_refuses_the_pre_run_flags_it_would_ignore(tmp_path, capsys, argv):
    assert cli(["--report", _report(tmp_path), *argv]) == 2
    out, err = capsys.readouterr()
    flags = ", ".join(a for a in argv if a.startswith("--"))
    assert f"error: {flags}: pre-run check flag(s), not used by --report" in err and out == "", err


def test_triage_and_peak_flags_in_range_are_used(tmp_path, capsys):
    report = _report(tmp_path)
    assert cli(["--report", report, "--lanes", "2"]) == 0
    assert "utilisation 45% [(generate 5 s + train 4 s) / (wall_s 10 s x 2 lane(s))]" in capsys.readouterr().out
    assert cli(["--report", report, "--high-util", "0.95"]) == 0  # 90% is no longer high
    assert "ok    triage all: no clear bottleneck" in capsys.readouterr().out
    assert cli(["--report", report, "--high-util", "0.9"]) == 0
    assert "ok    triage all: compute-bound" in capsys.readouterr().out
    peak = ["--peak", "trainer=8GiB", "--device-memory", "64GiB", "--threads", "1"]
    assert cli([*peak, "--headroom", "0.5"], env={}) == 0 and "trainer 0.188" in capsys.readouterr().out  # 8x1.5/64
    assert cli(peak, env={}) == 0 and "trainer 0.15" in capsys.readouterr().out  # the default headroom, 0.2


def test_triage_refuses_a_runs_lanes_that_are_not_whole():
    """The report's own ``lanes`` (``mrl doctor``'s --lanes and --high-util are checked by its arguments, above)."""
    run = _run(5.0, 4.0, 10.0)
    with pytest.raises(ConfigError, match=r"report run 'all' lanes: must be a whole number >= 1, got 0\.5"):
        triage("all", run | {"lanes": 0.5})  # was int(0.5) = 0 lanes: ZeroDivisionError
    assert triage("all", run | {"lanes": 2.0}).utilisation == pytest.approx(0.45)


# ---------------------------------------------------------------------------------------------------------------------
# bundled config names and supported versions (real `mrl doctor` processes)
# ---------------------------------------------------------------------------------------------------------------------


def _doctor_proc(*args: str, pythonpath: str | None = None) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/tmp",
    )


def test_doctor_config_takes_bundled_names():
    proc = _doctor_proc("--config", "colocate")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Errno" not in proc.stderr
    # colocate.yaml: 1 trainer + 1 worker, each 1 thread
    assert re.search(r"^ok +threads: 1\+1 = 2 threads over 2 process", proc.stdout, re.M), proc.stdout
    proc = _doctor_proc("--config", "nosuch")
    assert proc.returncode == 2 and "bundled configs: 'colocate'" in proc.stderr


def test_doctor_reports_supported_versions():
    from importlib.metadata import version

    proc = _doctor_proc()
    line = next(line for line in proc.stdout.splitlines() if "supported versions" in line)
    assert line.startswith("ok ") and f"trl {version('trl')} (trl<1.17.0,>=1.14.0)" in line
    assert f"transformers {version('transformers')} (transformers>=" in line and f"torch {version('torch')}" in line


def _fake_dist(root, name: str, ver: str) -> None:
    info = root / f"{name}-{ver}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n")


@pytest.mark.parametrize(
    "name,ver,expected",
    [
        ("trl", "1.13.0", "TRL 1.13.0 is not supported by this mrl-plugins release; supported: trl<1.17.0,>=1.14.0"),
        ("trl", "1.17.0", "TRL 1.17.0 is not supported"),
        ("transformers", "4.57.0", "transformers 4.57.0 is outside the supported range transformers>=5.0"),
    ],
)
def test_doctor_fails_an_unsupported_version(tmp_path, name, ver, expected):
    """A distribution of another version ahead on sys.path is what importlib.metadata (and pip) report."""
    _fake_dist(tmp_path, name, ver)
    proc = _doctor_proc("--threads", "1", pythonpath=str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if "supported versions" in line)
    assert line.startswith("fail ") and expected in line, line


def test_version_problems_missing_and_local_versions():
    from mrl_plugins.cli.doctor_versions import version_problems

    have = {"trl": None, "transformers": "5.1.0", "torch": "2.13.0+cpu", "accelerate": "1.10.0"}
    ok, missing, bad = version_problems(have.get, {"transformers": ">=5.0", "torch": ">=2.4", "accelerate": ">=1.10"})
    assert missing == ["trl not installed (supported: trl<1.17.0,>=1.14.0)"] and not bad
    assert "torch 2.13.0+cpu (torch>=2.4)" in ok  # a local build tag (+cpu, +cu121) is the same release
    ok, missing, bad = version_problems({**have, "torch": "2.3.1+cu121"}.get, {"torch": ">=2.4"})
    assert bad == ["torch 2.3.1+cu121 is outside the supported range torch>=2.4"]


def test_trl_1_15_without_triton_is_named_as_a_limit_of_trl_itself(monkeypatch):
    import importlib.util

    from mrl_plugins.cli.doctor_versions import trl_version_notes

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real(name, *a))
    (note,) = trl_version_notes({"trl": "1.15.0"}.get)
    assert "TRL 1.15.0" in note and "Triton" in note and "use TRL 1.14 or 1.16 on CPU" in note
    assert trl_version_notes({"trl": "1.16.0"}.get) == [] and trl_version_notes({"trl": "1.14.2"}.get) == []
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "triton" else None)
    assert trl_version_notes({"trl": "1.15.0"}.get) == []


# ---------------------------------------------------------------------------------------------------------------------
# the run's pre-flight, and the flags over the config


@pytest.mark.parametrize(
    ("yaml_text", "says"),
    [
        ("rollout: {engine: bogus}\n", "rollout.engine: unknown rollout engine 'bogus'"),
        ("plugins: {rollout: nope}\n", "plugins.rollout: unknown plugin 'nope'"),
        ("disable: [xyz]\n", "disable: unknown plugin 'xyz'"),
        ("plugins: {rollout: upstream}\n", "plugins.weight_sync: 'mrl' needs a separate inference copy"),
        ("mode: disaggregated\nrollout: {workers: 64}\ntrain: {device: cpu}\n", "rollout.workers: 64 rollout"),
    ],
)
def test_config_a_run_refuses_fails_doctor(tmp_path, capsys, yaml_text, says):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    assert cli(["--config", str(cfg)], env={}) == 1
    out = capsys.readouterr().out
    assert _lines(out)["config"] == ["fail"] and f"a run refuses it: {says}" in out, out


def test_config_a_run_takes_passes_doctor(capsys):
    assert cli(["--config", "colocate"], env={}) == 0
    assert "ok    config: passes the run's pre-flight" in capsys.readouterr().out


def test_mode_flag_wins_over_the_config_everywhere(fake_npu, tmp_path, capsys):
    """FAKE NPUs: ``--mode`` places the processes (card plan) as the run of that mode would."""
    env, _ = fake_npu
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: colocate\nrollout: {workers: 1}\n")
    env = env | {"ASCEND_RT_VISIBLE_DEVICES": "3"}
    cli(["--config", str(cfg)], env=env)
    assert "both get card 3" in capsys.readouterr().out  # colocate: the worker shares the trainer's card
    cli(["--config", str(cfg), "--mode", "disaggregated"], env=env)
    line = [x for x in capsys.readouterr().out.splitlines() if "visible devices:" in x]
    assert line[0].startswith("fail") and "needs device index 1 but" in line[0], line


def test_device_flag_follows_the_one_device_spec_rule_with_or_without_a_config(capsys):
    """``--device ' CPU'`` is the spec a run's train.device takes (it was refused with ``--config``, accepted
    without); a bad spec is one input error either way."""
    assert cli(["--device", " CPU", "--threads", "1"], env={}) == 0
    assert cli(["--config", "colocate", "--device", " CPU"], env={}) == 0
    capsys.readouterr()
    assert cli(["--config", "colocate", "--device", "tpu"], env={}) == 2
    assert "train.device: 'tpu' is not a device; valid forms:" in capsys.readouterr().err
