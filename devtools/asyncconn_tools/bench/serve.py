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
(``--lmcache-venv``: vLLM's CPU build plus LMCache), since LMCache pins its own dependencies.

Why servers start in parallel and are measured one at a time: a start costs 30-100 s of CPU on a small
box and measures nothing, while a measurement must have the cores to itself (an idle server beside it only
waits on its sockets). Store contents are proven, not assumed: each server's external prefix-cache hits
and prompt tokens are read from its ``/metrics`` after its run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes

__all__ = ["add_arguments", "run"]

_STORES = ("none", "file", "redis", "lmcache")
_DEFAULT_STORES = "none,file,redis"
_LABELS = {"file": "file://", "redis": "redis://", "lmcache": "LMCache (MP)"}
_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_kv_offload.json"
#: What ``examples/vllm_kv_offload.json`` holds, for an installed package that ships without ``examples/``.
_FALLBACK_CONFIG: dict[str, Any] = {
    "kv_connector": "AsyncConnKVConnector",
    "kv_connector_module_path": "asyncconn.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {},
}
#: The figures read from vLLM's client result, in the order they are reported.
_FIGURES = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--stores",
        type=argtypes.choice_list(_STORES),
        default=_DEFAULT_STORES,
        help=f"comma-separated, of {', '.join(_STORES)} (default: {_DEFAULT_STORES}; lmcache needs "
        "--lmcache-venv)",
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


def _kv_config(url: str, key_prefix: str) -> dict[str, Any]:
    """The example config with only the store URL (and a key prefix of this run) changed."""
    try:
        config: dict[str, Any] = json.loads(_EXAMPLE.read_text())
    except OSError:
        config = json.loads(json.dumps(_FALLBACK_CONFIG))
    config["kv_connector_extra_config"]["backend_url"] = url
    config["kv_connector_extra_config"]["key_prefix"] = key_prefix
    return config


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
    row["completed"] = result.get("completed")
    row["failed"] = result.get("failed")
    row["prompt_tokens"] = int(metrics.get("vllm:prompt_tokens_total", 0))
    row["local_hit_tokens"] = int(metrics.get("vllm:prefix_cache_hits_total", 0))
    row["external_hit_tokens"] = int(metrics.get("vllm:external_prefix_cache_hits_total", 0))
    row["kv_tokens_saved"] = int(metrics.get("asyncconn:kv_tokens_saved_total", 0))
    row["kv_tokens_loaded"] = int(metrics.get("asyncconn:kv_tokens_loaded_total", 0))
    return row


class _LMCacheServer:
    """LMCache's own server in its multi-process mode (``lmcache server``), the store LMCacheMPConnector
    talks to: what an operator comparing the two runs beside vLLM."""

    def __init__(self, venv: Path, log_path: Path) -> None:
        from asyncconn_tools.chaos.procs import free_port, wait_port

        self.port = free_port()
        self._log = log_path.open("ab")
        args = [
            str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(self.port),
            "--l1-size-gb", "4", "--l1-init-size-gb", "1", "--eviction-policy", "LRU",
            "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1", "--http-port", str(free_port()),
        ]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 180
        while True:
            try:
                wait_port(self.port, timeout=1)
                return
            except RuntimeError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"lmcache server did not come up; its log: {log_path}") from None

    def kv_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


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


def run(args: argparse.Namespace) -> int:
    from asyncconn_tools.chaos.procs import RedisServer
    from asyncconn_tools.demo.report import print_summary
    from asyncconn_tools.openai_server import OpenAIServer
    from asyncconn_tools.tiny_models import build_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    stores = [s for s in _STORES if s in str(args.stores).split(",")]
    model = build_model(args.model, progress=lambda msg: print(msg, file=sys.stderr))
    work = Path(tempfile.mkdtemp(prefix="asyncconn-bench-serve-"))
    logs: Path = args.logs or work
    logs.mkdir(parents=True, exist_ok=True)
    if "lmcache" in stores and args.lmcache_venv is None:
        raise SystemExit("asyncconn bench serve: --stores lmcache needs --lmcache-venv")
    redis = RedisServer().start() if "redis" in stores else None
    lmcache = _LMCacheServer(args.lmcache_venv, logs / "lmcache-server.log") if "lmcache" in stores else None
    tag = f"serve-{os.getpid()}-"
    urls = {
        "file": f"file://{work}/store?max_bytes=4GiB",
        "redis": redis.url if redis is not None else "",
    }

    def server(name: str, store: str) -> OpenAIServer:
        config: dict[str, Any] | None = None
        python = sys.executable
        if store == "lmcache":
            assert lmcache is not None
            config, python = lmcache.kv_config(), str(args.lmcache_venv / "bin" / "python")
        elif store != "none":
            config = _kv_config(urls[store], tag)
        return OpenAIServer(
            python=python,
            model=model,
            log_path=logs / f"{name}.log",
            kv_transfer_config=config,
            max_model_len=max(2048, args.prefix_len + args.suffix_len + args.output_len + 64),
            kv_cache_bytes=args.kv_cache_bytes,
            env={"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)},
        )

    rows: dict[str, dict[str, Any]] = {}
    started = time.monotonic()

    def measure(label: str, srv: OpenAIServer) -> None:
        _warm_up(srv.base_url, model, srv.port)
        result = _drive(args, model, srv.base_url)
        rows[label] = _row(label, result, srv.metrics())

    try:
        # Phase 1: every server 1 (and the connector-less reference) starts; each is measured alone.
        first = {store: server(f"{store}-1", store) for store in stores}
        with _servers(list(first.values())):
            for store, srv in first.items():
                label = "no connector" if store == "none" else f"{_LABELS[store]} server 1 (computes, saves)"
                measure(label, srv)
            # Phase 2: a fresh server 2 per store, started once server 1 has finished (its saves with it).
            second = {store: server(f"{store}-2", store) for store in stores if store != "none"}
            with _servers(list(second.values())):
                for store, srv in second.items():
                    measure(f"{_LABELS[store]} server 2 (fresh, loads)", srv)
    finally:
        if redis is not None:
            redis.stop()
        if lmcache is not None:
            lmcache.stop()
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
            f" of {row['prompt_tokens']} prompt tokens"
            for label, row in rows.items()
        },
        "checks": {
            "every request completed": all(row["failed"] == 0 for row in rows.values()),
            "every server 2 loaded from its store": all(
                row["external_hit_tokens"] > 0 for label, row in rows.items() if "server 2" in label
            ),
        },
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    return 0 if all(summary["checks"].values()) else 1
