"""Argument parsers of ``mrl bench comm`` and ``mrl bench weights`` without importing the benchmarks.

Those benchmark modules import torch at module level, so ``mrl bench comm --help`` answers from here (torch
is imported only by a benchmark that runs). The modules' own ``cli()`` can build their parsers with these
functions; until they do, tests/test_cli_help.py checks that both list the same options.
"""

from __future__ import annotations

import argparse

LINK_HELP = (
    "instead: between two network namespaces over a veth link shaped to RATE with tc (e.g. 1gbit; needs root); "
    "see mrl_plugins.bench.link"
)


def comm_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mrl bench comm",
        description="mrl bench comm: experience batches between two processes through three paths.",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per case (median reported)")
    ap.add_argument("--quick", action="store_true", help="fewer batches and at most 2 reps (smoke run)")
    ap.add_argument("--link", metavar="RATE", help=LINK_HELP)
    return ap


def weights_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="mrl bench weights",
        description="mrl bench weights: weight-sync bandwidth against the per-parameter baseline and memcpy.",
    )
    ap.add_argument("--json", metavar="PATH", help="write the results as JSON")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per case (default 5)")
    ap.add_argument("--quick", action="store_true", help="smaller shape list instead of the 0.5B one")
    ap.add_argument("--link", metavar="RATE", help=LINK_HELP)
    return ap


PARSERS = {"comm": comm_parser, "weights": weights_parser}
