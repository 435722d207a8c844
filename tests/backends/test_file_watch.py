"""``FileBackend.watch_removals``: every value removed from a ``file://`` directory by any process on this
host reaches ``on_removed`` (Linux inotify, ``backends/dirwatch.py``), once, on the loop thread; writes
and writers' temporary files are not removals; the watch's descriptor is released on unwatch and close.
"""

from __future__ import annotations

import asyncio
import logging
import os
import struct
import sys
import textwrap
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from asyncconn_backends import dirwatch
from asyncconn_backends.file import FileBackend

from asyncconn.backend import open_backend
from tests.descriptors import open_descriptors


class _Heard:
    def __init__(self) -> None:
        self.keys: list[str] = []
        self.threads: set[int] = set()

    def __call__(self, keys: Sequence[str]) -> None:
        self.keys.extend(keys)
        self.threads.add(threading.get_ident())

    async def until(self, wanted: set[str], settle: float = 0.2) -> list[str]:
        """Every key heard once ``wanted`` all were (or after 5 s), plus what came in ``settle`` more."""
        for _ in range(500):
            if wanted <= set(self.keys):
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(settle)
        return sorted(self.keys)


async def _watching(root: Path, max_bytes: int = 0) -> tuple[FileBackend, _Heard]:
    # Built without from_url: no sweeper task, so the only sweeps are the ones a test runs.
    backend = FileBackend(root, max_bytes=max_bytes)
    heard = _Heard()
    backend.on_removed = heard
    assert backend.watch_removals()
    return backend, heard


async def _other_process(script: str) -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", textwrap.dedent(script))
    assert await asyncio.wait_for(proc.wait(), 120) == 0


async def test_removals_by_another_process_and_by_hand_are_heard_once_and_writes_are_not(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    watcher, heard = await _watching(root)
    writer = await open_backend(f"file://{root}?sweep_interval=1h")
    keys = [f"v{i}" for i in range(6)]
    try:
        await writer.put([(k, os.urandom(4000)) for k in keys])
        await writer.put([("v5", os.urandom(4000))])  # a rewrite (a rename over the value) is no removal
        for age, key in enumerate(keys[:4]):  # v0 used longest ago
            t = 1_000_000 + age
            os.utime(watcher.path_for(key), (t, t))
        # Another process: its store sweeps at open (max_bytes: the two least recently used go), then
        # deletes one value.
        await _other_process(f"""
            import asyncio
            from asyncconn.backend import open_backend

            async def main():
                store = await open_backend("file://{root}?max_bytes=18000&sweep_interval=1h")
                assert await store.delete(["v2"]) == 1
                await store.close()

            asyncio.run(main())
        """)
        watcher.path_for("v3").unlink()  # by hand, in this process
        assert await heard.until({"v0", "v1", "v2", "v3"}) == ["v0", "v1", "v2", "v3"]
        assert heard.threads == {threading.get_ident()}  # the loop's thread (this test's)
        assert await watcher.exists(keys) == [False, False, False, False, True, True]
    finally:
        await writer.close()
        await watcher.close()


async def test_the_watching_stores_own_sweep_is_heard_once(tmp_path: Path) -> None:
    watcher, heard = await _watching(tmp_path / "s", max_bytes=10000)
    try:
        await watcher.put([(k, os.urandom(4000)) for k in ("a", "b", "c")])
        os.utime(watcher.path_for("a"), (1_000_000, 1_000_000))
        report = await watcher.sweep()
        assert report is not None and report.removed == ("a",)
        assert await heard.until({"a"}) == ["a"]
    finally:
        await watcher.close()


async def test_a_key_directory_made_after_the_watch_started_is_watched(tmp_path: Path) -> None:
    root = tmp_path / "fresh"
    watcher, heard = await _watching(root)  # an empty root: no key directory yet
    try:
        await watcher.put([("k", b"x" * 100)])
        await asyncio.sleep(0.05)  # the key directory's creation reaches the watch
        os.unlink(watcher.path_for("k"))
        assert await heard.until({"k"}) == ["k"]
    finally:
        await watcher.close()


async def test_unwatch_and_close_release_the_watch(tmp_path: Path) -> None:
    before = open_descriptors()
    watcher, heard = await _watching(tmp_path / "s", max_bytes=10000)
    try:
        assert open_descriptors() == before + 1  # one inotify descriptor for the root and its key directories
        watcher.unwatch_removals()
        assert open_descriptors() == before
        await watcher.put([(k, os.urandom(4000)) for k in ("a", "b", "c")])
        os.utime(watcher.path_for("a"), (1_000_000, 1_000_000))
        await watcher.sweep()  # its own sweep: heard as before the watch
        os.unlink(watcher.path_for("b"))  # by hand: not heard any more
        assert await heard.until({"a"}) == ["a"]
        assert watcher.watch_removals() and open_descriptors() == before + 1
    finally:
        await watcher.close()
    assert open_descriptors() == before


async def test_without_inotify_nothing_is_watched_and_sweeps_are_heard_as_before(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dirwatch, "_libc", lambda: None)
    backend = FileBackend(tmp_path / "s", max_bytes=10000)
    heard = _Heard()
    backend.on_removed = heard
    try:
        assert not backend.watch_removals()
        await backend.put([(k, os.urandom(4000)) for k in ("a", "b", "c")])
        os.utime(backend.path_for("a"), (1_000_000, 1_000_000))
        await backend.sweep()
        assert heard.keys == ["a"]
    finally:
        await backend.close()


async def test_an_overflowed_queue_is_counted_and_logged_and_hears_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The kernel's queue overflowed (``IN_Q_OVERFLOW``, wd -1): removals were lost -- counted, logged,
    and nothing made up; the events after it in the same read are still acted on."""
    gone: list[list[str]] = []
    (tmp_path / "ab").mkdir()
    watch = dirwatch.DirectoryWatch(str(tmp_path), gone.append)
    assert watch.start()
    try:
        wd = next(wd for wd, path in watch._dirs.items() if path.endswith("/ab"))
        name = b"key\0\0\0\0\0"
        overflow = struct.pack("iIII", -1, dirwatch._IN_Q_OVERFLOW, 0, 0)
        deleted = struct.pack("iIII", wd, dirwatch._IN_DELETE, 0, len(name)) + name
        with caplog.at_level(logging.WARNING):
            watch._take(overflow + deleted)
        assert watch.overflows == 1 and "overflowed" in caplog.text
        assert gone == [[f"{tmp_path}/ab/key"]]
    finally:
        watch.close()


async def test_a_directory_that_cannot_be_watched_answers_false_and_leaves_nothing_open(
    tmp_path: Path,
) -> None:
    backend = FileBackend(tmp_path / "gone")
    (tmp_path / "gone").rmdir()  # the root went away under the store
    before = open_descriptors()
    try:
        assert not backend.watch_removals()
        assert open_descriptors() == before
    finally:
        await backend.close()
