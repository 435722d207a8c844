"""Where a cold load's time goes with the host tier in front of a store: an in-process microbenchmark.

One load of ``values`` values of ``nbytes`` each (a 4k-token prefix of the bench model: 128 values of
896 KiB plus the frame header) through ``get_into_many`` into reused host buffers (the CPU engine's
staging), timed against the store alone:

- ``store``: the backend alone (what a cold load costs without the tier);
- ``tier cold``: a fresh tier's first load (misses: read from the store and kept);
- ``tier warm``: the same load again (hits: copies out of the tier).

Run: ``python -m asyncconn_tools.bench.hosttier_micro [--url redis://...] [--rounds N]``; without
``--url`` a loopback redis-server is started. Prints one JSON object of medians (seconds).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

from asyncconn.backend import IntoRead, StorageBackend, open_backend
from asyncconn.hosttier import HostTier

__all__ = ["micro_bench"]


async def _load(backend: StorageBackend, keys: Sequence[str], dests: list[bytearray]) -> float:
    reads: list[IntoRead] = [(key, [memoryview(d)], None) for key, d in zip(keys, dests, strict=True)]
    started = time.perf_counter()
    lengths = await backend.get_into_many(reads)
    took = time.perf_counter() - started
    if any(n != len(d) for n, d in zip(lengths, dests, strict=True)):
        raise RuntimeError(f"a value did not land whole: {lengths[:4]}...")
    return took


async def micro_bench(
    url: str, *, values: int = 128, nbytes: int = 917_568, rounds: int = 5
) -> dict[str, Any]:
    store = await open_backend(url)
    keys = [f"micro-{i}" for i in range(values)]
    payload = bytes(range(256)) * (nbytes // 256) + b"\x01" * (nbytes % 256)
    await store.put([(key, payload) for key in keys])
    dests = [bytearray(nbytes) for _ in range(values)]  # reused across loads, as staging is
    times: dict[str, list[float]] = {"store": [], "tier cold": [], "tier warm": [], "tier made": []}
    try:
        for _ in range(rounds):
            times["store"].append(await _load(store, keys, dests))
            started = time.perf_counter()
            tier = HostTier(await open_backend(url), 2 * values * nbytes)
            ready = getattr(tier, "ready", None)  # (a tier that prepares its memory first)
            if ready is not None:
                await ready()
            times["tier made"].append(time.perf_counter() - started)
            times["tier cold"].append(await _load(tier, keys, dests))
            times["tier warm"].append(await _load(tier, keys, dests))
            if bytes(dests[-1]) != payload or tier.stats.hits != values:
                raise RuntimeError("the warm load was not served by the tier byte-equal")
            await tier.close()
    finally:
        await store.delete(keys)
        await store.close()
    out: dict[str, Any] = {"values": values, "bytes each": nbytes, "rounds": rounds}
    for name, xs in times.items():
        out[f"{name}: median s"] = round(statistics.median(xs), 4)
    out["tier cold / store"] = round(
        statistics.median(times["tier cold"]) / statistics.median(times["store"]), 3
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--values", type=int, default=128)
    args = parser.parse_args()
    if args.url is not None:
        print(
            json.dumps(asyncio.run(micro_bench(args.url, values=args.values, rounds=args.rounds)), indent=1)
        )
        return
    from asyncconn_tools.bench.engine_runs import _redis_url

    with _redis_url() as url:
        print(json.dumps(asyncio.run(micro_bench(url, values=args.values, rounds=args.rounds)), indent=1))


if __name__ == "__main__":
    main()
