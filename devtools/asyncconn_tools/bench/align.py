"""``asyncconn bench align``: why a frame's payload starts 64-byte aligned, measured on this machine.

A backend that reads into caller memory (``file://``'s ``preadv``) has the kernel copy each payload byte
from the page cache to the destination. How fast that copy runs depends on how the two are aligned: on
the project's CPU box (AMD EPYC) it is about 2-4x slower when the destination sits 8-24 bytes past the
source modulo a page. Destinations (torch tensors, vLLM's KV blocks, staging views) are 64-byte aligned, so
the frame format pads its header to a multiple of 64 bytes (``codec.PAYLOAD_ALIGN``). Three tables, each
side by side in one run (rounds interleaved, medians, one thread):

- ``copy``: ``preadv`` of page-cached files into a page-aligned buffer, the file offset moved so that the
  destination minus the source is each distance modulo a page; the slowdown against distance 0.
- ``ranks``: per value rank, the same ``preadv`` pair a direct read issues (header buffer, then the
  destination: 64 bytes into a page, as torch places large tensors, or at a page start, as pinned staging)
  with the header of format version 1 (``24 + 8 * rank`` bytes, unpadded) against this version's
  (``codec.header_size``).
- ``store``: per rank, ``TensorStore.read_into_many`` of real frames over ``file://`` (framing and
  checksum included), against the raw ``preadv`` at this version's offset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from asyncconn import codec
from asyncconn.cli import argtypes
from asyncconn.store import Fetch, TensorStore
from asyncconn_tools.bench.measure import human_size

__all__ = ["add_arguments", "bench", "run"]

#: Destination minus source, modulo a 4 KiB page, that the ``copy`` table measures.
DISTANCES = (0, 8, 16, 24, 40, 64, 72, 4032, 4088)
#: Where in a page the ``ranks`` table's destinations start: 64, as torch's CPU allocator places large
#: tensors (vLLM's CPU KV cache included); 0, as pinned (page-locked) staging buffers start.
PLACEMENTS = (64, 0)
#: Where the ``store`` table's destinations start (as torch places them).
STORE_PLACEMENT = 64
#: The header length of format version 1: fixed fields, the shape, the checksum, no padding.
_V1_FIELDS = 24


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--values", type=argtypes.count, default=128, help="files read per measurement")
    parser.add_argument(
        "--size",
        type=argtypes.positive_size,
        default="896KiB",
        help="payload bytes per file (default: one KV value "
        "of the text-100m benchmark model, 1 block of 32 tokens x 14 layers, float32)",
    )
    parser.add_argument(
        "--ranks",
        type=argtypes.count_list,
        default="2,3,4,5,6",
        help="comma-separated value ranks (ranks, store)",
    )
    parser.add_argument("--rounds", type=argtypes.count, default=9, help="interleaved rounds (medians)")
    parser.add_argument("--dir", default=None, help="where the files go (default: a new temporary directory)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _ranks(ranks: list[int]) -> list[int]:
    if any(r > codec.MAX_NDIM for r in ranks):
        raise ValueError(f"--ranks: a frame holds at most {codec.MAX_NDIM} dims, got {ranks}")
    return ranks


def _placed(nbytes: int, page_offset: int) -> torch.Tensor:
    """A uint8 buffer of ``nbytes`` that starts ``page_offset`` bytes past a 4 KiB page boundary."""
    raw = torch.ones(nbytes + 8192, dtype=torch.uint8)
    start = (page_offset - raw.data_ptr()) % 4096
    return raw[start : start + nbytes]


def _interleaved(variants: dict[str, Callable[[], None]], rounds: int) -> dict[str, float]:
    """Median seconds of each variant, the variants taking turns so drift hits them alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():  # warm the page cache and the destinations
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(xs) for name, xs in samples.items()}


def _reads(
    fds: Sequence[int], dests: Sequence[memoryview], offset: int, header: int = 0
) -> Callable[[], None]:
    """One thread reading every file: ``header`` bytes into a small buffer, then the payload."""
    head = bytearray(header)

    def read() -> None:
        for fd, dest in zip(fds, dests, strict=True):
            os.preadv(fd, [head, dest] if header else [dest], offset)

    return read


