"""Side-by-side Redis throughput: the ``redis-benchmark`` binary vs our backend through :class:`TensorStore`.

The ``vs_redis_benchmark`` figure of ``asyncconn bench`` is the ratio of the two, taken in one run against
one server with the same value size and the same number of concurrent clients, because on a shared machine
only a ratio measured side by side means anything. Both sides report requests/s and GB/s (10^9 bytes of
value per second); our side moves a tensor of exactly ``value_size`` bytes (plus its ~40-byte frame header).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import io
import json
import resource
import shutil
import statistics
import subprocess
import time
from typing import Any
from urllib.parse import quote

import torch

from asyncconn.cli import argtypes
from asyncconn.exceptions import ConfigError
from asyncconn.store import TensorStore

__all__ = ["compare_redis", "eviction_hit_rate", "measure_store", "probe_overwrites", "run_redis_benchmark"]


def run_redis_benchmark(
    host: str,
    port: int,
    value_size: int,
    clients: int,
    requests: int,
    password: str | None = None,
    *,
    binary: str | None = None,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Run ``redis-benchmark -t set,get -d value_size -c clients -n requests --csv`` and parse it.

    Returns ``{"set": {"rps", "gbps"}, "get": {...}, "value_size", "clients", "requests", "command"}``
    (the password is masked in ``command``). Raises :class:`ConfigError` when the binary is not on PATH
    and ``RuntimeError`` when it fails or prints something unparseable.
    """
    exe = binary or shutil.which("redis-benchmark")
    if exe is None:
        raise ConfigError("redis-benchmark is not on PATH (it ships with redis-server / redis-tools)")
    args = [exe, "-h", host, "-p", str(port), "-t", "set,get", "-d", str(value_size), "-c", str(clients),
            "-n", str(requests), "--csv"]  # fmt: skip
    shown = list(args)
    if password:
        args += ["-a", password]
        shown += ["-a", "***"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"redis-benchmark exited {proc.returncode}: {_mask(proc.stderr, password)[-500:]}")
    result: dict[str, Any] = {
        "value_size": value_size, "clients": clients, "requests": requests, "command": " ".join(shown),
    }  # fmt: skip
    for row in csv.reader(io.StringIO(proc.stdout)):
        if len(row) >= 2 and row[0] in ("SET", "GET"):
            rps = float(row[1])
            result[row[0].lower()] = {"rps": rps, "gbps": rps * value_size / 1e9}
    if "set" not in result or "get" not in result:
        raise RuntimeError(f"cannot parse redis-benchmark output: {proc.stdout[-500:]!r}")
    return result


def _mask(text: str, password: str | None) -> str:
    return text.replace(password, "***") if password else text


async def measure_store(
    store: TensorStore,
    value_size: int,
    clients: int,
    requests: int,
    *,
    into: bool = False,
    key_prefix: str = "asyncconn-bench:",
) -> dict[str, Any]:
    """Our side: ``clients`` tasks each put, then get, ``requests // clients`` values of ``value_size``.

    Runs on the store's loop. ``into=True`` reads with :meth:`TensorStore.get_into` into a preallocated
    tensor per client (the staging-buffer path the loaders use) instead of :meth:`TensorStore.get`, which
    allocates a fresh tensor per read. Every get is checked to be a hit (a miss would inflate the rate).
    The keys written are deleted at the end. Returns ``{"put": {"rps", "gbps"}, "get": {...}, ...}``.
    """
    if clients <= 0 or requests < clients or value_size <= 0:
        raise ConfigError("measure_store needs clients > 0, requests >= clients and value_size > 0")
    per_client = requests // clients
    total = per_client * clients
    tensor = torch.randint(0, 256, (value_size,), dtype=torch.uint8)
    keys = [f"{key_prefix}{i}" for i in range(clients)]
    outs = [torch.empty_like(tensor) for _ in range(clients)]

    async def putter(key: str) -> None:
        for _ in range(per_client):
            await store.put([(key, tensor)])

    async def getter(key: str, out: torch.Tensor) -> None:
        for _ in range(per_client):
            if into:
                ok = await store.get_into(key, out)
            else:
                (got,) = await store.get([key])
                ok = got is not None
            if not ok:
                raise RuntimeError(f"benchmark read of {key!r} missed")

    started = time.perf_counter()
    await asyncio.gather(*(putter(k) for k in keys))
    put_s = time.perf_counter() - started
    started = time.perf_counter()
    await asyncio.gather(*(getter(k, o) for k, o in zip(keys, outs, strict=True)))
    get_s = time.perf_counter() - started
    await store.delete(keys)
    return {
        "value_size": value_size,
        "clients": clients,
        "requests": total,
        "get_path": "get_into" if into else "get",
        "put": {"rps": total / put_s, "gbps": total * value_size / put_s / 1e9},
        "get": {"rps": total / get_s, "gbps": total * value_size / get_s / 1e9},
    }


