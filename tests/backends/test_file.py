from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from asyncconn_backends.file import FileBackend, SweepReport

from asyncconn.backend import open_backend
from asyncconn.exceptions import BackendError, BackendUnavailable, ConfigError
from asyncconn.store import TensorStore


def _writer_process(root: str, seed: int, rounds: int) -> None:
    async def main() -> None:
        store = await TensorStore.open(f"file://{root}")
        t = torch.full((1 << 20,), float(seed))  # 4 MiB of one value: a torn file would mix seeds
        for _ in range(rounds):
            await store.put([("shared", t)])
        await store.close()

    asyncio.run(main())


@pytest.mark.slow
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


# -- dead writers' temporary files, and the size bound -------------------------------------------------------
_STALLED_WRITER = """
import os, sys, time
from asyncconn_backends.file import FileBackend

real_write = os.write

def stalled(fd, data):
    n = real_write(fd, data[:4096])  # part of the value lands in the temporary file ...
    print("writing", flush=True)
    time.sleep(3600)  # ... and the writer is killed here
    return n

os.write = stalled
FileBackend(sys.argv[1])._write("k", b"x" * 100_000)
"""


def _start_stalled_writer(root: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    child = subprocess.Popen(
        [sys.executable, "-c", _STALLED_WRITER, str(root)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert child.stdout is not None and child.stdout.readline() == "writing\n"
    return child


def _temps(root: Path) -> list[Path]:
    return list(root.rglob(".tmp.*"))


def _kill(child: subprocess.Popen[str]) -> None:
    child.send_signal(signal.SIGKILL)
    child.wait(10)
    assert child.stdout is not None
    child.stdout.close()


@pytest.mark.slow  # starts Python subprocesses: seconds each
async def test_a_writer_killed_mid_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    """SIGKILL a real writer process mid-write: its temporary file goes when the store is next opened."""
    root = tmp_path / "store"
    child = _start_stalled_writer(root)
    try:
        (temp,) = _temps(root)
        assert temp.stat().st_size == 4096
        live = await open_backend(f"file://{root}")  # opening sweeps, but this writer is alive
        assert isinstance(live, FileBackend)
        assert await live.sweep() == SweepReport(stored_bytes=4096, evicted=0, temp_removed=0)
        assert _temps(root) == [temp]
        await live.close()
    finally:
        _kill(child)
    assert _temps(root) == [temp]  # nothing in the kernel or the library removes it by itself
    backend = await open_backend(f"file://{root}")
    try:
        assert _temps(root) == []
        assert await backend.exists(["k"]) == [False]
    finally:
        await backend.close()


@pytest.mark.slow  # starts Python subprocesses: seconds each
async def test_dead_writers_temporary_files_are_removed_over_time(tmp_path: Path) -> None:
    """A store kept open removes a killed writer's temporary file within a sweep interval or two."""
    root = tmp_path / "store"
    backend = await open_backend(f"file://{root}?sweep_interval=100ms")
    try:
        child = _start_stalled_writer(root)
        await asyncio.sleep(0.3)
        assert len(_temps(root)) == 1  # alive: never touched
        _kill(child)
        for _ in range(100):
            if not _temps(root):
                break
            await asyncio.sleep(0.05)
        assert _temps(root) == []
        await backend.put([("after", b"v")])  # and the store still works
        assert await backend.exists(["after"]) == [True]
    finally:
        await backend.close()


_READER = """
import asyncio, sys
from asyncconn.backend import open_backend

async def main():
    backend = await open_backend("file://" + sys.argv[1])
    got = await backend.get(["v0"])
    await backend.close()
    print("hit" if got[0] is not None else "miss", flush=True)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_max_bytes_evicts_least_recently_used_across_processes(tmp_path: Path) -> None:
    """Ten 100 KiB values in a 512 KiB store: the ones read (by another process, too) stay, the rest go."""
    root = tmp_path / "store"
    url = f"file://{root}?max_bytes=512KiB&sweep_interval=3600s"  # sweeps run only when writes pass the bound
    writer = await open_backend(url)
    assert isinstance(writer, FileBackend)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    try:
        values = {f"v{i}": os.urandom(100 << 10) for i in range(10)}
        for i, (key, value) in enumerate(values.items()):
            await writer.put([(key, value)])
            if i % 2 == 1:
                # "v0" is read by another process (an E or PD instance sharing the directory) ...
                out = subprocess.run(
                    [sys.executable, "-c", _READER, str(root)], capture_output=True, text=True, env=env
                )
                assert out.stdout == "hit\n", out.stderr
                # ... and "v1" by this one; a second later each read counts as a new use.
                assert (await writer.get(["v1"]))[0] is not None
            await asyncio.sleep(1.05)
        report = await writer.sweep()
        assert report is not None and report.stored_bytes <= 512 << 10
        present = await writer.exists(list(values))
        kept = [key for key, there in zip(values, present, strict=True) if there]
        assert "v0" in kept and "v1" in kept and "v9" in kept and "v2" not in kept
        for key in kept:
            assert b"".join(bytes(c) for c in (await writer.get([key]))[0] or ()) == values[key]
        with pytest.raises(BackendError, match="over max_bytes"):
            await writer.put([("huge", os.urandom(600 << 10))])
    finally:
        await writer.close()


async def test_the_default_store_is_bounded() -> None:
    from asyncconn.config import DEFAULT_BACKEND_URL
    from asyncconn.url import parse_size, parse_url

    opts = parse_url(DEFAULT_BACKEND_URL).options(FileBackend.params)
    assert 0 < opts["max_bytes"] <= parse_size("16GiB")


async def test_cached_only_reads_come_from_the_page_cache_or_not_at_all(tmp_path: Path) -> None:
    """``cached_only`` (in-place KV loads) uses preadv(RWF_NOWAIT): a page-cached value is served; with
    ``inline_reads=false`` (a network filesystem, where the page cache cannot be trusted to answer without
    waiting) nothing is, and nothing is written. A value evicted from the page cache is NOT_CACHED too
    (it comes back once a plain read has cached it again)."""
    from asyncconn.backend import NOT_CACHED

    value = os.urandom(1 << 20)
    on = FileBackend(tmp_path / "on")
    off = FileBackend(tmp_path / "off", inline_reads=False)
    for backend in (on, off):
        await backend.put([("v", value)])
    buf = bytearray(len(value))
    assert await on.get_into_many([("v", [memoryview(buf)], None)], cached_only=True) == [len(value)]
    assert bytes(buf) == value
    buf = bytearray(len(value))
    assert await off.get_into_many([("v", [memoryview(buf)], None)], cached_only=True) == [NOT_CACHED]
    assert bytes(buf) == bytes(len(value))
    path = on.path_for("v")
    in_memory = _fs_type(path) in ("tmpfs", "ramfs")  # its pages are the file: never evicted
    for _ in range(50):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        got = await on.get_into_many([("v", [memoryview(bytearray(len(value)))], None)], cached_only=True)
        if in_memory or got == [NOT_CACHED]:
            break
        # DONTNEED is best effort: the kernel skips pages something holds a moment (reclaim, a DAMON
        # scan), and then every page may still be there. Evict again.
        await asyncio.sleep(0.02)
    if in_memory:
        assert got == [len(value)]
    else:
        assert got == [NOT_CACHED]
        await on.get_into_many([("v", [memoryview(bytearray(len(value)))], None)])  # a plain read caches it
        again = await on.get_into_many([("v", [memoryview(buf)], None)], cached_only=True)
        assert again == [len(value)] and bytes(buf) == value
    await on.close()
    await off.close()


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/self/mounts)."""
    best, kind = "", ""
    target = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            point = fields[1]
            if (target == point or target.startswith(point.rstrip("/") + "/")) and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


@pytest.mark.parametrize("step", [1, 5, 4096])
def test_a_read_that_comes_back_short_is_continued_into_the_right_places(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: int
) -> None:
    """preadv may return fewer bytes than asked (a signal, a filesystem's own limit): the rest must land
    where it belongs across the pieces, not be dropped or shifted."""
    import asyncconn_backends.file as file_backend

    data = bytes(range(256)) * 40
    path = tmp_path / "value"
    path.write_bytes(data)
    real = os.preadv

    def short(fd: int, views: list[memoryview], offset: int, *flags: int) -> int:
        first = views[0][: min(step, views[0].nbytes)]
        return real(fd, [first], offset, *flags)

    monkeypatch.setattr(file_backend.os, "preadv", short)
    pieces = [bytearray(n) for n in (7, 0, 1000, 3, len(data) - 1010)]
    fd = os.open(path, os.O_RDONLY)
    try:
        got = file_backend._pread_exact(fd, [memoryview(p) for p in pieces], 0)
        assert got == len(data)
        assert b"".join(pieces) == data
        longer = [bytearray(len(data) + 9)]  # the file ends first: the bytes there are, then stop
        assert file_backend._pread_exact(fd, [memoryview(b) for b in longer], 0) == len(data)
        assert bytes(longer[0][: len(data)]) == data
    finally:
        os.close(fd)


async def test_a_batch_is_shared_by_the_read_threads_value_by_value(tmp_path: Path) -> None:
    """One ``get_into_many`` call is read by the pool thread and its helper, each taking the next value:
    a thread that is slowed down takes fewer values (halves fixed up front would give it half), and every
    value still lands whole in its own destination."""
    import threading

    backend = FileBackend(tmp_path, read_threads=2)
    values = [os.urandom(4096 + i) for i in range(24)]
    await backend.put([(f"v{i}", v) for i, v in enumerate(values)])
    readers: list[str] = []
    # The helper waits at its first value until the pool thread has taken one: on a busy box the pool
    # thread, descheduled right after starting its helper, could otherwise find every value taken.
    pool_started = threading.Event()

    def sink_of(i: int):  # type: ignore[no-untyped-def]
        def sink(piece: memoryview) -> None:
            name = threading.current_thread().name
            if piece.nbytes and not name.startswith("asyncconn-file-aux"):
                readers.append("pool")
                pool_started.set()
                time.sleep(0.02)  # the pool thread is the slow one
            elif piece.nbytes:
                pool_started.wait(5)
                readers.append("helper")

        return sink

    bufs = [bytearray(len(v)) for v in values]
    reads = [(f"v{i}", [memoryview(b)], sink_of(i)) for i, b in enumerate(bufs)]
    got = await backend.get_into_many(reads, cached_only=True)
    assert got == [len(v) for v in values]
    assert [bytes(b) for b in bufs] == values
    assert readers.count("helper") >= 16 and readers.count("pool") >= 1, readers
    await backend.close()


async def test_a_failing_read_fails_the_shared_batch_once_every_thread_has_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read error on one thread of a shared batch fails the call (as ``BackendError``) only after the
    other thread has stopped writing: no destination changes after the call has raised."""
    import errno

    backend = FileBackend(tmp_path, read_threads=2, inline_reads=False)
    values = [os.urandom(8192) for _ in range(40)]
    await backend.put([(f"v{i}", v) for i, v in enumerate(values)])
    real = FileBackend._read_into

    def failing(self: FileBackend, key: str, *args: object, **kwargs: object) -> int | None:
        if key == "v5":
            raise OSError(errno.EIO, "I/O error")
        time.sleep(0.002)
        return real(self, key, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(FileBackend, "_read_into", failing)
    bufs = [bytearray(len(v)) for v in values]
    with pytest.raises(BackendError, match="I/O error"):
        await backend.get_into_many([(f"v{i}", [memoryview(b)], None) for i, b in enumerate(bufs)])
    snapshot = [bytes(b) for b in bufs]
    await asyncio.sleep(0.05)
    assert [bytes(b) for b in bufs] == snapshot
    assert any(bytes(b) == bytes(len(b)) for b in bufs)  # it stopped early: some values were never read
    await backend.close()
