"""``mrl run`` and a short ``mrl compare`` on the tiny preset (the full small comparison is a benchmark)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.marks import require_trl, require_vllm

pytestmark = [require_trl, pytest.mark.slow]


def _mrl(*args: str, cwd, timeout: float = 600, **env_extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    env.pop("MRL_PLUGINS", None)
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "mrl_plugins.cli.main", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _no_warmup_config(tmp_path, name: str):
    """A bundled config with rollout.local_warmup off and placement fixed: tiny runs are shorter than a worker's
    start-up, and too short for placement auto ever to start the workers."""
    import yaml

    from mrl_plugins.config import load_yaml

    data = load_yaml(name)
    data.setdefault("rollout", {}).update(local_warmup=False, placement="fixed")
    path = tmp_path / f"{name}-nowarmup.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_mrl_run_trains_and_writes_json(tmp_path):
    config = _no_warmup_config(tmp_path, "colocate")
    proc = _mrl("run", config, "--model", "tiny", "--steps", "3", "--json", str(tmp_path / "r.json"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "switch model_id=policy" in proc.stderr  # version log lines reach the run log
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["steps"] == 3 and len(result["rewards"]) == 3
    assert result["plugins"]["rollout"] == "mrl"
    assert result["mrl_metrics"]["mrl/weights/bytes"] > 0


def test_mrl_run_is_not_switched_on_by_the_startup_variable(tmp_path):
    """MRL_PLUGINS (the switch for a user's own scripts) set in the shell: `mrl run --vanilla` stays plain TRL, and a
    plugin run is enabled once, with its own config."""
    vanilla = _mrl("run", "--vanilla", "--model", "tiny", "--steps", "1", cwd=tmp_path, MRL_PLUGINS="colocate")
    assert vanilla.returncode == 0, vanilla.stderr[-3000:]
    out = vanilla.stdout + vanilla.stderr
    assert "mrl-plugins: " not in out and "plugins {'rollout': 'vanilla'}" in out, out[-2000:]
    config = _no_warmup_config(tmp_path, "colocate")
    run = _mrl("run", config, "--model", "tiny", "--steps", "1", cwd=tmp_path, MRL_PLUGINS="upstream")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr.count("mrl-plugins: ") == 1 and "mrl-plugins: rollout=mrl (1 worker" in run.stderr


def test_mrl_run_bad_config_is_one_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: cluster\n")
    proc = _mrl("run", str(bad), cwd=tmp_path)
    assert proc.returncode == 2
    assert "mode" in proc.stderr and "colocate" in proc.stderr and "Traceback" not in proc.stderr


def _compare(tmp_path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "cmp"
    proc = _mrl("compare", *args, "--out", str(out), cwd=tmp_path, timeout=timeout)
    report = json.loads((out / "report.json").read_text()) if (out / "report.json").exists() else {}
    return proc, report


def test_mrl_compare_quick_repeats_interleaved_with_load_progress_and_plots(tmp_path):
    out = tmp_path / "cmp"
    proc, report = _compare(
        tmp_path, "--quick", "--repeats", "2", "--runs", "upstream,all", "--json", str(tmp_path / "c.json"),
        "--tolerance", "0.99",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "c.json").read_text()) == report
    # interleaved, order rotated each round
    assert report["order"] == [[1, "upstream"], [1, "all"], [2, "all"], [2, "upstream"]]
    assert report["repeats_per_kind"] == 2
    for kind in ("upstream", "all"):
        reps = report["repeats"][kind]
        assert len(reps) == 2 and all(r["steps"] == 8 for r in reps)  # --quick: 8 steps on the tiny preset
        for key in ("steps_per_s", "wall_s", "final_reward"):
            st = report["medians"][kind][key]
            values = sorted(r[key] for r in reps)
            assert st["n"] == 2 and st["min"] == values[0] and st["max"] == values[1]
            assert st["median"] == pytest.approx(sum(values) / 2)
        assert report["runs"][kind] in reps  # the representative (median-speed) repeat, what doctor --report reads
        assert [(r["round"], r["seed"]) for r in reps] == [(1, 0), (2, 1)]  # each round its own seed
    # per seed: both kinds of a round share its seed; the round's ratio is its own kinds' speeds
    assert set(report["seeds"]) == {"0", "1"}
    for seed, runs in report["seeds"].items():
        assert set(runs) == {"upstream", "all"}
        up, al = (next(r for r in report["repeats"][k] if r["seed"] == int(seed)) for k in ("upstream", "all"))
        assert runs["all"]["x_upstream"] == pytest.approx(al["steps_per_s"] / up["steps_per_s"])
        assert runs["all"]["final_reward"] == al["final_reward"] and runs["all"]["collapsed"] is False  # 8 steps
    assert report["collapsed_at_seeds"] == {"upstream": [], "all": []}
    assert "## per seed" in (out / "report.md").read_text()
    spread = report["medians"]["all"]["steps_per_s"], report["medians"]["upstream"]["steps_per_s"]
    overlap = spread[0]["min"] <= spread[1]["max"] and spread[1]["min"] <= spread[0]["max"]
    assert report["verdict"]["all"].startswith("no significant difference" if overlap else ("faster", "slower"))
    assert math.isfinite(report["speedup"]) and report["speedup"] > 0
    # host load sampled before and during every run
    assert [(x["kind"], x["round"]) for x in report["load"]] == [tuple(o[::-1]) for o in report["order"]]
    for x in report["load"]:
        assert x["before"]["load1"] >= 0 and 0 <= x["before"]["others_cpu_share"] <= 1
        assert x["during"]["samples"] >= 1 and 0 <= x["during"]["others_cpu_share_mean"] <= 1
    host = report["host"]
    assert host["cpus"] == os.cpu_count() and (host["warning"] is not None) == bool(host["busy_runs"])
    md = (out / "report.md").read_text()
    if host["warning"]:
        assert "WARNING: the host was busy" in md and "WARNING: the host was busy" in proc.stdout
    assert "| upstream | 2 |" in md and "| all | 2 |" in md and f"- all: {report['verdict']['all']}" in md
    # progress: each run named with its log file, and step lines within a run
    for i, (rnd, kind) in enumerate(report["order"], 1):
        log = out / "runs" / f"{kind}-{rnd}.log"
        assert f"[run {i}/4] {kind} (round {rnd}/2)  log: {log}" in proc.stdout
        assert log.stat().st_size > 0
    assert "upstream: step 0/8, elapsed" in proc.stdout  # moves before the first step too (setup)
    assert "upstream: step 8/8, elapsed" in proc.stdout and "ETA" in proc.stdout
    assert "all: step 8/8" in proc.stdout
    # plots and the timestamps they are drawn from
    for name in ("report.md", "report.json", "reward.png", "time_split.png", "speed.png"):
        assert (out / name).stat().st_size > 0, name
    assert report["plots"] == ["time_split.png", "reward.png", "speed.png"]
    for kind in ("upstream", "all"):
        tl = report["runs"][kind]["timeline"]
        assert len(tl["steps"]) == 8 and len(tl["reward_t"]) == 8
        assert 0 < tl["train"][0] < tl["steps"][0][0] <= tl["steps"][-1][1] <= tl["train"][1] <= tl["wall"][1]
        assert any(k == "generate" for k, *_ in tl["trainer"])
    all_tl = report["runs"]["all"]["timeline"]
    assert all_tl["worker"] and all(w == 0 and k == "generate" and a < b for w, k, a, b in all_tl["worker"])
    assert any(k == "wait" for k, *_ in all_tl["trainer"]) and not report["runs"]["upstream"]["timeline"]["worker"]
    assert report["runs"]["all"]["mrl_metrics"]["mrl/comm/bytes"] > 0


def test_mrl_compare_fails_when_reward_drops(tmp_path):
    """tolerance 0 and a plugin run whose reward differs from upstream's: at least one direction fails."""
    proc, report = _compare(tmp_path, "--quick", "--repeats", "1", "--tolerance", "0")
    below = report["final_reward"]["all"] < report["final_reward"]["upstream"]
    assert proc.returncode == (1 if below else 0)
    assert report["reward_ok"] is (not below) and report["reward_enforced"] is True


def test_mrl_compare_exits_1_when_real_runs_fail(tmp_path):
    """Real runs that fail (each killed at --timeout, long before it can train): the command says upstream failed and
    nothing could be compared, not "upstream did not run" and "yes", and exits 1."""
    proc, report = _compare(tmp_path, "--quick", "--repeats", "2", "--runs", "upstream,all", "--timeout", "0.5")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "upstream: FAILED: timed out after 0.5 s (--timeout)" in proc.stdout
    assert "- no speed verdict: upstream failed, so no kind could be compared with it" in proc.stdout
    assert "(medians): NO: upstream FAILED before any run finished" in proc.stdout
    assert "(medians): yes" not in proc.stdout
    fail = "FAIL: run(s) failed: upstream (round 1 of 2, not run again), all (round 1 of 2, not run again)"
    assert fail in proc.stderr
    assert report["order"] == [[1, "upstream"], [1, "all"], [2, "all"], [2, "upstream"]]  # round 2 not run
    assert [x["kind"] for x in report["load"]] == ["upstream", "all"]
    assert set(report["failed"]) == {"upstream", "all"} and report["no_result"] == ["upstream", "all"]
    assert report["reward_ok"] is False and report["exit_code"] == 1


def test_mrl_compare_vllm_kind_skipped_when_vllm_is_missing(tmp_path):
    """vllm blocked in the compare process: its rows say why they were skipped, and upstream still runs."""
    code = (
        "import sys; sys.modules['vllm'] = None; from mrl_plugins.cli.main import main; "
        f"sys.exit(main(['compare', '--quick', '--repeats', '1', '--runs', 'upstream,vllm,trl_vllm', "
        f"'--out', {str(tmp_path / 'cmp')!r}]))"
    )
    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "cmp" / "report.json").read_text())
    assert set(report["skipped"]) == {"vllm", "trl_vllm"} and "vllm is not installed" in report["skipped"]["vllm"]
    assert report["order"] == [[1, "upstream"]] and set(report["repeats"]) == {"upstream"}
    assert report["reward_enforced"] is False  # --quick without --tolerance: a few steps' reward is not judged
    assert "| vllm | 0 | skipped: vllm is not installed" in (tmp_path / "cmp" / "report.md").read_text()