def compare_redis(
    host: str,
    port: int,
    value_size: int,
    clients: int,
    requests: int,
    *,
    reps: int = 3,
    query: str = "",
    password: str | None = None,
    into: bool = False,
) -> dict[str, Any]:
    """Alternate ``redis-benchmark`` and :func:`measure_store` ``reps`` times against one server.

    Returns the median GB/s of each side per op and ``vs_redis_benchmark`` (ours / theirs, per op). The
    two sides alternate so that background load on a shared machine hits both alike.
    """
    from asyncconn.runtime import Runtime

    auth = f":{quote(password, safe='')}@" if password else ""
    url = f"redis://{auth}{host}:{port}/0" + (f"?{query}" if query else "")
    theirs: dict[str, list[float]] = {"set": [], "get": []}
    ours: dict[str, list[float]] = {"put": [], "get": []}
    command = ""
    runtime = Runtime(name="asyncconn-bench").start()

    async def one_round() -> dict[str, Any]:
        store = await TensorStore.open(url, timeout=60.0)
        try:
            return await measure_store(store, value_size, clients, requests, into=into)
        finally:
            await store.close()

    try:
        for _ in range(reps):
            them = run_redis_benchmark(host, port, value_size, clients, requests, password)
            command = them["command"]
            us = runtime.run(one_round())
            for op in ("set", "get"):
                theirs[op].append(them[op]["gbps"])
            for op in ("put", "get"):
                ours[op].append(us[op]["gbps"])
    finally:
        runtime.close()
    put_us, get_us = statistics.median(ours["put"]), statistics.median(ours["get"])
    set_them, get_them = statistics.median(theirs["set"]), statistics.median(theirs["get"])
    return {
        "value_size": value_size,
        "clients": clients,
        "requests": requests,
        "reps": reps,
        "redis_benchmark_command": command,
        "redis_benchmark_gbps": {"set": set_them, "get": get_them},
        "asyncconn_gbps": {"put": put_us, "get": get_us},
        "get_path": "get_into" if into else "get",
        "vs_redis_benchmark": {"put": put_us / set_them, "get": get_us / get_them},
    }


async def probe_overwrites(
    url: str, value_size: int, *, phases: int = 3, puts: int = 60, gets: int = 30
) -> dict[str, Any]:
    """Per phase: ``puts`` overwrites of one key, then ``gets`` timed ``get_into`` reads of it.

    Two stores take turns: the direct path (chunks land in the destination tensor) and the copying path
    it replaced (``reads_into`` turned off on that one backend: chunks into fresh buffers, then a copy).
    Reports each phase's p50 and the minor page faults per read, the figure that explained why 4 MiB
    reads slowed down after overwrites (docs/redis.md). Runs on the caller's loop.
    """
    source = torch.randint(0, 256, (value_size,), dtype=torch.uint8)
    out = torch.empty_like(source)
    stores = {
        "direct": await TensorStore.open(url, timeout=60.0),
        "copy": await TensorStore.open(url, timeout=60.0),
    }
    stores["copy"].backend.reads_into = False  # type: ignore[misc]  # this instance only: the old path
    result: dict[str, Any] = {name: {"p50_ms": [], "faults_per_get": 0.0} for name in stores}
    key = f"asyncconn-probe-{value_size}"
    try:
        for _ in range(phases):
            for name, store in stores.items():
                for _ in range(puts):
                    await store.put([(key, source)])
                times: list[float] = []
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                for _ in range(gets):
                    started = time.perf_counter()
                    if not await store.get_into(key, out):
                        raise RuntimeError("probe read missed")
                    times.append(time.perf_counter() - started)
                faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
                result[name]["p50_ms"].append(statistics.median(times) * 1e3)
                result[name]["faults_per_get"] += faults / (gets * phases)
        await stores["direct"].delete([key])
    finally:
        for store in stores.values():
            await store.close()
    return result


