"""Side-by-side benchmark: ``mooncake://`` through ``TensorStore`` vs the raw Mooncake client in a loop.

``asyncconn bench mooncake --url mooncake://127.0.0.1:50051?metadata=...`` alternates, per value size and
round, N raw ``upsert``/``get`` calls of ``MooncakeDistributedStore`` from a plain Python loop and N of ours
(``TensorStore.put`` / ``TensorStore.get_into`` into a preallocated tensor: framing, xxh3, timeouts and the
thread hop included), on the *same* client (so both read from the same segments), one operation at a time,
on the project's runtime loop. Ratios are throughput, ours over raw (>1: faster). ``get_into`` of the raw
client into a preallocated buffer is reported too, as the floor a zero-copy read can reach; then ours again
with ``--clients`` operations in flight, against the same raw sequential figures. Last, the connectors'
pattern: ``--batch`` values of ``--batch-size`` saved in one ``TensorStore.put`` and loaded by as many
concurrent ``get_into`` (as the save tracker and the loader issue them), against the raw client's ``upsert``
/ ``get`` of the same values one after another. Last, closing the backend: its seconds, and the longest
time a Python thread ticking every millisecond meanwhile could not run (Mooncake's own ``close`` holds
the GIL while it joins its threads, so the whole process stands still). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import statistics
import threading
import time
import uuid
from typing import Any

import torch
from asyncconn_backends.mooncake.backend import MooncakeBackend

from asyncconn.backend import open_backend
from asyncconn.cli import argtypes
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


async def _concurrent(store: TensorStore, source: torch.Tensor, clients: int, count: int) -> dict[str, float]:
    """GB/s of ``count`` puts, then gets, with ``clients`` in flight (one overwritten key per client)."""
    tag = uuid.uuid4().hex[:8]
    keys = [f"conc-{tag}-{c}" for c in range(clients)]
    dests = [torch.empty_like(source) for _ in range(clients)]
    out: dict[str, float] = {}
    for op in ("put", "get"):
        todo = iter(range(count))

        async def worker(c: int, op: str = op, todo: Any = todo) -> None:
            for _ in todo:
                if op == "put":
                    await store.put([(keys[c], source)])
                else:
                    assert await store.get_into(keys[c], dests[c])

        t = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in range(clients)))
        out[op] = source.numel() * count / (time.perf_counter() - t) / 1e9
    await store.delete(keys)
    return out


async def _batches(
    store: TensorStore, raw: Any, count: int, size: int, rounds: int, iterations: int
) -> dict[str, Any]:
    """Batch put and concurrent gets of ``count`` values vs the raw client looping over them (p50 ms)."""
    tag = uuid.uuid4().hex[:8]
    sources = [torch.randint(0, 255, (size,), dtype=torch.uint8) for _ in range(count)]
    payloads = [s.numpy().tobytes() for s in sources]
    dests = [torch.empty_like(s) for s in sources]
    keys = [f"batch-{tag}-{i}" for i in range(count)]
    times: dict[str, list[float]] = {k: [] for k in ("raw_put", "put", "raw_get", "get")}
    for _ in range(rounds * iterations // 4 or 1):
        t = time.perf_counter()
        for key, payload in zip(keys, payloads, strict=True):
            assert raw.upsert(f"raw-{key}", payload) == 0
        times["raw_put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        await store.put(list(zip(keys, sources, strict=True)))
        times["put"].append(time.perf_counter() - t)
        t = time.perf_counter()
        for key in keys:
            assert len(raw.get(f"raw-{key}")) == size
        times["raw_get"].append(time.perf_counter() - t)
        t = time.perf_counter()
        got = await asyncio.gather(*(store.get_into(k, d) for k, d in zip(keys, dests, strict=True)))
        times["get"].append(time.perf_counter() - t)
        assert all(got)
    assert all(torch.equal(d, s) for d, s in zip(dests, sources, strict=True))
    await store.delete(keys)
    raw.batch_remove([f"raw-{k}" for k in keys], True)
    p50 = {k: _median_ms(v) for k, v in times.items()}
    return {
        "values": count,
        "size": size,
        "p50_ms": p50,
        "put_vs_raw_put": p50["raw_put"] / p50["put"],
        "get_vs_raw_get": p50["raw_get"] / p50["get"],
    }


class _Ticker:
    """A thread that sleeps 1 ms at a time and keeps the longest gap between its wake-ups: how long no
    Python thread could run (a call holding the GIL stops it along with every other)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-ticker", daemon=True)

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(0.001):
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now


