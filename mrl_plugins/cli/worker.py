"""``mrl worker``: a rollout worker for a trainer on another host (:mod:`mrl_plugins.rollout.remote`,
``docs/multi-host.md``).

Every option is checked before the worker connects: a bad one is argparse's usage and one error naming the valid
choices, exit code 2, as is a device absent here or a trainer that never answers. A failure of the worker loop once
it joined (the trainer got the same report) is said here too, exit code 3.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import NoReturn

from mrl_plugins.cli.checks import checked_type
from mrl_plugins.errors import MrlError


def parser() -> argparse.ArgumentParser:
    from mrl_plugins.device.select import canonical_device_spec
    from mrl_plugins.rollout.config import parse_address

    cores = sorted(os.sched_getaffinity(0))
    p = argparse.ArgumentParser(prog="mrl worker", description="run a rollout worker for a trainer on another host")
    p.add_argument(
        "--connect", required=True, metavar="HOST:PORT",
        type=checked_type(lambda t: parse_address(t, "--connect")[1] and t, bool,
                          "the trainer's HOST:PORT (its rollout.rendezvous, port > 0)"),
        help="the trainer's rollout.rendezvous address HOST:PORT",
    )  # fmt: skip
    p.add_argument(
        "--index", required=True, type=checked_type(int, lambda v: v >= 0, "an integer >= 0"),
        help="this worker's index (the trainer's log names the command for each)",
    )  # fmt: skip
    p.add_argument(
        "--device", type=checked_type(lambda t: canonical_device_spec(t, "--device"), bool,
                                      "auto, cpu, cuda[:N] or npu[:N]"),
        help="torch device here: auto, cpu, cuda[:N], npu[:N] (default: the trainer's)",
    )  # fmt: skip
    p.add_argument(
        "--cores", metavar="0,1",
        type=checked_type(lambda t: [int(c) for c in t.split(",")], lambda v: len(set(v)) == len(v)
                          and set(v) <= set(cores), f"distinct cores among {cores} (os.sched_getaffinity)"),
        help="CPU cores to bind (default: no binding)",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=checked_type(int, lambda v: v >= 1, "an integer >= 1"),
        help="torch threads, at most the cores it runs on (default: rollout.engine_threads)",
    )  # fmt: skip
    p.add_argument(
        "--timeout", default=600.0, type=checked_type(float, lambda v: math.isfinite(v) and v > 0, "seconds > 0"),
        help="seconds to wait for the trainer to answer and to publish this worker's spec (default 600)",
    )  # fmt: skip
    return p


def cli(argv: list[str]) -> NoReturn:
    p = parser()
    ns = p.parse_args(argv)
    n = len(ns.cores or os.sched_getaffinity(0))
    if ns.threads is not None and ns.threads > n:
        p.error(f"argument --threads: {ns.threads} exceeds the {n} core(s) it runs on")
    rc = 1
    try:
        from mrl_plugins.device import get_device
        from mrl_plugins.rollout.remote import WorkerFailed, serve

        if ns.device is not None:
            get_device(ns.device)  # present here (DeviceError naming what is), before connecting
        try:
            serve(ns.connect, ns.index, device=ns.device, cores=ns.cores, threads=ns.threads, timeout=ns.timeout)
            rc = 0
        except WorkerFailed as exc:  # the trainer has the same report
            if exc.details:
                print(exc.details, file=sys.stderr)
            print(f"mrl worker: error: {exc}", file=sys.stderr)
            rc = 3
    except MrlError as exc:
        print(f"mrl worker: error: {exc}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt:
        rc = 130
    except BaseException:  # noqa: BLE001 - anything else (a bug): its traceback, then the same exit
        import traceback

        traceback.print_exc()
    finally:
        # Leave as a multiprocessing worker does (os._exit, after everything above was flushed and closed), on
        # every path: a normal interpreter exit runs C++ static destructors while gloo's and the TCPStore
        # client's threads still run, which aborts now and then ("terminate called without an active
        # exception", seen in CI).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