async def eviction_hit_rate(
    url: str, value_size: int, *, values: int = 200, lag: int = 4, seed: int = 0
) -> dict[str, Any]:
    """Hit rate of a cache under eviction: write value ``i``, then read back value ``i - lag``.

    Run against a server with ``maxmemory`` set and an eviction policy (``allkeys-lru``) whose memory
    holds well over ``lag + 1`` values: an LRU cache should then serve nearly every read, and a layout whose
    values the server evicts piecemeal does not. Reports hits, misses and corrupt reads (a partial value
    must never be anything but a miss), and the server's ``evicted_keys``. Runs on the caller's loop.
    """
    import redis.asyncio as aioredis

    from asyncconn.url import parse_url

    g = torch.Generator().manual_seed(seed)
    tensors = [torch.randint(0, 256, (value_size,), dtype=torch.uint8, generator=g) for _ in range(lag + 1)]
    out = torch.empty(value_size, dtype=torch.uint8)
    store = await TensorStore.open(url, timeout=30.0)
    parsed = parse_url(url)
    admin = aioredis.Redis(
        host=parsed.host or "127.0.0.1", port=parsed.port or 6379, password=parsed.password
    )
    prefix = f"evict-{time.monotonic_ns()}-"
    hits = 0
    try:
        before = int((await admin.info("stats"))["evicted_keys"])
        for i in range(values):
            await store.put([(f"{prefix}{i}", tensors[i % len(tensors)])])
            if i >= lag and await store.get_into(f"{prefix}{i - lag}", out):
                hits += 1
                if not torch.equal(out, tensors[(i - lag) % len(tensors)]):
                    raise RuntimeError("eviction probe read a wrong value")
        evicted = int((await admin.info("stats"))["evicted_keys"]) - before
        policy = (await admin.config_get("maxmemory-policy"))["maxmemory-policy"]
        maxmemory = int((await admin.config_get("maxmemory"))["maxmemory"] or 0)
    finally:
        await store.close()
        await admin.aclose()
    reads = values - lag
    return {
        "value_size": value_size,
        "values": values,
        "lag": lag,
        "maxmemory": maxmemory,
        "policy": policy,
        "reads": reads,
        "hits": hits,
        "hit_rate": hits / reads,
        "corrupt": store.stats.corrupt,
        "evicted_keys": evicted,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=argtypes.count, default=6379)
    parser.add_argument(
        "--size", type=argtypes.positive_size, default=4 << 20, help="value size (default 4MiB)"
    )
    parser.add_argument("--clients", type=argtypes.count, default=1)
    parser.add_argument("--requests", type=argtypes.count, default=200)
    parser.add_argument("--reps", type=argtypes.count, default=3)
    parser.add_argument("--query", default="", help="extra redis:// URL parameters, e.g. chunk_size=1MiB")
    parser.add_argument("--into", action="store_true", help="read with get_into (preallocated tensor)")
    parser.add_argument(
        "--probe", action="store_true", help="overwrite-then-read probe: direct vs copying get_into"
    )
    parser.add_argument(
        "--eviction",
        action="store_true",
        help="hit rate under eviction: write value i, read value i-4 (server needs maxmemory + allkeys-lru)",
    )
    parser.add_argument("--values", type=argtypes.count, default=200, help="--eviction: values written")


def run(args: argparse.Namespace) -> int:
    """``asyncconn bench redis --port 6379 --size 4MiB --clients 1``: print one comparison as JSON."""
    url = f"redis://{args.host}:{args.port}/0" + (f"?{args.query}" if args.query else "")
    if args.eviction or args.probe:
        from asyncconn.runtime import Runtime

        runtime = Runtime(name="asyncconn-redis-bench").start()
        try:
            if args.eviction:
                result = runtime.run(eviction_hit_rate(url, args.size, values=args.values))
            else:
                result = runtime.run(probe_overwrites(url, args.size))
        finally:
            runtime.close()
        print(json.dumps(result, indent=2))
        return 0
    result = compare_redis(
        args.host, args.port, args.size, args.clients, args.requests,
        reps=args.reps, query=args.query, into=args.into,
    )  # fmt: skip
    print(json.dumps(result, indent=2))
    return 0
