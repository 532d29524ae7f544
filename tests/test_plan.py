"""``python -m benchmarks plan``: bandwidth budget arithmetic, the product's unit parsing
(``benchmarks/units.py``), the CLI table/JSON and exit codes."""

from __future__ import annotations

import json
import subprocess

import pytest

from benchmarks.plan import build_plan, check_paths, cli, experience_budget, frame_bytes_from_report, weight_budget
from benchmarks.units import RATE_UNITS, format_rate, parse_rate, parse_size
from mrl_plugins.errors import ConfigError
from tests.conftest import benchmarks_command, benchmarks_env


def test_source_worked_example_is_13_1_mb_per_s():
    """Source §2.2: 128 envs x 200 transitions/s x 512 B = 13,107,200 B/s, printed as 13.1 MB/s; x3 provisioned."""
    b = experience_budget(128, 200, 512)
    assert b.bytes_per_s == 128 * 200 * 512 == 13_107_200
    assert format_rate(b.bytes_per_s) == "13.1 MB/s"
    assert b.provisioned_bytes_per_s == pytest.approx(3 * 13_107_200)
    assert experience_budget(128, 200, 512, headroom=1.5).provisioned_bytes_per_s == pytest.approx(1.5 * 13_107_200)


def test_weight_budget_per_update_per_path_and_sender():
    w = weight_budget(0.5e9, "bf16", 15, receivers=4)
    assert w.bytes_per_update == 1e9  # 0.5e9 params x 2 bytes
    assert w.per_path_bytes_per_s == pytest.approx(1e9 / 15)
    assert w.sender_bytes_per_s == pytest.approx(4e9 / 15)
    assert w.provisioned_per_path_bytes_per_s == pytest.approx(3e9 / 15)
    assert weight_budget(1e9, "fp32", 10).bytes_per_update == 4e9
    assert weight_budget(1e9, "int4", 10).bytes_per_update == 0.5e9


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("10Gbit", 1.25e9),
        ("10 Gbit/s", 1.25e9),
        ("10Gb/s", 1.25e9),
        ("10Gbps", 1.25e9),
        ("10gbit", 1.25e9),
        ("100Mbit", 12.5e6),
        ("1.25GB/s", 1.25e9),
        ("800MB/s", 8e8),
        ("1GiB/s", 2**30),
        ("512KiB/s", 512 * 1024),
        ("2.5e3B/s", 2500.0),
        ("8bit/s", 1.0),
    ],
)
def test_parse_rate_units(text, expected):
    assert parse_rate(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["-10Gbit", "0Gbit", "10", "10Xb", "fast", "10 GB/h", "10gb/s", "nanGbit"])
def test_parse_rate_rejects_bad_input_naming_valid_units(text):
    with pytest.raises(ConfigError) as err:
        parse_rate(text)
    msg = str(err.value)
    assert "valid units" in msg and "Gbit/s" in msg and "MB/s" in msg


def test_bits_and_bytes_are_not_confused():
    assert parse_rate("1Gb/s") * 8 == pytest.approx(parse_rate("1GB/s"))
    assert all(v > 0 for v in RATE_UNITS.values())


def test_parse_size():
    assert parse_size("512") == 512
    assert parse_size(512) == 512
    assert parse_size("4KiB") == 4096
    assert parse_size("1.5MB") == 1.5e6
    with pytest.raises(ConfigError, match="valid units"):
        parse_size("4XB")
    with pytest.raises(ConfigError, match="positive"):
        parse_size("-1")


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: experience_budget(-1, 200, 512), "envs"),
        (lambda: experience_budget(1.5, 200, 512), "whole number"),
        (lambda: experience_budget(128, 0, 512), "rate"),
        (lambda: experience_budget(128, 200, 512, headroom=-3), "headroom"),
        (lambda: weight_budget(0.5e9, "bf17", 15), "bf16"),
        (lambda: weight_budget(0.5e9, "bf16", 0), "update interval"),
        (lambda: weight_budget(0.5e9, "bf16", 15, receivers=0), "receivers"),
    ],
)
def test_budget_bad_input(call, match):
    with pytest.raises(ConfigError, match=match):
        call()


def test_check_paths_utilisation_is_provisioned_over_link():
    rows = check_paths([("a", "", 10.0, 30.0), ("b", "", 50.0, 150.0)], link_bytes_per_s=100.0)
    assert [r.status for r in rows] == ["ok", "over"]
    assert rows[0].utilisation == pytest.approx(0.30) and rows[1].utilisation == pytest.approx(1.5)
    assert check_paths([("a", "", 1.0, 3.0)], None)[0].status == "-"
    with pytest.raises(ConfigError, match="nothing to plan"):
        build_plan(None, None)