async def _bench(
    url: str, sizes: list[int], rounds: int, iterations: int, clients: int, batch: int, batch_size: int
) -> dict[str, Any]:
    backend = await open_backend(url)
    assert isinstance(backend, MooncakeBackend)
    store = TensorStore(backend, timeout=30)
    raw = backend._store  # the same client: both paths read from and write to the same segments
    results: list[dict[str, Any]] = []
    try:
        for size in sizes:
            tag = uuid.uuid4().hex[:8]
            source = torch.randint(0, 255, (size,), dtype=torch.uint8)
            payload = source.numpy().tobytes()
            dest = torch.empty_like(source)
            raw_dest = bytearray(size)
            raw_ptr = ctypes.addressof((ctypes.c_char * size).from_buffer(raw_dest))
            times: dict[str, list[float]] = {
                k: [] for k in ("raw_put", "put", "raw_get", "raw_get_into", "get")
            }
            for _ in range(rounds):
                for _ in range(iterations):
                    t = time.perf_counter()
                    assert raw.upsert(f"raw-{tag}", payload) == 0
                    times["raw_put"].append(time.perf_counter() - t)
                for _ in range(iterations):
                    t = time.perf_counter()
                    await store.put([(f"ours-{tag}", source)])
                    times["put"].append(time.perf_counter() - t)
                for _ in range(iterations):
                    t = time.perf_counter()
                    got = raw.get(f"raw-{tag}")
                    times["raw_get"].append(time.perf_counter() - t)
                    assert len(got) == size
                    del got
                for _ in range(iterations):
                    t = time.perf_counter()
                    assert raw.get_into(f"raw-{tag}", raw_ptr, size) == size
                    times["raw_get_into"].append(time.perf_counter() - t)
                for _ in range(iterations):
                    t = time.perf_counter()
                    ok = await store.get_into(f"ours-{tag}", dest)
                    times["get"].append(time.perf_counter() - t)
                    assert ok
            assert torch.equal(dest, source) and bytes(raw_dest) == payload
            concurrent = await _concurrent(store, source, clients, rounds * iterations)
            await store.delete([f"ours-{tag}"])
            raw.remove(f"raw-{tag}", True)
            p50 = {k: _median_ms(v) for k, v in times.items()}
            results.append(
                {
                    "size": size,
                    "p50_ms": p50,
                    "gbps": {k: size / (v / 1e3) / 1e9 for k, v in p50.items()},
                    "put_vs_raw_put": p50["raw_put"] / p50["put"],
                    "get_vs_raw_get": p50["raw_get"] / p50["get"],
                    "get_vs_raw_get_into": p50["raw_get_into"] / p50["get"],
                    f"clients_{clients}_gbps": concurrent,
                    f"clients_{clients}_put_vs_raw_put": concurrent["put"]
                    / (size / p50["raw_put"] * 1e3 / 1e9),
                    f"clients_{clients}_get_vs_raw_get": concurrent["get"]
                    / (size / p50["raw_get"] * 1e3 / 1e9),
                }
            )
        batches = await _batches(store, raw, batch, batch_size, rounds, iterations) if batch else None
    finally:
        with _Ticker() as ticker:
            started = time.perf_counter()
            await backend.close()
            close_s = time.perf_counter() - started
    return {
        "url": backend.name,
        "rounds": rounds,
        "iterations": iterations,
        "clients": clients,
        "sizes": results,
        "batch": batches,
        "close": {"seconds": close_s, "longest_stall_ms": ticker.longest * 1e3},
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", required=True, help="mooncake:// URL of the store to measure")
    parser.add_argument("--sizes", type=argtypes.size_list, default=[1 << 20, 4 << 20, 16 << 20])
    parser.add_argument("--rounds", type=argtypes.count, default=5)
    parser.add_argument("--iterations", type=argtypes.count, default=20)
    parser.add_argument(
        "--clients", type=argtypes.count, default=4, help="operations in flight for the concurrent pass"
    )
    parser.add_argument(
        "--batch", type=argtypes.non_negative_count, default=32, help="values per batch (0: skip)"
    )
    parser.add_argument(
        "--batch-size", type=argtypes.positive_size, default=64 << 10, help="value size in the batch pass"
    )


def run(args: argparse.Namespace) -> int:
    # On the project's runtime loop (uvloop when installed), as the connectors use it.
    runtime = Runtime(name="mooncake-bench").start()
    try:
        coro = _bench(
            args.url, args.sizes, args.rounds, args.iterations, args.clients, args.batch, args.batch_size
        )
        result = runtime.run(coro, timeout=3600)
    finally:
        runtime.close()
    print(json.dumps(result))
    return 0