def _shape(rank: int, nbytes: int) -> tuple[int, ...]:
    """A float32 shape of ``rank`` dims holding ``nbytes``."""
    return (nbytes // 4 // 2 ** (rank - 1), *([2] * (rank - 1)))


async def _store_table(
    root: Path, ranks: Sequence[int], values: int, size: int, rounds: int
) -> dict[int, float]:
    """Median seconds of one ``read_into_many`` of every value, per rank."""
    out: dict[int, float] = {}
    for rank in ranks:
        shape = _shape(rank, size)
        nbytes = torch.Size(shape).numel() * 4
        store = await TensorStore.open((root / f"store-{rank}").as_uri())
        try:
            await store.put([(f"v{i}", torch.randn(shape)) for i in range(values)])
            buf = _placed(values * nbytes, STORE_PLACEMENT)
            outs = [buf[i * nbytes : (i + 1) * nbytes].view(torch.float32).view(shape) for i in range(values)]
            items = [(f"v{i}", outs[i]) for i in range(values)]
            times: list[float] = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                statuses = await store.read_into_many(items)
                times.append(time.perf_counter() - t0)
            if any(s is not Fetch.HIT for s in statuses):
                raise RuntimeError(f"rank {rank}: a stored frame did not read back: {statuses}")
            out[rank] = statistics.median(times[1:])
        finally:
            await store.close()
    return out


def _views(buf: torch.Tensor, values: int, size: int) -> list[memoryview]:
    return [codec.tensor_bytes(buf[i * size : (i + 1) * size]) for i in range(values)]


def bench(root: Path, values: int, size: int, ranks: Sequence[int], rounds: int) -> dict[str, Any]:
    size -= size % 4096  # every destination starts at the same place in its page
    files = []
    for i in range(values):
        path = root / f"raw-{i}"
        path.write_bytes(os.urandom(size + 4096))
        files.append(path)
    fds = [os.open(p, os.O_RDONLY) for p in files]
    try:
        paged = _views(_placed(values * size, 0), values, size)
        copy = _interleaved({str(d): _reads(fds, paged, (4096 - d) % 4096) for d in DISTANCES}, rounds)
        variants: dict[str, Callable[[], None]] = {}
        for placement in PLACEMENTS:
            dests = _views(_placed(values * size, placement), values, size)
            for rank in ranks:
                variants[f"v1-{rank}-{placement}"] = _reads(fds, dests, 0, _V1_FIELDS + 8 * rank)
                variants[f"v2-{rank}-{placement}"] = _reads(fds, dests, 0, codec.header_size(rank))
        by_rank = _interleaved(variants, rounds)
    finally:
        for fd in fds:
            os.close(fd)
    total = values * size
    stored = asyncio.run(_store_table(root, ranks, values, size, rounds))

    def rank_row(r: int) -> dict[str, Any]:
        row: dict[str, Any] = {"rank": r, "v1_header": _V1_FIELDS + 8 * r, "v2_header": codec.header_size(r)}
        for placement in PLACEMENTS:
            v1, v2 = by_rank[f"v1-{r}-{placement}"], by_rank[f"v2-{r}-{placement}"]
            row[f"page_offset_{placement}"] = {"v1_ms": v1 * 1e3, "v2_ms": v2 * 1e3, "v1_over_v2": v1 / v2}
        raw = by_rank[f"v2-{r}-{STORE_PLACEMENT}"]
        row["store"] = {
            "ms": stored[r] * 1e3,
            "gbps": total / stored[r] / 1e9,
            "over_raw": stored[r] / raw,
        }
        return row

    return {
        "values": values,
        "size": size,
        "rounds": rounds,
        "copy": [
            {
                "distance": d,
                "ms": copy[str(d)] * 1e3,
                "gbps": total / copy[str(d)] / 1e9,
                "slowdown": copy[str(d)] / copy["0"],
            }
            for d in DISTANCES
        ],
        "ranks": [rank_row(r) for r in ranks],
    }


def _print_human(result: dict[str, Any]) -> None:
    print(f"{result['values']} page-cached files of {human_size(result['size'])}, one thread, medians")
    print(f"{'dst-src mod 4096':>17} {'ms':>7} {'GB/s':>6} {'slowdown':>9}")
    for row in result["copy"]:
        print(f"{row['distance']:>17} {row['ms']:7.2f} {row['gbps']:6.2f} {row['slowdown']:8.2f}x")
    heads = " ".join(f"{'v1/v2 @' + str(p):>10}" for p in PLACEMENTS)
    print(f"{'rank':>5} {'v1 hdr':>7} {'v2 hdr':>7} {heads}", end="")
    print(f" {'store ms':>9} {'store GB/s':>11} {'store/raw':>10}")
    for row in result["ranks"]:
        ratios = " ".join(f"{row[f'page_offset_{p}']['v1_over_v2']:10.2f}" for p in PLACEMENTS)
        store = row["store"]
        print(
            f"{row['rank']:>5} {row['v1_header']:>7} {row['v2_header']:>7} {ratios}"
            f" {store['ms']:9.2f} {store['gbps']:11.2f} {store['over_raw']:9.2f}x"
        )


def run(args: argparse.Namespace) -> int:
    try:
        ranks = _ranks(args.ranks)
    except ValueError as exc:
        print(f"asyncconn bench align: {exc}")
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-align-", dir=args.dir))
    try:
        result = bench(workdir, args.values, args.size, ranks, args.rounds)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        _print_human(result)
    return 0
