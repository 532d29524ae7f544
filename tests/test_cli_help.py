"""Every ``mrl`` subcommand's ``--help``: exit 0, readable text, and no torch/transformers import before parsing;
and ``python -m benchmarks`` (the lab, run from a checkout): its list, its usage errors, each tool's ``--help``.

Each command runs for real in a fresh interpreter (``python -X importtime -m mrl_plugins.cli.main ... --help``);
``-X importtime`` lists every module the process imported, so a heavy import shows up whatever the machine load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

HEAVY = ("torch", "transformers", "vllm", "torch_npu", "deepspeed", "ray")
COMMANDS = [
    [],
    ["plugins"],
    ["run"],
    ["compare"],
    ["doctor"],
    ["worker"],
    ["trl"],
]
BENCHMARKS = ("comm", "weights", "rollout", "engine", "ray", "plan")


def _help(args: list[str], flag: str = "--help") -> tuple[subprocess.CompletedProcess, set[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MRL_")}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "mrl_plugins.cli.main", *args, flag],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd="/tmp",
    )
    # importtime lines: "import time: self [us] | cumulative | imported package" (nested ones indented)
    imported = {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)$", proc.stderr, re.M)}
    return proc, imported


@pytest.mark.parametrize("args", COMMANDS, ids=lambda a: " ".join(a) or "mrl")
def test_help_exits_0_without_heavy_imports(args):
    proc, imported = _help(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    assert "``" not in proc.stdout  # reST markup does not belong in terminal help
    assert imported, "no -X importtime output: the check below would pass vacuously"
    heavy = sorted(m for m in imported if m.split(".")[0] in HEAVY)
    assert not heavy, f"`mrl {' '.join(args)} --help` imported {heavy[:5]}"


def test_short_help_flag_too():
    proc, imported = _help(["doctor"], "-h")
    assert proc.returncode == 0 and "--config" in proc.stdout and "torch" not in imported


def test_the_lab_is_not_a_command_of_the_package():
    for args in (["bench", "comm"], ["plan"]):
        cmd = [sys.executable, "-m", "mrl_plugins.cli.main", *args, "--help"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "invalid choice" in proc.stderr


def _benchmarks(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT
    )


def test_benchmarks_list_every_tool_and_refuse_an_unknown_one():
    proc = _benchmarks("--help")
    assert proc.returncode == 0
    for name in BENCHMARKS:
        assert re.search(rf"^\s+{name}\s+\S", proc.stdout, re.M), proc.stdout
    for args in ((), ("nope",)):
        proc = _benchmarks(*args)
        assert proc.returncode == 2 and f"valid: {', '.join(BENCHMARKS)}" in proc.stderr


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_answers_help(name):
    proc = _benchmarks(name, "--help")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"usage: python -m benchmarks {name}" in proc.stdout
