"""Every ``mrl`` subcommand's ``--help``: exit 0, readable text, and no torch/transformers import before parsing.

Each command runs for real in a fresh interpreter (``python -X importtime -m mrl_plugins.cli.main ... --help``);
``-X importtime`` lists every module the process imported, so a heavy import shows up whatever the machine load.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "vllm", "torch_npu", "deepspeed", "ray")
COMMANDS = [
    [],
    ["plugins"],
    ["run"],
    ["compare"],
    ["doctor"],
    ["plan"],
    ["worker"],
    ["bench"],
    ["bench", "comm"],
    ["bench", "weights"],
    ["bench", "rollout"],
    ["bench", "ray"],
    ["trl"],
]


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
    proc, imported = _help(["bench", "comm"], "-h")
    assert proc.returncode == 0 and "--reps" in proc.stdout and "torch" not in imported


def test_bench_help_lists_every_benchmark():
    proc, _ = _help(["bench"])
    for name in ("comm", "weights", "rollout", "ray"):
        assert re.search(rf"^\s+{name}\s+\S", proc.stdout, re.M), proc.stdout


def test_bench_without_a_name_is_a_usage_error():
    for args in (["bench"], ["bench", "nope"]):
        proc = subprocess.run(
            [sys.executable, "-m", "mrl_plugins.cli.main", *args], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2 and "valid: comm, engine, ray, rollout, weights" in proc.stderr


def _options(help_text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_text))


@pytest.mark.parametrize("name,module", [("comm", "mrl_plugins.bench.comm"), ("weights", "mrl_plugins.bench.weights")])
def test_fast_bench_help_matches_the_benchmarks_own_parser(name, module):
    """``mrl bench comm --help`` answers from mrl_plugins.cli.bench_args; the module's own parser must agree."""
    fast, _ = _help(["bench", name])
    own = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert own.returncode == 0, own.stderr[-2000:]
    assert _options(fast.stdout) == _options(own.stdout) and "--reps" in _options(own.stdout)
