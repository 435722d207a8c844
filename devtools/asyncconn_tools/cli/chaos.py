"""``asyncconn chaos``: both connectors on vLLM's real scheduler while the stack is broken on purpose.

Starts its own ``redis-server`` and ``asyncconn lookup-server`` on free loopback ports, runs an E and two
PD engines (:mod:`asyncconn_tools.chaos`) for ``--duration`` seconds or ``--requests`` requests, injects
faults, checks the invariants, drains, checks for leaks, and prints the figures.

Exit codes: 0 every invariant held and nothing leaked, 1 a violation or a leak (listed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from asyncconn.cli import argtypes
from asyncconn_tools.chaos.faults import DATA_FAULTS, SERVER_FAULTS

__all__ = ["add_arguments", "run"]

_KINDS = SERVER_FAULTS + DATA_FAULTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--duration", type=argtypes.positive_duration, default=60.0, help="seconds of traffic (default 60)"
    )
    parser.add_argument("--requests", type=argtypes.count, default=5000, help="stop after this many requests")
    parser.add_argument(
        "--seed", type=argtypes.non_negative_count, default=0, help="workload and fault schedule seed"
    )
    parser.add_argument(
        "--fault-interval",
        type=argtypes.positive_duration,
        default=2.0,
        help="mean seconds between faults (default 2)",
    )
    parser.add_argument(
        "--faults",
        type=argtypes.choice_list(_KINDS, allow_empty=True),
        default=",".join(_KINDS),
        help=f"comma-separated fault kinds (default: all of {','.join(_KINDS)}; empty: none)",
    )
    parser.add_argument(
        "--concurrency", type=argtypes.count, default=12, help="requests alive at once (default 12)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    kinds = tuple(k for k in args.faults.split(",") if k)
    unknown = sorted(set(kinds) - set(_KINDS))
    if unknown or args.duration <= 0 or args.requests < 1 or args.concurrency < 1 or args.fault_interval <= 0:
        what = f"unknown fault kinds {unknown}" if unknown else "durations and counts must be > 0"
        print(f"asyncconn chaos: {what}")
        return 2
    from asyncconn_tools.chaos import ChaosConfig, run_chaos

    config = ChaosConfig(
        duration=args.duration,
        max_requests=args.requests,
        seed=args.seed,
        fault_interval=args.fault_interval,
        faults=kinds,
        concurrency=args.concurrency,
    )
    # Faults make the connectors log every failed store call; a chaos run reports them as figures instead.
    # The levels are put back afterwards: the command may run inside a longer-lived process (the tests).
    quiet = [] if args.verbose else [logging.getLogger(n) for n in ("asyncconn", "backends", "vllm")]
    levels = [logger.level for logger in quiet]
    for logger in quiet:
        logger.setLevel(logging.ERROR)
    try:
        report = run_chaos(config)
    finally:
        for logger, level in zip(quiet, levels, strict=True):
            logger.setLevel(level)
    data = report.as_dict()
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        _print(data)
    return 0 if report.ok else 1


def _print(data: dict[str, Any]) -> None:
    print("asyncconn chaos: E + PD engines (vLLM's real scheduler), redis-server + lookup-server, faults")
    for key in sorted(data):
        if key in ("violations", "leaks"):
            continue
        print(f"  {key:<24} {data[key]}")
    for key in ("violations", "leaks"):
        items = data[key]
        print(f"  {key:<24} {len(items)}")
        for item in items[:20]:
            print(f"    - {item}")
    print("PASS" if data["ok"] else "FAIL")
