"""`python -m benchmarks comm --link RATE`: experience between two network namespaces over a shaped link (smoke run
of the real command; the measured figures are in docs/multi-host.md)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from benchmarks.link import parse_rate
from tests import netns as two_hosts
from tests.conftest import benchmarks_command, benchmarks_env

hosts = two_hosts.hosts  # the fixture (here only for its skip where namespaces cannot be made)


def test_link_rates_are_read_as_tc_reads_them():
    assert parse_rate("1gbit") == 1e9 and parse_rate("200mbit") == 2e8 and parse_rate("64kbit") == 64e3
    with pytest.raises(ValueError, match="expected a tc rate like 1gbit"):
        parse_rate("1GB/s")


@pytest.mark.slow
def test_bench_comm_over_a_link_reports_the_compression_gain(hosts, tmp_path):
    out = tmp_path / "link.json"
    cmd = benchmarks_command("comm", "--link", "200mbit", "--quick", "--reps", "1", "--json", str(out))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=benchmarks_env(two_hosts.child_env()))
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: a target missed (none is set below 1 Gbit/s)
    res = json.loads(out.read_text())
    r = res["ratios"]
    assert r["compressed_bytes_link_64x1024"] < 0.5  # fp16 frames are about a third of raw ones
    assert r["compressed_vs_raw_link_64x1024"] > 1.3  # where the link is the bottleneck, fewer bytes are faster
    raw = res["cases"]["link_raw"]["64x1024"]["link_utilisation"]["median"]
    assert 0.5 < raw < 1.05  # raw frames fill the shaped link
    assert "200mbit" in proc.stdout and "load" in proc.stdout


@pytest.mark.slow
def test_plan_checks_the_budget_against_a_measured_link(hosts):
    """`python -m benchmarks plan --measure RATE`: the link the experience path measured between two namespaces is
    the one checked (x3 headroom): the source's experience example fits 1 Gbit/s, a 0.5B model's weights every 15 s
    do not."""
    budget = ["--envs", "128", "--rate", "200", "--bytes", "512", "--params", "0.5e9", "--update-interval", "15"]
    env = benchmarks_env(two_hosts.child_env())
    proc = subprocess.run(benchmarks_command("plan", *budget, "--measure", "1gbit"), capture_output=True, text=True,
                          timeout=300, env=env)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]  # a path is over the link
    m = re.search(r"over a 1gbit link between two network namespaces: ([\d.]+) MB/s \((\d+)% of", proc.stdout)
    assert m and 80 < float(m.group(1)) < 126 and 64 <= int(m.group(2)) <= 101, proc.stdout
    lines = proc.stdout.splitlines()
    assert " ok " in next(x for x in lines if x.startswith("experience")), proc.stdout  # 39.3 MB/s provisioned
    assert " over " in next(x for x in lines if x.startswith("weights")), proc.stdout  # 200 MB/s provisioned
    assert "over the link: weights" in proc.stderr
    both = benchmarks_command("plan", *budget, "--link", "1Gbit", "--measure", "1gbit")
    bad = subprocess.run(both, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode == 2 and "give either --link or --measure, not both" in bad.stderr
