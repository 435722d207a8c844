"""Stress reproducer for the contract suite's racing writers test on ``mooncake://`` (not run by the tests).

Usage: ``.venv/bin/python scripts/mooncake_race_repro.py [rounds writers readers size]`` (defaults: 50 4 2 2
MiB). Each round runs the body of
``tests/backends/test_contract.py::test_concurrent_writers_never_leave_a_torn_value`` on a fresh backend (as
each test gets one; a fresh segment) against one ``mooncake_master``, with ``readers`` ``get()`` readers and
as many ``get_into()`` readers, and counts reads that returned bytes equal to none of the values written:
the atomicity the contract promises.
"""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections import Counter

import torch
from asyncconn_backends.mooncake.layout import parse_header

from asyncconn.backend import StorageBackend, open_backend
from asyncconn.exceptions import BackendError
from tests.servers_distributed import MooncakeMaster, mooncake_contract_url


def _val(n: int, seed: int) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return bytes(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes())


def _describe(s: bytes, values: list[bytes]) -> str:
    """What a bad read holds: its length and header, or which 64 KiB blocks match which value (x: none)."""
    if len(s) != len(values[0]):
        return f"len {len(s)} head {s[:24].hex()} parsed {parse_header(s)} all-zero {not any(s)}"
    blk = 64 << 10
    out = []
    for off in range(0, len(s), blk):
        m = [i for i, v in enumerate(values) if v[off : off + blk] == s[off : off + blk]]
        out.append(str(m[0]) if m else "x")
    return f"64K blocks from values: {''.join(out)} all-zero {not any(s)}"


async def _round(
    backend: StorageBackend, key: str, values: list[bytes], readers: int, tally: Counter[str]
) -> list[tuple[str, bytes]]:
    """One racing round; the reads that returned a value, each with the call that returned it."""
    seen: list[tuple[str, bytes]] = []
    size = len(values[0])

    async def writer(v: bytes) -> None:
        for _ in range(5):
            try:
                await backend.put([(key, v)])
            except BackendError as exc:
                tally["put failures"] += 1
                print(f"put failed: {str(exc).rsplit(':', 1)[-1]}", flush=True)

    async def reader(direct: bool) -> None:
        dest = bytearray(size)
        for _ in range(15):
            try:
                if direct:
                    if await backend.get_into(key, [memoryview(dest)]) == size:
                        seen.append(("get_into", bytes(dest)))
                else:
                    (got,) = await backend.get([key])
                    if got is not None:
                        seen.append(("get", b"".join(bytes(c) for c in got)))
            except BackendError as exc:
                tally["read errors"] += 1
                print(f"read failed: {str(exc).rsplit(':', 1)[-1]}", flush=True)
            await asyncio.sleep(0)

    reads = (reader(direct) for _ in range(readers) for direct in (False, True))
    await asyncio.gather(*(writer(v) for v in values), *reads)
    return seen


async def main(rounds: int, writers: int, readers: int, size: int) -> None:
    master = MooncakeMaster().start()
    values = [_val(size, seed) for seed in range(writers)]
    tally: Counter[str] = Counter()
    t0 = time.monotonic()
    try:
        for r in range(rounds):
            backend = await open_backend(mooncake_contract_url(master))
            try:
                seen = await _round(backend, f"contested-{uuid.uuid4().hex[:6]}", values, readers, tally)
            finally:
                await backend.close()
            tally["reads"] += len(seen)
            bad = [(how, s) for how, s in seen if s not in values]
            if bad:
                tally["bad rounds"] += 1
                tally["bad reads"] += len(bad)
                for how, s in bad[:2]:
                    print(f"round {r}: bad {how}: {_describe(s, values)}", flush=True)
    finally:
        master.stop()
    print(
        f"rounds={rounds} writers={writers} readers={readers}+{readers} size={size}: "
        f"bad rounds {tally['bad rounds']}, bad reads {tally['bad reads']}/{tally['reads']}, "
        f"put failures {tally['put failures']}, read errors {tally['read errors']}, "
        f"{time.monotonic() - t0:.1f}s",
        flush=True,
    )


if __name__ == "__main__":
    args = [int(x) for x in sys.argv[1:]]
    asyncio.run(main(*(args + [50, 4, 2, 2 << 20][len(args) :])))
