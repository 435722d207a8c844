"""``asyncconn demo``: the library end to end in vLLM's real engine, on an embedded store.

Runs each demo *part* -- a function returning ``{"title", "figures", "checks"}`` -- and prints the
summaries; exits 1 if any check failed. Parts are listed in :data:`PARTS` by import path. The default
parts, ``ec``, ``kv`` and ``hybrid``, run vLLM's real engine (docs/engine.md); ``ec-sim`` and ``kv-sim``
run vLLM's real scheduler with a simulated model runner (docs/simulator.md), in a second.
(The EC connector's scheduler-side costs are ``asyncconn bench ec-sim``.)

Exit codes: 0 every check passed, 1 a check failed, 2 bad usage (an unknown part, a bad store URL).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes
from asyncconn.exceptions import AsyncConnError
from asyncconn.url import redact
from asyncconn_tools.demo.report import print_summary

__all__ = ["DEFAULT_PARTS", "PARTS", "add_arguments", "run"]

#: name -> "module:function"; each function is called as fn(backend_url, workdir) -> summary dict.
PARTS: dict[str, str] = {
    "ec": "asyncconn_tools.demo.engine:ec_part",
    "kv": "asyncconn_tools.demo.engine:kv_part",
    "hybrid": "asyncconn_tools.demo.hybrid:hybrid_part",
    "ec-sim": "asyncconn_tools.demo.ec_sim:run_ec_demo",
    "kv-sim": "asyncconn_tools.demo.kv_sim:demo_part",
}
#: What runs without ``--parts``: the real engine.
DEFAULT_PARTS = ("ec", "kv", "hybrid")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        metavar="URL",
        default=None,
        help="store URL (default: file:// in a fresh temporary directory)",
    )
    parser.add_argument(
        "--parts",
        type=argtypes.choice_list(tuple(PARTS)),
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated parts to run, of {', '.join(PARTS)} (default: {','.join(DEFAULT_PARTS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")


def _resolve(spec: str) -> Callable[..., dict[str, Any]]:
    module, _, name = spec.partition(":")
    fn: Callable[..., dict[str, Any]] = getattr(importlib.import_module(module), name)
    return fn


def run(args: argparse.Namespace) -> int:
    from asyncconn_tools.demo.keeper import kept_store
    from asyncconn_tools.engines import engine_env

    engine_env()
    # vLLM's start-up warnings about the CPU platform (no Triton, block size) say nothing about the demo.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if not getattr(args, "verbose", 0):
        logging.getLogger("vllm").setLevel(logging.ERROR)
    names = [p.strip() for p in str(args.parts).split(",") if p.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        print(f"asyncconn demo: unknown part {unknown[0]!r} (known: {', '.join(PARTS)})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="asyncconn-demo-") as tmp:
        workdir = Path(tmp)
        url = args.backend or f"file://{workdir / 'store'}"
        if url.rstrip("/") == "memory:":
            # An unnamed memory:// store is private to each engine: E's saves would be invisible to PD.
            print(
                "asyncconn demo: E and PD need a shared store: name it, e.g. memory://demo", file=sys.stderr
            )
            return 2
        try:
            with kept_store(url) as engines_url:
                summaries = [_resolve(PARTS[name])(engines_url, workdir) for name in names]
        except AsyncConnError as exc:
            print(f"asyncconn demo: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(summaries, indent=2))
    else:
        print(f"store: {redact(args.backend) if args.backend else 'file:// (temporary directory)'}")
        for summary in summaries:
            print_summary(summary)
    failed = [name for s in summaries for name, ok in s.get("checks", {}).items() if not ok]
    if failed:
        print(f"asyncconn demo: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0
