from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from pathlib import Path

import pytest
import torch

from asyncconn.backend import open_backend
from asyncconn.exceptions import BackendUnavailable, ConfigError
from asyncconn.store import TensorStore
from backends.file import FileBackend


def _writer_process(root: str, seed: int, rounds: int) -> None:
    async def main() -> None:
        store = await TensorStore.open(f"file://{root}")
        t = torch.full((1 << 20,), float(seed))  # 4 MiB of one value: a torn file would mix seeds
        for _ in range(rounds):
            await store.put([("shared", t)])
        await store.close()

    asyncio.run(main())


async def test_racing_processes_leave_one_whole_value(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    os.makedirs(root)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer_process, args=(root, seed, 8)) for seed in (1, 2, 3)]
    for p in procs:
        p.start()
    store = await TensorStore.open(f"file://{root}")
    reads = 0
    out = torch.empty(1 << 20)
    while any(p.is_alive() for p in procs) or reads == 0:
        if await store.get_into("shared", out):
            reads += 1
            assert out.min() == out.max(), "torn read: values from two writers mixed"
        await asyncio.sleep(0.001)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    (final,) = await store.get(["shared"])
    assert final is not None and final.min() == final.max() and float(final[0]) in (1.0, 2.0, 3.0)
    leftovers = [p for p in Path(root).rglob(".tmp.*")]
    assert leftovers == []
    await store.close()


async def test_truncated_and_foreign_files_are_misses(tmp_path: Path) -> None:
    store = await TensorStore.open(f"file://{tmp_path}")
    backend = store.backend
    assert isinstance(backend, FileBackend)
    await store.put([("t", torch.randn(1000))])
    path = backend.path_for("t")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert await store.get(["t"]) == [None]
    assert not await store.get_into("t", torch.empty(1000))
    path.write_bytes(b"#!/bin/sh\necho not a frame\n")
    assert await store.get(["t"]) == [None]
    assert store.stats.corrupt == 3
    await store.close()


async def test_read_only_root_is_backend_unavailable(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        # root ignores permission bits; use a path under a regular file instead
        blocker = tmp_path / "file"
        blocker.write_text("x")
        with pytest.raises((BackendUnavailable, ConfigError)):
            await open_backend(f"file://{blocker}/store")
        return
    root = tmp_path / "ro"
    root.mkdir()
    root.chmod(0o500)
    b = await open_backend(f"file://{root}")
    with pytest.raises(BackendUnavailable):
        await b.put([("k", b"v")])
    await b.close()


async def test_bad_file_urls() -> None:
    for url in ("file://", "file://remotehost/x", "file:///tmp/x?workers=0", "file:///tmp/x?fsync=maybe"):
        with pytest.raises(ConfigError):
            await open_backend(url)


async def test_cancelled_direct_read_waits_for_the_thread(tmp_path: Path) -> None:
    """A timeout must not hand a buffer back while a pool thread still writes into it."""
    backend = FileBackend(tmp_path, workers=1, inline_reads=False)  # the pool path (inline reads never wait)
    value = os.urandom(8 << 20)
    await backend.put([("big", value)])
    buf = bytearray(len(value))
    task = asyncio.ensure_future(backend.get_into("big", [memoryview(buf)]))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The read finished before the cancellation was let through: no thread is writing now.
    snapshot = bytes(buf)
    await asyncio.sleep(0.05)
    assert bytes(buf) == snapshot
    await backend.close()


async def test_keys_map_to_bounded_fanout(tmp_path: Path) -> None:
    b = FileBackend(tmp_path)
    await b.put([(f"key-{i}", b"x") for i in range(200)])
    dirs = {p.parent for p in tmp_path.rglob("*") if p.is_file()}
    assert all(len(d.name) == 2 for d in dirs) and len(dirs) <= 256
    await b.close()


@pytest.mark.parametrize("query", ["", "?inline_reads=false", "?read_threads=1"])
@pytest.mark.parametrize("n", [1000, 3 << 20])
async def test_direct_reads_on_every_path(tmp_path: Path, query: str, n: int) -> None:
    """Page-cached values are read on the loop (RWF_NOWAIT, split over threads when large); with inline
    reads off, on the pool. Every path lands the same bytes and validates them."""
    store = await TensorStore.open(f"file://{tmp_path}{query}")
    t = torch.randn(n)
    await store.put([("k", t)])
    out = torch.empty(n)
    assert await store.get_into("k", out) and torch.equal(out, t)
    backend = store.backend
    assert isinstance(backend, FileBackend)
    path = backend.path_for("k")
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not await store.get_into("k", out)
    assert store.stats.corrupt == 1
    await store.close()
