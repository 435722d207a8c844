"""``asyncconn bench serve``: time to first token and inter-token latency of real OpenAI servers, measured
by vLLM's own benchmark client, with and without the KV connector.

The shape is the one an operator runs: two ``python -m vllm.entrypoints.openai.api_server`` processes on
the same ~100M model with ``examples/vllm_kv_offload.json`` (only the store URL changed) sharing one store.
Server 1 computes the prompts and saves their KV; server 2, started fresh afterwards, gets the same prompts
and loads what server 1 saved. The reference is a fresh server without a connector, which computes
everything. The client is ``vllm.benchmarks.serve`` (``add_cli_args`` + ``main``: the ``vllm bench serve``
console script of vLLM's CPU build does not start) on its ``prefix_repetition`` dataset, with the model's
own local tokenizer (:mod:`asyncconn_tools.tiny_models` saves a word-level one beside the weights), so the
same seed gives every server the same prompts. ``--stores lmcache`` adds the same shape with LMCache's
``LMCacheMPConnector`` and ``lmcache server`` (its multi-process mode), run from a separate environment
(``--lmcache-venv``: vLLM's CPU build plus LMCache), since LMCache pins its own dependencies: there server
2 loads from the ``lmcache server``'s own RAM. ``--stores lmcache-redis`` is LMCache's Redis path, the one
to set beside ``redis``: a redis-server like ``redis``'s own behind LMCache's RESP L2 adapter, and a fresh
``lmcache server`` (empty L1) for server 2 once the first one's stores to Redis have drained
(:mod:`asyncconn_tools.bench.serve_stores` holds each store's strategy).

Why servers start in parallel and are measured one at a time: a start costs 30-100 s of CPU on a small
box and measures nothing, while a measurement must have the cores to itself (an idle server beside it only
waits on its sockets). Store contents are proven, not assumed: each server's external prefix-cache hits
and prompt tokens are read from its ``/metrics`` after its run, and a Redis-backed store's ``INFO`` (bytes
sent and received, keyspace hits, calls per command) and LMCache's own counters are read around each
measured run (``store_during_run``; ``store_at_start``: keys held, LMCache's L1 objects).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes
from asyncconn_tools.bench.serve_stores import LMCACHE_STORES, STORES, ServeStore, counter_deltas, make_store

__all__ = ["add_arguments", "run"]

_DEFAULT_STORES = "none,file,redis"
#: The figures read from vLLM's client result, in the order they are reported.
_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
#: Store-side state reported as it was when a measured run started (the rest is reported as its change).
_STATE = ("redis.keys", "redis.used_memory", "lmcache.l1_objects")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stores",
        type=argtypes.choice_list(STORES),
        default=_DEFAULT_STORES,
        help=f"comma-separated, of {', '.join(STORES)} (default: {_DEFAULT_STORES}). none: no connector; "
        "file, redis: asyncconn's connector (redis: a redis-server of its own on a free port); lmcache: "
        "LMCache's LMCacheMPConnector with one `lmcache server`, so server 2 loads from that process's RAM "
        "(its L1); lmcache-redis: LMCache over a redis-server of its own (its RESP L2 adapter), with a "
        "fresh `lmcache server` (empty L1) for server 2, so its hits come from Redis. The lmcache stores "
        "need --lmcache-venv",
    )
    parser.add_argument(
        "--lmcache-venv",
        type=Path,
        default=None,
        help="a virtual environment holding vLLM's CPU build and LMCache (never this one: LMCache pins its "
        "own dependencies); its `lmcache server` (multi-process mode) is the store of LMCacheMPConnector",
    )
    parser.add_argument("--model", default="text-100m", choices=("text", "text-100m"), help="tiny model")
    parser.add_argument(
        "--prefix-len", type=argtypes.count, default=1024, help="tokens of each shared prefix"
    )
    parser.add_argument("--suffix-len", type=argtypes.count, default=64, help="tokens after the prefix")
    parser.add_argument("--prefixes", type=argtypes.count, default=4, help="distinct prefixes")
    parser.add_argument("--prompts", type=argtypes.count, default=16, help="requests per server")
    parser.add_argument("--output-len", type=argtypes.count, default=32, help="tokens generated per request")
    parser.add_argument("--concurrency", type=argtypes.count, default=2, help="requests in flight at once")
    parser.add_argument(
        "--kv-cache-bytes", type=argtypes.positive_size, default=512 << 20, help="each server's KV cache"
    )
    parser.add_argument(
        "--reserved-cpus",
        type=argtypes.non_negative_count,
        default=1,
        help="VLLM_CPU_NUM_OF_RESERVED_CPU of every server (default 1). Why set: vLLM's CPU build keeps one "
        "core per worker away from its OpenMP threads, and one more when a KV connector is configured, so "
        "on a small box the servers compared would otherwise compute on different numbers of cores",
    )
    parser.add_argument(
        "--logs", type=Path, default=None, help="keep the servers' logs in this folder (default: a temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def _client_args(args: argparse.Namespace, model: Path, base_url: str) -> list[str]:
    return [
        "--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions",
        "--model", str(model), "--tokenizer", str(model),
        "--dataset-name", "prefix_repetition",
        "--prefix-repetition-prefix-len", str(args.prefix_len),
        "--prefix-repetition-suffix-len", str(args.suffix_len),
        "--prefix-repetition-num-prefixes", str(args.prefixes),
        "--prefix-repetition-output-len", str(args.output_len),
        "--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency),
        "--request-rate", "inf", "--ignore-eos", "--temperature", "0", "--seed", "0",
        "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--save-detailed",  # keeps every request's TTFT in the result (written nowhere without --save-result)
    ]  # fmt: skip


def _drive(args: argparse.Namespace, model: Path, base_url: str) -> dict[str, Any]:
    """One run of vLLM's benchmark client against ``base_url``; its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    client_args = parser.parse_args(_client_args(args, model, base_url))
    # The client prints its report on stdout; the summary (and --json) must be the only thing there.
    with contextlib.redirect_stdout(sys.stderr):
        result: dict[str, Any] = main(client_args)
    return result