@require_vllm
def test_mrl_compare_vllm_kinds(tmp_path):
    """The plugin on vLLM runs; TRL's own use_vllm colocate fails on CPU at its first weight sync into vLLM: the row
    says so with the error, it is not repeated, the comparison goes on, and the command exits 1 naming it."""
    proc, report = _compare(
        tmp_path, "--quick", "--repeats", "1", "--runs", "upstream,trl_vllm,vllm", "--tolerance", "0.99", timeout=1200
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "FAIL: run(s) failed: trl_vllm (round 1 of 1)" in proc.stderr and report["no_result"] == ["trl_vllm"]
    vllm = report["repeats"]["vllm"][0]
    assert vllm["steps"] == 8 and vllm["mrl_metrics"]["mrl/comm/bytes"] > 0
    err = report["failed"]["trl_vllm"]
    assert "AttributeError" in err and "weight_loader" in err and "trl_vllm-1.log" in err
    assert report["repeats"]["trl_vllm"] == [] and "trl_vllm" not in report["medians"]
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "| trl_vllm | 0 | FAILED: exit" in md and "| vllm | 1 |" in md
    assert "trl_vllm: FAILED: exit" in proc.stdout


def test_speed_verdict_and_busy_warning():
    """The verdict's rule and the busy-host warning on given numbers (the CLI tests cover them on real runs)."""
    from mrl_plugins.cli.compare import host_summary, verdict

    def st(lo, med, hi, n=3):
        return {"min": lo, "median": med, "max": hi, "n": n}

    assert verdict(st(1.0, 1.1, 1.3), st(1.2, 1.5, 1.9)).startswith("no significant difference (median 1.36x")
    assert verdict(st(1.0, 1.1, 1.3), st(1.4, 1.5, 1.9)).startswith("faster: 1.36x upstream")
    assert verdict(st(1.0, 1.1, 1.3), st(0.5, 0.6, 0.9)).startswith("slower: 0.55x upstream")
    assert verdict(st(1.0, 1.0, 1.0, 1), st(2.0, 2.0, 2.0, 1)).startswith("2.00x upstream, not judged (a single")

    def load(kind, before, during):
        during_ = {"load1_max": 1.0, "others_cpu_share_mean": during, "others_cpu_share_max": during}
        return {"kind": kind, "round": 1, "before": {"load1": 0.5, "others_cpu_share": before}, "during": during_}

    quiet = host_summary([load("upstream", 0.01, 0.02), load("all", 0.0, 0.05)], 0.15)
    assert quiet["warning"] is None and quiet["busy_runs"] == []
    busy = host_summary([load("upstream", 0.01, 0.02), load("all", 0.40, 0.05)], 0.15)
    assert busy["busy_runs"] == ["all#1"] and busy["warning"].startswith("WARNING: the host was busy")
    assert "in 1 of 2 runs" in busy["warning"]


def test_mrl_compare_sigterm_stops_the_running_run(tmp_path):
    """SIGTERM to `mrl compare` takes the run it is measuring (its whole process group) down with it."""
    import signal
    import time

    import psutil

    env = dict(os.environ, TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    env.pop("MRL_PLUGINS", None)
    cmd = [sys.executable, "-m", "mrl_plugins.cli.main", "compare", "--quick", "--repeats", "1", "--runs", "upstream"]
    proc = subprocess.Popen([*cmd, "--out", str(tmp_path / "cmp")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        runs = []
        while not runs and time.monotonic() < deadline:
            time.sleep(0.2)
            runs = [c for c in psutil.Process(proc.pid).children() if "mrl_plugins.run" in " ".join(c.cmdline())]
        assert runs, "no run process started"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
        psutil.wait_procs(runs, timeout=30)
        assert not any(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in runs)
        assert not (tmp_path / "cmp" / "runs" / "upstream-1.json").exists()  # killed, not finished
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        proc.stdout.close()


def test_a_run_that_unlearned_its_task_counts_as_collapsed():
    from mrl_plugins.cli.compare import collapsed, per_seed

    learning = [0.1] * 10 + [0.5] * 10
    gone = [0.6] * 10 + [0.2] * 5 + [0.0] * 10  # the tool job at some seeds: reward to 0
    assert not collapsed(learning) and collapsed(gone)
    assert not collapsed([0.6] * 5 + [0.0] * 5)  # too short to have two windows: never counts
    assert not collapsed([0.0] * 25)  # nothing to lose
    rep = {"steps_per_s": 2.0, "final_reward": 0.5}
    got = per_seed(
        {
            "upstream": [{**rep, "seed": 0, "rewards": learning}, {**rep, "seed": 1, "rewards": gone}],
            "all": [{**rep, "steps_per_s": 3.0, "seed": 0, "rewards": learning}],
        }
    )
    assert got["collapsed_at_seeds"] == {"upstream": [1], "all": []}
    assert got["seeds"]["0"]["all"]["x_upstream"] == 1.5 and got["seeds"]["1"]["upstream"]["collapsed"] is True


@pytest.mark.parametrize(
    ("flag", "value", "says"),
    [
        ("--steps", "0", "argument --steps: must be an integer >= 1, got '0'"),
        ("--model", "", "argument --model: must be a preset or a checkpoint folder, got ''"),
        ("--timeout", "nan", "argument --timeout: must be a finite number of seconds > 0, got 'nan'"),
        ("--timeout", "0", "argument --timeout: must be a finite number of seconds > 0"),
        ("--timeout", "-1", "argument --timeout: must be a finite number of seconds > 0"),
        ("--busy-threshold", "1.5", "argument --busy-threshold: must be a fraction in [0, 1], got '1.5'"),
        ("--repeats", "0", "argument --repeats: must be an integer >= 1, got '0'"),
        ("--tolerance", "1", "argument --tolerance: must be a fraction in [0, 1), got '1'"),
        ("--tolerance", "-0.1", "argument --tolerance: must be a fraction in [0, 1)"),
    ],
)
def test_mrl_compare_flags_are_checked_before_any_run(tmp_path, capsys, flag, value, says):
    from mrl_plugins.cli.compare import cli

    with pytest.raises(SystemExit) as exit_:
        cli([flag, value, "--out", str(tmp_path / "out")])
    assert exit_.value.code == 2 and says in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing ran


def test_mrl_compare_model_help_names_every_preset(capsys):
    from mrl_plugins.cli.compare import cli
    from mrl_plugins.demo.models import PRESETS

    with pytest.raises(SystemExit):
        cli(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(f"'{name}'" in text for name in PRESETS) and "'qwen2-tiny'" in text


def _fake_runs(monkeypatch, failing: set[tuple[str, int]]):
    """``run_one`` replaced: each (kind, round) in ``failing`` exits 1 with a ConfigError, the others finish with the
    same numbers (no process is started; the plots are not drawn)."""
    from mrl_plugins.cli import compare, compare_plots

    def run_one(config_path, name, kind, base, *, timeout, max_steps, on_poll):
        load = {
            "before": {"load1": 0.0, "others_cpu_share": 0.0},
            "during": {"samples": 1, "load1_max": 0.0, "others_cpu_share_mean": 0.0, "others_cpu_share_max": 0.0},
            "wall_s": 1.0,
        }
        if (name, int(base.name.rsplit("-", 1)[1])) in failing:
            return None, "exit 1: mrl_plugins.errors.ConfigError: boom", load
        result = {"steps": 2, "steps_per_s": 1.0, "wall_s": 3.0, "train_s": 2.0, "tokens_per_s": 50.0,
                  "final_reward": 0.5, "rewards": [0.5, 0.5], "time_split": {"generate": 1.0, "train": 1.0},
                  "peak_rss_bytes": 2**20}  # fmt: skip
        return result, None, load

    monkeypatch.setattr(compare, "run_one", run_one)
    monkeypatch.setattr(compare_plots, "plots", lambda report, names, out: [])


@pytest.mark.parametrize(
    ("runs", "repeats", "failing", "no_result", "says", "fail_line"),
    [
        (
            "upstream,all", 1, {("all", 1)}, ["all"],
            ["- all: not compared (FAILED before any run finished)",
             "(medians): NO: all FAILED before any run finished: nothing to compare"],
            "FAIL: run(s) failed: all (round 1 of 1);",
        ),
        (
            "upstream,all", 2, {("upstream", 1), ("all", 1)}, ["upstream", "all"],
            ["- no speed verdict: upstream failed, so no kind could be compared with it",
             "(medians): NO: upstream FAILED before any run finished, so no kind could be compared with it; "
             "all FAILED"],
            "FAIL: run(s) failed: upstream (round 1 of 2, not run again), all (round 1 of 2, not run again);",
        ),
        (  # the second round's run fails: the first one's numbers are compared, and the command still fails
            "upstream,all", 2, {("all", 2)}, [],
            ["| all | 1 | FAILED: exit 1", "- all: 1.00x upstream, not judged",
             "(then a run of it FAILED: see its row)", "(medians): yes"],
            "FAIL: run(s) failed: all (round 2 of 2);",
        ),
        ("upstream,all", 1, set(), [], ["- all: 1.00x upstream, not judged", "(medians): yes"], None),
        ("upstream", 1, set(), [], ["- no speed verdict: only upstream ran (--runs named no other kind)"], None),
    ],
)  # fmt: skip
def test_mrl_compare_exits_1_and_says_so_when_a_run_fails(
    tmp_path, capsys, monkeypatch, runs, repeats, failing, no_result, says, fail_line
):
    """Any failed run makes the command exit 1 with a FAIL line naming it; the speed and reward lines give the true
    reason a kind was not compared; report.json records it (``failed``, ``no_result``, ``exit_code``)."""
    from mrl_plugins.cli.compare import cli

    _fake_runs(monkeypatch, failing)
    config = tmp_path / "c.yaml"
    config.write_text("train: {model: tiny, steps: 2}\n")
    rc = cli(["--config", str(config), "--runs", runs, "--repeats", str(repeats), "--out", str(tmp_path / "out")])
    out, err = capsys.readouterr()
    assert rc == (1 if failing else 0), out + err
    if fail_line:
        assert fail_line in err and "FAIL: final reward" not in err
    else:
        assert "FAIL" not in err
    md = (tmp_path / "out" / "report.md").read_text()
    for text in says:
        assert text in out and text in md, (text, out)
    assert "upstream did not run" not in out
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert sorted(report["failed"]) == sorted({k for k, _ in failing}) and report["no_result"] == no_result
    assert report["reward_ok"] is (not no_result) and report["exit_code"] == rc


def test_mrl_compare_default_runs_leave_out_what_cannot_run_on_cpu(tmp_path, capsys, monkeypatch):
    """vLLM installed, a CPU job, no --runs: TRL's own use_vllm kind (it fails on CPU at its first weight sync) is
    skipped with the reason, not run into a failure that would fail the command; named in --runs it runs."""
    from mrl_plugins.cli import compare

    _fake_runs(monkeypatch, set())
    monkeypatch.setattr(compare, "installed", lambda module: True)
    monkeypatch.setattr(compare, "preflight_runs", lambda *a, **k: None)  # it would find vllm absent
    config = tmp_path / "c.yaml"
    config.write_text("train: {model: tiny, steps: 2, device: cpu}\n")
    assert compare.cli(["--config", str(config), "--repeats", "1", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["skipped"] == {"trl_vllm": f"skipped: {compare.RUNS['trl_vllm'].cpu_fails}"}
    assert "vllm" in report["repeats"] and "trl_vllm" not in report["repeats"]
    named = ["--config", str(config), "--repeats", "1", "--runs", "trl_vllm", "--out", str(tmp_path / "named")]
    assert (
        compare.cli(named) == 0
        and "trl_vllm" in json.loads((tmp_path / "named" / "report.json").read_text())["repeats"]
    )
    capsys.readouterr()
