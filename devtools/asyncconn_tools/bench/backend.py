"""``asyncconn bench backend``: put / get / exists throughput and latency of a store, per value size.

Everything goes through :class:`TensorStore` (framing, checksums, timeouts included), with ``--clients``
concurrent tasks on the runtime loop. Gets decode straight into a preallocated destination tensor, as the
loaders do. Side-by-side baselines in the same run:

- ``file://``: a plain ``read()`` of the same files on the calling thread (``vs_plain_read``);
- ``redis://`` on loopback with ``redis-benchmark`` on PATH: redis-benchmark with the same value size and
  client count (``vs_redis_benchmark``, our GB/s over theirs);
- ``memory://``: the round-trip overhead of a small tensor through the whole stack.

With no ``--url`` the embedded default store is used: ``file://`` in a fresh temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncconn.cli import argtypes
from asyncconn.exceptions import AsyncConnError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.url import parse_url, redact
from asyncconn_tools.bench.measure import Progress, human_size, summarize

__all__ = ["add_arguments", "bench", "run"]

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=None, help="store URL (default: file:// in a new temporary directory)"
    )
    parser.add_argument(
        "--sizes", type=argtypes.size_list, default="1MiB,4MiB,16MiB", help="comma-separated value sizes"
    )
    parser.add_argument("--clients", type=argtypes.count, default=4, help="concurrent operations in flight")
    parser.add_argument(
        "--iterations",
        type=argtypes.non_negative_count,
        default=0,
        help="values per size (0: ~256 MiB per size)",
    )
    parser.add_argument(
        "--timeout", type=argtypes.positive_duration, default=30.0, help="per-operation timeout in seconds"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-baseline", action="store_true", help="skip the side-by-side baselines")


def _iterations(size: int, requested: int) -> int:
    if requested > 0:
        return requested
    return max(8, min(200, (256 << 20) // max(size, 1)))


async def _timed_pool(
    n: int, clients: int, op: Any, progress: Progress, label: str
) -> tuple[float, list[float]]:
    """Run ``op(i, worker)`` for i in range(n) over ``clients`` workers; return wall time and latencies."""
    latencies: list[float] = []
    next_index = iter(range(n))

    async def worker(w: int) -> None:
        for i in next_index:
            t = time.perf_counter()
            await op(i, w)
            latencies.append(time.perf_counter() - t)
            progress.advance(label=label)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(clients)))
    return time.perf_counter() - t0, latencies


def _rate(size: int, count: int, wall: float, latencies: list[float]) -> dict[str, Any]:
    return {
        "gbps": size * count / wall / 1e9 if wall else 0.0,
        "ops_per_s": count / wall if wall else 0.0,
        "latency": summarize(latencies),
    }


async def _bench_size(
    store: TensorStore, size: int, clients: int, iterations: int, progress: Progress
) -> dict[str, Any]:
    run_id = uuid.uuid4().hex[:8]
    source = torch.randint(0, 255, (size,), dtype=torch.uint8)
    # One key per client, overwritten: the same workload as redis-benchmark's SET/GET on its one key, so the
    # side-by-side ratio compares like with like (and the store does not grow by iterations x size).
    keys = [f"asyncconn-bench-{run_id}-{size}-{w}" for w in range(clients)]
    dests = [torch.empty_like(source) for _ in range(clients)]
    failures = 0
    used: set[int] = set()
    label = human_size(size)

    async def put(_i: int, w: int) -> None:
        await store.put([(keys[w], source)])

    async def get(_i: int, w: int) -> None:
        nonlocal failures
        used.add(w)
        if not await store.get_into(keys[w], dests[w]):
            failures += 1

    async def exists(_i: int, w: int) -> None:
        nonlocal failures
        (present,) = await store.exists([keys[w]])
        failures += not present

    put_wall, put_lat = await _timed_pool(iterations, clients, put, progress, f"{label} put")
    get_wall, get_lat = await _timed_pool(iterations, clients, get, progress, f"{label} get")
    ex_wall, ex_lat = await _timed_pool(iterations, clients, exists, progress, f"{label} exists")
    verified = bool(used) and all(torch.equal(dests[w], source) for w in used)
    await store.delete(keys)
    return {
        "size": size,
        "iterations": iterations,
        "put": _rate(size, iterations, put_wall, put_lat),
        "get": _rate(size, iterations, get_wall, get_lat),
        "exists": {"ops_per_s": iterations / ex_wall if ex_wall else 0.0, "latency": summarize(ex_lat)},
        "failures": failures,
        "verified": verified and failures == 0,
    }


async def _file_vs_plain_read(store: TensorStore, size: int, rounds: int) -> dict[str, Any]:
    """Sequential get of one value vs a plain read() of its file, alternated to share the noise."""
    from asyncconn_backends.file import FileBackend

    backend = store.backend
    assert isinstance(backend, FileBackend)
    key = f"asyncconn-bench-plain-{uuid.uuid4().hex[:8]}"
    source = torch.randint(0, 255, (size,), dtype=torch.uint8)
    dest = torch.empty_like(source)
    await store.put([(key, source)])
    path = backend.path_for(key)
    ours: list[float] = []
    plain: list[float] = []
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            with open(path, "rb") as f:
                data = f.read()
            plain.append(time.perf_counter() - t)
            del data
            t = time.perf_counter()
            ok = await store.get_into(key, dest)
            ours.append(time.perf_counter() - t)
            if not ok:
                raise AsyncConnError("file bench: value vanished")
    finally:
        await store.delete([key])
    ours_med, plain_med = statistics.median(ours), statistics.median(plain)
    return {
        "size": size,
        "ours_median_ms": ours_med * 1e3,
        "plain_read_median_ms": plain_med * 1e3,
        "ours_gbps": size / ours_med / 1e9,
        "plain_read_gbps": size / plain_med / 1e9,
        "vs_plain_read": plain_med / ours_med,
        "verified": torch.equal(dest, source),
    }


async def _memory_roundtrip(rounds: int = 2000) -> dict[str, Any]:
    """put + get_into of a 1 KiB tensor through TensorStore on memory://, timed on the loop."""
    store = await TensorStore.open("memory://")
    tensor = torch.arange(256, dtype=torch.float32)
    dest = torch.empty_like(tensor)
    samples: list[float] = []
    for i in range(rounds):
        key = f"rt-{i % 16}"
        t = time.perf_counter()
        await store.put([(key, tensor)])
        await store.get_into(key, dest)
        samples.append(time.perf_counter() - t)
    await store.close()
    return {"value_bytes": tensor.numel() * 4, "roundtrip": summarize(samples)}