def _warm_up(base_url: str, model: Path, seed: int) -> None:
    """One short request on tokens of its own (``seed``: one per server, so no server loads another's):
    a fresh server's first forward pays one-off costs that would otherwise land on one measured request."""
    rng = random.Random(seed)
    prompt = [rng.randrange(5, 1000) for _ in range(40)]
    body = {"model": str(model), "prompt": [prompt], "max_tokens": 2, "temperature": 0}
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as reply:
        reply.read()


def _row(label: str, result: Mapping[str, Any], metrics: Mapping[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {"server": label}
    for name in _FIGURES:
        row[name] = round(float(result.get(name, float("nan"))), 2)
    row["mean_ttft_ms"] = round(float(result.get("mean_ttft_ms", float("nan"))), 2)
    # Every request's TTFT, lowest first: two servers' medians and tails can move apart when one serves
    # requests evenly and the other in turn (the median alone does not tell the two apart).
    row["ttfts_ms"] = sorted(round(float(t) * 1000, 1) for t in result.get("ttfts", []) if t)
    row["completed"] = result.get("completed")
    row["failed"] = result.get("failed")
    row["prompt_tokens"] = int(metrics.get("vllm:prompt_tokens_total", 0))
    row["local_hit_tokens"] = int(metrics.get("vllm:prefix_cache_hits_total", 0))
    row["external_hit_tokens"] = int(metrics.get("vllm:external_prefix_cache_hits_total", 0))
    row["kv_tokens_saved"] = int(metrics.get("asyncconn:kv_tokens_saved_total", 0))
    row["kv_tokens_loaded"] = int(metrics.get("asyncconn:kv_tokens_loaded_total", 0))
    return row


@contextlib.contextmanager
def _servers(servers: Sequence[Any]) -> Iterator[None]:
    """Start ``servers`` together (their start-ups overlap), stop them all however the block ends."""
    from asyncconn_tools.openai_server import OpenAIServer, stop_all

    started: list[OpenAIServer] = []
    try:
        for server in servers:
            started.append(server.start(wait=False))
        for server in started:
            server.wait_ready()
        yield
    finally:
        stop_all(started, timeout=30)


def _stores_of(args: argparse.Namespace) -> list[str]:
    """The ``--stores`` names in the order they run; SystemExit when LMCache's are asked without its venv."""
    given = str(args.stores).split(",")
    stores = [s for s in STORES if s in given]
    needing = [s for s in stores if s in LMCACHE_STORES]
    if needing and args.lmcache_venv is None:
        raise SystemExit(f"asyncconn bench serve: --stores {','.join(needing)} needs --lmcache-venv")
    return stores


def _checks(rows: Mapping[str, Mapping[str, Any]]) -> dict[str, bool]:
    """What a run must show to be reported as valid."""
    second = [row for row in rows.values() if row["phase"] == 2]
    from_redis = [row for row in second if "redis.keys" in row["store_at_start"]]
    return {
        "every request completed": all(row["failed"] == 0 for row in rows.values()),
        "every server 2 loaded from its store": all(row["external_hit_tokens"] > 0 for row in second),
        # A Redis-backed server 2 reads what it hits from Redis: bytes out of it during its run.
        "every server 2 on redis read from redis": all(
            row["store_during_run"].get("redis.total_net_output_bytes", 0) > 0 for row in from_redis
        ),
        # LMCache's server 2 runs beside a fresh lmcache server whose L1 held nothing before the run.
        "LMCache's redis server 2 started with an empty L1": all(
            row["store_at_start"].get("lmcache.l1_objects", 0) == 0
            for row in second
            if row["store"] == "lmcache-redis"
        ),
    }


def run(args: argparse.Namespace) -> int:
    from asyncconn_tools.demo.report import print_summary
    from asyncconn_tools.openai_server import OpenAIServer
    from asyncconn_tools.tiny_models import build_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    names = _stores_of(args)
    model = build_model(args.model, progress=lambda msg: print(msg, file=sys.stderr))
    work = Path(tempfile.mkdtemp(prefix="asyncconn-bench-serve-"))
    logs: Path = args.logs or work
    logs.mkdir(parents=True, exist_ok=True)
    tag = f"serve-{os.getpid()}-"
    stores: list[ServeStore] = []

    def server(store: ServeStore, phase: int) -> OpenAIServer:
        return OpenAIServer(
            python=store.python,
            model=model,
            log_path=logs / f"{store.name}-{phase}.log",
            kv_transfer_config=store.kv_config(phase),
            max_model_len=max(2048, args.prefix_len + args.suffix_len + args.output_len + 64),
            kv_cache_bytes=args.kv_cache_bytes,
            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)},
        )

    rows: dict[str, dict[str, Any]] = {}
    started = time.monotonic()

    def measure(label: str, store: ServeStore, phase: int, srv: OpenAIServer) -> None:
        _warm_up(srv.base_url, model, srv.port)
        before = store.counters()
        result = _drive(args, model, srv.base_url)
        after = store.counters()
        rows[label] = _row(label, result, srv.metrics())
        rows[label].update(
            store=store.name,
            phase=phase,
            store_at_start={k: v for k, v in before.items() if k in _STATE},
            store_during_run=counter_deltas(before, after),
        )

    try:
        for name in names:
            stores.append(
                make_store(name, work=work, logs=logs, key_prefix=tag, lmcache_venv=args.lmcache_venv)
            )
        # Phase 1: every server 1 (and the connector-less reference) starts; each is measured alone.
        first = [(store, server(store, 1)) for store in stores]
        with _servers([srv for _, srv in first]):
            for store, srv in first:
                suffix = "" if store.name == "none" else " server 1 (computes, saves)"
                measure(store.label + suffix, store, 1, srv)
            for store in stores:
                store.after_saves()
            # Phase 2: a fresh server 2 per store, started once server 1 has finished (its saves with it).
            second = [(store, server(store, 2)) for store in stores if store.name != "none"]
            with _servers([srv for _, srv in second]):
                for store, srv in second:
                    measure(f"{store.label} server 2 (fresh, loads)", store, 2, srv)
    finally:
        for store in stores:
            store.stop()
        if args.logs is None:
            shutil.rmtree(work, ignore_errors=True)
    summary: dict[str, Any] = {
        "title": "serving: vLLM's OpenAI server driven by vLLM's benchmark client (prefix_repetition)",
        "setup": {
            "model": args.model,
            "prefix_len": args.prefix_len,
            "suffix_len": args.suffix_len,
            "prefixes": args.prefixes,
            "prompts": args.prompts,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "reserved_cpus": args.reserved_cpus,
            "cpus": os.cpu_count(),
            "wall_s": round(time.monotonic() - started, 1),
            "loadavg": os.getloadavg()[0],
        },
        "rows": list(rows.values()),
        "figures": {
            label: " / ".join(f"{row[name]:.1f}" for name in _FIGURES)
            + f" ms (ttft p50/p99, itl p50/p99); external hits {row['external_hit_tokens']}"
            f" of {row['prompt_tokens']} prompt tokens" + _store_figure(row)
            for label, row in rows.items()
        },
        "checks": _checks(rows),
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if all(summary["checks"].values()) else 1


def _store_figure(row: Mapping[str, Any]) -> str:
    """What a Redis-backed store sent and received over the measured run, in the figures' line."""
    if "redis.keys" not in row["store_at_start"]:
        return ""
    during = row["store_during_run"]
    out = during.get("redis.total_net_output_bytes", 0) / (1 << 20)
    into = during.get("redis.total_net_input_bytes", 0) / (1 << 20)
    return f"; redis sent {out:.1f} MiB, received {into:.1f} MiB"