def test_cli_worked_example_table_and_json(tmp_path, capsys):
    out_json = tmp_path / "plan.json"
    argv = "--envs 128 --rate 200 --bytes 512 --params 0.5e9 --update-interval 15 --receivers 4 --link 10Gbit"
    rc = cli([*argv.split(), "--json", str(out_json)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "13.1 MB/s" in out and "39.3 MB/s" in out  # need and x3
    assert "66.7 MB/s" in out and "267 MB/s" in out  # weights per path and trainer egress
    assert "1.25 GB/s" in out and "64.0%" in out  # egress provisioned 800 MB/s on a 1.25 GB/s link
    plan = json.loads(out_json.read_text())
    paths = {p["path"]: p for p in plan["paths"]}
    assert paths["experience rollout->trainer"]["need_bytes_per_s"] == 13_107_200
    assert paths["weights trainer egress"]["utilisation"] == pytest.approx(0.64)
    assert plan["inputs"]["weights"]["bytes_per_update"] == 1e9 and plan["over"] is False


def test_cli_over_link_exits_1(capsys):
    rc = cli(["--envs", "128", "--rate", "200", "--bytes", "512", "--link", "100Mbit"])
    captured = capsys.readouterr()
    assert rc == 1
    assert "over" in captured.out and "314.6%" in captured.out  # 39.3 MB/s on 12.5 MB/s
    assert "experience rollout->trainer" in captured.err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--envs", "128", "--rate", "200", "--bytes", "512", "--link", "10Xb"], "Gbit/s"),
        (["--envs", "128", "--rate", "200"], "--bytes"),
        (["--params", "1e9"], "--update-interval"),
        ([], "nothing to plan"),
        (["--envs", "-4", "--rate", "200", "--bytes", "512"], "envs"),
    ],
)
def test_cli_bad_input_exits_2_with_one_clear_error(argv, match, capsys):
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("error:") == 1


def test_frame_bytes_from_report(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(
        json.dumps(
            {
                "runs": {
                    "upstream": {"wall_s": 10.0},
                    "all": {"comm_bytes": 4096 * 100, "comm_frames": 100},
                    "comm": {"metrics": {"mrl/comm/bytes": 3000.0, "mrl/comm/frames": 3}},
                    "compare": {"mrl_metrics": {"mrl//comm/bytes": 500.0, "mrl//comm/frames": 5}},
                }
            }
        )
    )
    assert frame_bytes_from_report(report) == ("all", 4096.0)
    assert frame_bytes_from_report(report, run="comm") == ("comm", 1000.0)
    assert frame_bytes_from_report(report, run="compare") == ("compare", 100.0)  # mrl compare's per-run metrics
    with pytest.raises(ConfigError, match="no run 'nope'"):
        frame_bytes_from_report(report, run="nope")
    rc = cli(["--envs", "10", "--rate", "100", "--frame-bytes-from", str(report), "--link", "1Gbit"])
    out = capsys.readouterr().out
    assert rc == 0 and "4096 B measured in run 'all'" in out and "4.1 MB/s" in out  # 10 x 100 x 4096
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"runs": [{"name": "x", "wall_s": 1}]}))
    assert cli(["--envs", "1", "--rate", "1", "--frame-bytes-from", str(bad)]) == 2
    assert "bytes_per_frame" in capsys.readouterr().err


def test_module_entry_point():
    proc = subprocess.run(
        benchmarks_command("plan", "--envs", "128", "--rate", "200", "--bytes", "512"),
        capture_output=True,
        text=True,
        timeout=60,
        env=benchmarks_env(),
    )
    assert proc.returncode == 0, proc.stderr
    assert "13.1 MB/s" in proc.stdout


def test_placement_plan_refuses_bad_input(capsys):
    assert cli(["--config", "compare_small", "--envs", "3"]) == 2
    assert "the bandwidth options ['--envs'] go without it" in capsys.readouterr().err
    assert cli(["--config", "compare_small", "--steps", "3"]) == 2
    assert "auto's first decision needs at least 5 steps, got 3" in capsys.readouterr().err
    assert cli(["--config", "nope"]) == 2
    assert "not found; bundled configs:" in capsys.readouterr().err


def test_placement_plan_text():
    from benchmarks.placement import format_result, pick

    picked, why = pick(3.1, 2.6, 0.1, 2.4)
    assert picked == "turns" and "keeps the faster of the two measurements" in why
    r = {
        "config": "c.yaml", "model": "small", "steps": 8, "cores": [0, 1], "margin": 0.1, "auto_picks": picked,
        "why": why, "turns": {"measured_steps_per_s": 3.1}, "split_projected_steps_per_s": 2.6,
        "split": {"steady_steps_per_s": 2.4},
    }  # fmt: skip
    text = format_result(r)
    assert "turns     3.10 steps/s  measured" in text and "split     2.60 steps/s  projected" in text
    assert "split     2.40 steps/s  measured" in text
    assert text.splitlines()[-1].startswith("auto picks: turns (the split is projected close: auto tries it")
    assert pick(3.1, 2.6, 0.1, 4.0)[0] == "split"  # tried, measured faster
    assert pick(3.0, 3.5, 0.1, None)[0] == "split"  # projected faster than the margin
    assert pick(3.0, 1.5, 0.1, 9.0)[0] == "turns"  # projected hopeless: never tried


@pytest.mark.slow
def test_placement_plan_measures_on_this_machine(tmp_path):
    """Two short real runs of the tiny model: turns measured, the split projected and measured, auto's pick."""
    from tests.marks import is_trl_available

    if not is_trl_available():
        pytest.skip("needs trl")
    out = tmp_path / "plan.json"
    proc = subprocess.run(
        benchmarks_command("plan", "--config", "compare_small", "--model", "tiny", "--steps", "6", "--json", str(out)),
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env=benchmarks_env(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["auto_picks"] in ("turns", "split") and r["steps"] == 6 and r["model"] == "tiny"
    assert r["turns"]["measured_steps_per_s"] > 0 and r["split_projected_steps_per_s"] > 0
    assert r["split"]["steady_steps_per_s"] > 0
    assert f"auto picks: {r['auto_picks']}" in proc.stdout