async def bench(
    url: str,
    sizes: Sequence[int],
    clients: int,
    iterations: int,
    timeout: float,
    baseline: bool,
    progress_force: bool = False,
) -> dict[str, Any]:
    """Run the whole benchmark on the current loop; returns the JSON-able result."""
    parsed = parse_url(url)
    store = await TensorStore.open(parsed, timeout=timeout)
    total = sum(3 * _iterations(s, iterations) for s in sizes)
    progress = Progress(total, force=progress_force)
    result: dict[str, Any] = {"url": redact(url), "scheme": parsed.scheme, "clients": clients, "sizes": []}
    try:
        for size in sizes:
            entry = await _bench_size(store, size, clients, _iterations(size, iterations), progress)
            if baseline and parsed.scheme == "file":
                entry["file_vs_plain_read"] = await _file_vs_plain_read(store, size, rounds=15)
            if baseline and parsed.scheme in ("redis", "rediss") and (parsed.host or "") in _LOOPBACK:
                entry["vs_redis_benchmark"] = await _vs_redis_benchmark(parsed, size, clients, entry)
            result["sizes"].append(entry)
        if baseline and parsed.scheme == "memory":
            result["memory_roundtrip"] = await _memory_roundtrip()
    finally:
        progress.close()
        await store.close()
    return result


async def _vs_redis_benchmark(parsed: Any, size: int, clients: int, ours: dict[str, Any]) -> dict[str, Any]:
    """Run redis-benchmark for the same size and clients now, beside our figures (None if not on PATH)."""
    if shutil.which("redis-benchmark") is None:
        return {"skipped": "redis-benchmark not on PATH"}
    from asyncconn_tools.bench import redis as bench_redis

    theirs = await asyncio.to_thread(
        bench_redis.run_redis_benchmark,
        parsed.host or "127.0.0.1",
        parsed.port or 6379,
        size,
        clients,
        max(8, min(200, (256 << 20) // size)),
        parsed.password,
    )
    out: dict[str, Any] = {"redis_benchmark": theirs}
    for op, their_op in (("put", "set"), ("get", "get")):
        their_gbps = theirs.get(their_op, {}).get("gbps")
        if their_gbps:
            out[op] = ours[op]["gbps"] / their_gbps
    return out


def _print_human(result: dict[str, Any]) -> None:
    print(f"store {result['url']}  clients={result['clients']}")
    print(f"{'size':>8} {'put GB/s':>9} {'put p50':>9} {'get GB/s':>9} {'get p50':>9} {'exists p50':>11}  ok")
    for e in result["sizes"]:
        print(
            f"{human_size(e['size']):>8} {e['put']['gbps']:9.2f} {e['put']['latency']['p50_us'] / 1e3:7.2f}ms"
            f" {e['get']['gbps']:9.2f} {e['get']['latency']['p50_us'] / 1e3:7.2f}ms"
            f" {e['exists']['latency']['p50_us']:9.0f}us  {'yes' if e['verified'] else 'NO'}"
        )
        if "file_vs_plain_read" in e:
            f = e["file_vs_plain_read"]
            print(
                f"{'':>8} get vs plain read(): {f['ours_gbps']:.2f} vs {f['plain_read_gbps']:.2f} GB/s"
                f" = {f['vs_plain_read']:.2f}x"
            )
        if "vs_redis_benchmark" in e:
            v = e["vs_redis_benchmark"]
            ratios = " ".join(f"{k}={v[k]:.2f}x" for k in ("put", "get") if k in v)
            print(f"{'':>8} vs redis-benchmark: {ratios or v.get('skipped', 'n/a')}")
    if "memory_roundtrip" in result:
        rt = result["memory_roundtrip"]["roundtrip"]
        print(f"memory:// put+get round trip of 1 KiB: p50 {rt['p50_us']:.1f}us p99 {rt['p99_us']:.1f}us")


def run(args: argparse.Namespace) -> int:
    sizes = args.sizes
    tmpdir = None
    url = args.url
    if url is None:
        tmpdir = tempfile.mkdtemp(prefix="asyncconn-bench-")
        url = Path(tmpdir).as_uri()
    runtime = Runtime(name="asyncconn-bench").start()
    uvloop = runtime.uses_uvloop
    try:
        result = runtime.run(
            bench(url, sizes, args.clients, args.iterations, args.timeout, not args.no_baseline)
        )
    except AsyncConnError as exc:
        print(f"asyncconn bench backend {redact(url)}: FAILED: {redact(str(exc))}")
        return 2
    finally:
        runtime.close()
        if tmpdir:
            shutil.rmtree(tmpdir, ignore_errors=True)
    result["uvloop"] = uvloop
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0 if all(e["verified"] for e in result["sizes"]) else 1
