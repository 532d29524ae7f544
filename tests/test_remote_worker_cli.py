"""`mrl worker`'s own checks, as a user meets them (real processes and sockets, no trainer needed): a bad option is
one `mrl worker: error: ...` line naming the problem and the valid choices, exit code 2, before the worker connects
(a listening socket stands in for the trainer and must see no connection); an unreachable trainer is one line naming
the address and the timeout. The checks against a live trainer are in tests/test_rollout_remote.py."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

CORES = sorted(os.sched_getaffinity(0))


def _worker(*args: str, timeout: float = 90) -> tuple[subprocess.CompletedProcess, float]:
    """``mrl worker ARGS`` as a user runs it: its result and how long it took."""
    cmd = [sys.executable, "-m", "mrl_plugins.cli.main", "worker", *args]
    t0 = time.monotonic()
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    return out, time.monotonic() - t0


def _error_line(out: subprocess.CompletedProcess) -> str:
    """The worker's error: its last stderr line, with no traceback or C++ frames before it."""
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "frame #" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("mrl worker: error: "), out.stderr[-3000:]
    return last


@pytest.fixture
def trainer_port():
    """A listening socket where the trainer would be: the test asserts nothing connected to it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.setblocking(False)
        yield s.getsockname()[1]
        try:
            conn, _ = s.accept()
        except BlockingIOError:  # nothing connected: the worker refused before connecting
            return
        conn.close()
        pytest.fail("the worker connected to the trainer's address before refusing its options")


BAD_OPTIONS = [
    (
        ["--cores", f"{CORES[0]},{max(CORES) + 1000}"],
        rf"--cores: must be distinct cores among {re.escape(str(CORES))}",
    ),
    (["--cores", "a"], r"--cores: must be distinct cores among .* \(os\.sched_getaffinity\), got 'a'"),
    (["--cores", f"{CORES[0]},{CORES[0]}"], r"--cores: must be distinct cores"),
    (["--timeout", "0"], r"--timeout: must be seconds > 0, got '0'"),
    (["--timeout", "nan"], r"--timeout: must be seconds > 0, got 'nan'"),
    (["--timeout", "inf"], r"--timeout: must be seconds > 0, got 'inf'"),
    (["--index", "-1"], r"--index: must be an integer >= 0, got '-1'"),
    (["--index", "x"], r"--index: must be an integer >= 0, got 'x'"),
    (["--threads", "0"], r"--threads: must be an integer >= 1, got '0'"),
    (
        ["--threads", str(len(CORES) + 1)],
        rf"--threads: {len(CORES) + 1} exceeds the {len(CORES)} core\(s\) it runs on",
    ),
    (["--threads", "2", "--cores", str(CORES[0])], r"--threads: 2 exceeds the 1 core\(s\) it runs on"),
    (["--device", "gpu"], r"--device: must be auto, cpu, cuda\[:N\] or npu\[:N\], got 'gpu'"),
    (["--device", "cuda:99"], r"device 'cuda:99' is not present .*; available: 'auto'"),
]


@pytest.mark.parametrize(("options", "expected"), BAD_OPTIONS, ids=[" ".join(o) for o, _ in BAD_OPTIONS])
def test_a_bad_option_is_one_error_naming_the_choices_before_connecting(trainer_port, options, expected):
    argv = ["--connect", f"127.0.0.1:{trainer_port}", *(["--timeout", "300"] if "--timeout" not in options else [])]
    out, took = _worker(*argv, *(["--index", "0"] if "--index" not in options else []), *options)
    assert re.search(expected, _error_line(out)), out.stderr
    assert took < 60  # it did not wait for the trainer (--timeout 300)


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("nohost", r"--connect: must be the trainer's HOST:PORT \(its rollout.rendezvous, port > 0\), got 'nohost'"),
        ("127.0.0.1:0", r"--connect: must be the trainer's HOST:PORT .*got '127.0.0.1:0'"),
        ("127.0.0.1:99999", r"--connect: must be the trainer's HOST:PORT"),
        ("no-such-host.invalid:29555", r"trainer address no-such-host.invalid:29555: 'no-such-host.invalid' does not"),
    ],
)
def test_a_bad_address_is_one_error(address, expected):
    out, took = _worker("--connect", address, "--index", "0", "--timeout", "300")
    assert re.search(expected, _error_line(out)), out.stderr
    assert took < 60


def test_no_trainer_listening_is_one_line_naming_the_address_and_the_timeout():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out, took = _worker("--connect", f"127.0.0.1:{port}", "--index", "0", "--timeout", "2")
    assert _error_line(out) == (
        f"mrl worker: error: no trainer answering at 127.0.0.1:{port} within 2 s (Connection refused); start the "
        f"trainer (is its rollout.rendezvous 127.0.0.1:{port}?) or wait longer (mrl worker --timeout)"
    )
    assert len(out.stderr.strip().splitlines()) == 1 and 2 <= took < 60  # it waited its timeout, no longer
