"""``asyncconn bench engine``: figures from vLLM's real engine (TTFT on a shared prefix, decode, EC, and
the stall a load puts on running requests).

See :mod:`asyncconn_tools.bench.engine_runs` for what each measures;
docs/benchmarks.md holds the current table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from asyncconn.cli import argtypes

__all__ = ["add_arguments", "run"]

_WHAT = ("ttft", "decode", "ec", "stall", "hybrid", "tiers", "tier-decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--what", default="ttft,decode,ec", help=f"comma-separated, of {', '.join(_WHAT)}")
    parser.add_argument(
        "--tokens",
        type=argtypes.count,
        default=4096,
        help="ttft, stall, hybrid, tiers: stored prompt length (default 4096)",
    )
    parser.add_argument(
        "--prompts",
        type=argtypes.count,
        default=3,
        help="ttft, stall, tiers: prompts timed per config and engine",
    )
    parser.add_argument(
        "--decoders", type=argtypes.count, default=4, help="stall: requests decoding while a prompt loads"
    )
    parser.add_argument(
        "--rounds",
        type=argtypes.count,
        default=3,
        help="decode, ec, ttft, stall: alternating rounds (ttft: a fresh engine per config and round, its "
        "prompts timed twice, the second time after reset_prefix_cache)",
    )
    parser.add_argument(
        "--decode-model", default="text", choices=("text", "text-100m"), help="decode: model (default text)"
    )
    parser.add_argument(
        "--decode-batches", type=argtypes.count, default=5, help="decode: timed batches per engine (median)"
    )
    parser.add_argument(
        "--host-cache-bytes",
        type=argtypes.positive_size,
        default=512 << 20,
        help="tiers, tier-decode: the host tier's bound (default 512MiB)",
    )
    parser.add_argument("--json", action="store_true", help="print the summaries as JSON")


def run(args: argparse.Namespace) -> int:
    from asyncconn_tools.bench import engine_runs
    from asyncconn_tools.demo.report import print_summary
    from asyncconn_tools.engines import engine_env

    # vLLM logs to stdout by default; --json output must be the only thing there.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    engine_env()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    what = [w.strip() for w in str(args.what).split(",") if w.strip()]
    unknown = [w for w in what if w not in _WHAT]
    if unknown:
        raise SystemExit(f"asyncconn bench engine: unknown --what {unknown[0]!r} (known: {', '.join(_WHAT)})")
    summaries: list[dict[str, Any]] = []
    for item in what:
        if item == "ttft":
            summaries.append(
                engine_runs.ttft_bench(tokens=args.tokens, prompts=args.prompts, rounds=args.rounds)
            )
        elif item == "decode":
            summaries.append(
                engine_runs.decode_bench(
                    model_name=args.decode_model, rounds=args.rounds, batches=args.decode_batches
                )
            )
        elif item == "stall":
            summaries.append(
                engine_runs.stall_bench(
                    tokens=args.tokens, prompts=args.prompts, decoders=args.decoders, rounds=args.rounds
                )
            )
        elif item == "hybrid":
            from asyncconn_tools.bench.engine_hybrid import hybrid_bench

            summaries.append(hybrid_bench(tokens=args.tokens, rounds=args.rounds))
        elif item == "tiers":
            from asyncconn_tools.bench.engine_tiers import tiers_bench

            summaries.append(
                tiers_bench(
                    tokens=args.tokens,
                    prompts=args.prompts,
                    rounds=args.rounds,
                    host_cache_bytes=args.host_cache_bytes,
                )
            )
        elif item == "tier-decode":
            from asyncconn_tools.bench.engine_tiers import tier_decode_bench

            summaries.append(tier_decode_bench(rounds=args.rounds, host_cache_bytes=args.host_cache_bytes))
        else:
            summaries.append(engine_runs.ec_bench(rounds=args.rounds))
    if args.json:
        print(json.dumps(summaries, indent=2))
    else:
        for summary in summaries:
            print_summary(summary)
    return 0
