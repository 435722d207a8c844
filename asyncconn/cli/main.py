"""Argument parsing and dispatch for the ``asyncconn`` command.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``; they are
listed here by module path so that ``asyncconn --help`` stays fast and one subcommand's dependencies never
load for another. Exit codes: 0 ok, 1 a check failed, 2 bad usage or an unreachable/unknown store.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

__all__ = ["build_parser", "main"]

# name -> (module, help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "chaos": ("asyncconn.cli.chaos", "both connectors under injected faults, with invariant and leak checks"),
    "check": ("asyncconn.cli.check", "round-trip a tensor through a store and report latencies"),
    "demo": ("asyncconn.cli.demo", "run the end-to-end demo on an embedded store"),
    "lookup-server": ("asyncconn.cli.lookup_server", "serve Mooncake-framed lookups from a store over ZMQ"),
}
_BENCHES: dict[str, tuple[str, str]] = {
    "backend": ("asyncconn.tools.bench.backend", "put/get/exists throughput and latency of a store"),
    "lookup": ("asyncconn.tools.bench.lookup", "lookup client cost on the caller's thread and throughput"),
    "transfer": ("asyncconn.tools.bench.transfer", "stream loader and save tracker figures"),
    "align": ("asyncconn.tools.bench.align", "direct reads by payload alignment: why frames pad to 64 bytes"),
    "engine": (
        "asyncconn.tools.bench.engine",
        "vLLM's real engine: TTFT on a shared prefix vs recompute, decode with/without, EC per request",
    ),
    "gpu": ("asyncconn.tools.bench.gpu", "KV load/save and EC install through the worker sides, on CUDA"),
    "kv": (
        "asyncconn.tools.bench.kv",
        "KV connector: schedule() with lookups, wait_for_save, blocks per value",
    ),
    "ec-sim": (
        "asyncconn.tools.bench.ec_sim",
        "EC connector: ensure_cache_available / has_cache_item and PD step costs (offline engine)",
    ),
    "redis": ("asyncconn.tools.bench.redis", "redis:// side by side with redis-benchmark; eviction hit rate"),
    "mooncake": ("asyncconn.tools.bench.mooncake", "mooncake:// side by side with the raw Mooncake client"),
    "serve": (
        "asyncconn.tools.bench.serve",
        "two OpenAI servers sharing a store (one saves, a fresh one loads): TTFT/ITL by vLLM's client",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="asyncconn", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (path, help_text) in _COMMANDS.items():
        module = importlib.import_module(path)
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    bench = sub.add_parser("bench", help="benchmarks (figures go in docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="WHAT")
    for name, (path, help_text) in _BENCHES.items():
        module = importlib.import_module(path)
        p = bench_sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, argparse printed which flag and why)
        return exc.code if isinstance(exc.code, int) else 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args._run(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
