"""A local ``file://`` store in front of a shared one (``local_store_url``): reads, fills, writes, faults.

A read served locally is proved to not touch the shared store by killing its redis-server and reading equal
bytes back; a value read from the shared store is proved written locally by finding its file and reading it
back with the shared store gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
from asyncconn_backends.file import FileBackend
from asyncconn_backends.memory import MemoryBackend

from asyncconn import layered as layered_module
from asyncconn.backend import NOT_CACHED, Buffer, IntoRead, Value
from asyncconn.config import Settings
from asyncconn.exceptions import BackendError, BackendUnavailable, ConfigError
from asyncconn.hosttier import HostTier
from asyncconn.layered import LayeredBackend
from asyncconn.store import Fetch, TensorStore
from asyncconn.url import parse_url
from tests.servers import RedisServer


async def _open(tmp_path: Path, redis: RedisServer, **kwargs: int) -> TensorStore:
    return await TensorStore.open(
        f"{redis.url}?timeout=2", timeout=2.0, local_url=f"file://{tmp_path / 'local'}", **kwargs
    )


async def test_a_saved_value_is_read_locally_with_the_shared_store_gone(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    store = await _open(tmp_path, fresh_redis)
    layered = store.layered
    assert layered is not None and store.host_tier is None
    value = torch.randn(4096)
    await store.put([("kv", value)])
    assert await layered.shared.exists(["kv"]) == [True]  # written to both
    assert await layered.local.exists(["kv"]) == [True]
    fresh_redis.kill()
    out = torch.empty(4096)
    assert await store.read_into_many([("kv", out)]) == [Fetch.HIT]
    assert torch.equal(out, value)
    assert layered.stats.local_hits == 1 and layered.stats.local_misses == 0
    with pytest.raises(BackendError):  # a local miss does go to the (gone) shared store
        await store.read_into_many([("other", torch.empty(4096))])
    await store.close()


async def test_a_value_read_from_the_shared_store_is_written_locally(
    tmp_path: Path, fresh_redis: RedisServer
) -> None:
    first = await TensorStore.open(f"{fresh_redis.url}?timeout=2", timeout=2.0)  # another host's save
    value = torch.randn(2, 512)
    await first.put([("kv", value)])
    await first.close()

    store = await _open(tmp_path, fresh_redis)
    layered = store.layered
    assert layered is not None
    assert await layered.local.exists(["kv"]) == [False]
    out = torch.empty(2, 512)
    assert await store.read_into_many([("kv", out)]) == [Fetch.HIT] and torch.equal(out, value)
    await layered.wait_fills()  # written in the background, after the read returned
    assert layered.stats.local_misses == 1 and layered.stats.fills == 1
    assert await layered.local.exists(["kv"]) == [True]
    fresh_redis.kill()  # from now on only the local copy can answer
    again = torch.empty(2, 512)
    assert await store.read_into("kv", again) is Fetch.HIT and torch.equal(again, value)
    assert layered.stats.local_hits == 1
    await store.close()


async def test_exists_asks_the_shared_store_only(tmp_path: Path, redis_server: RedisServer) -> None:
    """A value only this host's disk still holds is not a hit: saves would skip it and leave the fleet
    without it."""
    store = await _open(tmp_path, redis_server)
    layered = store.layered
    assert layered is not None
    await store.put([("only-local", torch.ones(8))])
    await layered.shared.delete(["only-local"])  # expired from the shared store
    assert await store.exists(["only-local"]) == [False]
    await store.delete(["only-local"])
    assert await layered.local.exists(["only-local"]) == [False]  # delete reaches both
    await store.close()


async def test_a_write_the_shared_store_refused_is_not_kept_locally(tmp_path: Path) -> None:
    class Refusing(MemoryBackend):
        async def put(self, items: object) -> None:
            raise BackendUnavailable("shared store down")

    local = FileBackend(tmp_path / "local")
    layered = LayeredBackend(local, Refusing())
    with pytest.raises(BackendUnavailable):
        await layered.put([("k", b"x" * 100)])
    assert await local.exists(["k"]) == [False]
    await layered.close()


async def test_a_failing_local_store_costs_only_speed(tmp_path: Path) -> None:
    """The local disk failing (full, gone) is counted and the shared store serves: never an error."""

    class Broken(FileBackend):
        async def put(self, items: object) -> None:
            raise BackendError("disk full")

        async def get_into_many(self, reads: object, *, cached_only: bool = False) -> list[int | None]:
            raise BackendError("I/O error")

    shared = MemoryBackend()
    layered = LayeredBackend(Broken(tmp_path / "local"), shared)
    await layered.put([("k", b"v" * 64)])  # the shared store has it: no error
    assert await shared.exists(["k"]) == [True]
    dest = bytearray(64)
    assert await layered.get_into_many([("k", [memoryview(dest)], None)]) == [64]
    assert bytes(dest) == b"v" * 64
    await layered.wait_fills()
    assert layered.stats.local_errors == 3  # the put, the read, the fill
    await layered.close()


async def test_cached_only_reads_are_the_local_stores_and_a_miss_is_asked_again(tmp_path: Path) -> None:
    """In-place loads (cached_only) read only what the local disk holds in memory; anything else comes
    back NOT_CACHED and is read again through staging, from the shared store if need be."""
    shared = MemoryBackend()
    layered = LayeredBackend(FileBackend(tmp_path / "local"), shared)
    await shared.put([("far", b"f" * 32)])
    await layered.put([("near", b"n" * 32)])
    near, far = bytearray(32), bytearray(32)
    got = await layered.get_into_many(
        [("near", [memoryview(near)], None), ("far", [memoryview(far)], None)], cached_only=True
    )
    assert got[1] == NOT_CACHED and got[0] in (32, NOT_CACHED)  # page cache permitting
    assert await layered.get_into_many([("far", [memoryview(far)], None)]) == [32]
    await layered.wait_fills()
    assert bytes(far) == b"f" * 32 and layered.stats.fills == 1
    await layered.close()


async def test_the_host_tier_sits_in_front_of_the_layered_store(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    store = await _open(tmp_path, redis_server, host_cache_bytes=1 << 20)
    assert store.host_tier is not None and store.layered is store.host_tier.inner
    value = torch.randn(256)
    await store.put([("tiered", value)])
    out = torch.empty(256)
    assert await store.read_into("tiered", out) is Fetch.HIT and torch.equal(out, value)
    assert store.host_tier.stats.hits == 1  # served from memory, neither store asked
    assert store.layered is not None and store.layered.stats.local_hits == 0
    await store.close()


def test_local_store_url_must_be_a_file_url() -> None:
    assert Settings.from_extra_config({"local_store_url": "file:///nvme/kv?max_bytes=1GiB"}).local_store_url
    assert Settings.from_extra_config({}).local_store_url is None
    with pytest.raises(ConfigError, match="local_store_url"):
        Settings.from_extra_config({"local_store_url": "redis://127.0.0.1:6379"})
    with pytest.raises(ConfigError, match="local_store_url"):
        Settings.from_extra_config({"local_store_url": "file:///x?no_such_param=1"})


async def test_wrappers_are_not_opened_from_urls_and_report_the_wrapped_stores_removals(
    tmp_path: Path,
) -> None:
    """``WrappingBackend``: the host tier and the layered store refuse ``from_url`` and hand ``on_removed``
    to the store whose removals they report (the shared one; the tier's inner one)."""
    local, shared = FileBackend(tmp_path / "local"), MemoryBackend()
    layered = LayeredBackend(local, shared)
    tier = HostTier(layered, 1 << 16)
    told: list[str] = []
    tier.on_removed = told.extend
    assert shared.on_removed == told.extend and local.on_removed is None
    assert tier.on_removed == told.extend and layered.on_removed == told.extend
    layered.on_removed = None
    assert shared.on_removed is None and tier.on_removed is None
    url = parse_url("memory://")
    with pytest.raises(TypeError, match=r"a LayeredBackend joins two open backends: LayeredBackend\("):
        await LayeredBackend.from_url(url)
    with pytest.raises(TypeError, match=r"a HostTier wraps an open backend: HostTier\(backend, capacity\)"):
        await HostTier.from_url(url)
    await tier.close()


# -- fills in the background -------------------------------------------------------------------------------
# Deterministic: the local store's writes (or the shared store's reads) wait on events the test sets; a
# wait_for guards only against a hang of the code under test.


class GatedLocal(MemoryBackend):
    """A local store whose first ``gated`` writes wait for ``gate`` (``entered`` is set when one does)."""

    def __init__(self, gated: int = 1) -> None:
        super().__init__()
        self.gated = gated
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        if self.gated:
            self.gated -= 1
            self.entered.set()
            await self.gate.wait()
        await super().put(items)


class GatedShared(MemoryBackend):
    """A shared store whose reads, once they have read, wait for ``gate`` before they return."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = asyncio.Event()
        self.gate = asyncio.Event()

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        found = await super().get(keys)
        self.entered.set()
        await self.gate.wait()
        return found


def _read(key: str, dest: bytearray) -> IntoRead:
    return (key, [memoryview(dest)], None)


async def _spin(times: int = 20) -> None:
    """Let every ready task run a few steps (no clock involved)."""
    for _ in range(times):
        await asyncio.sleep(0)


def _fill_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == "asyncconn-local-fill" and not t.done()]


async def test_a_read_returns_while_its_local_write_is_still_blocked() -> None:
    """The load never waits for the local disk, and what is written is a copy of what landed: the caller
    reuses its buffers as soon as the read returns."""
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("k", b"s" * 64)])
    dest = bytearray(64)
    assert await asyncio.wait_for(layered.get_into_many([_read("k", dest)]), 5) == [64]
    assert bytes(dest) == b"s" * 64
    dest[:] = b"x" * 64  # the caller's buffer, reused
    await asyncio.wait_for(local.entered.wait(), 5)
    assert layered.stats.fills == 0 and not local.gate.is_set()  # the write is still blocked
    assert await local.exists(["k"]) == [False]
    local.gate.set()
    await layered.wait_fills()
    assert layered.stats.fills == 1 and layered.stats.local_misses == 1
    assert await local.get(["k"]) == [(b"s" * 64,)]
    assert not _fill_tasks()
    await layered.close()


async def test_get_fills_in_the_background_too() -> None:
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("k", b"g" * 32)])
    assert await asyncio.wait_for(layered.get(["k", "none"]), 5) == [(b"g" * 32,), None]
    await asyncio.wait_for(local.entered.wait(), 5)
    assert layered.stats.fills == 0
    local.gate.set()
    await layered.wait_fills()
    assert await local.get(["k"]) == [(b"g" * 32,)] and layered.stats.fills == 1
    await layered.close()


async def test_a_delete_waits_for_a_fill_writing_its_key_and_wins() -> None:
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("k", b"v" * 16)])
    await layered.get_into_many([_read("k", bytearray(16))])
    await asyncio.wait_for(local.entered.wait(), 5)  # the fill is writing
    deleting = asyncio.create_task(layered.delete(["k"]))
    await _spin()
    assert not deleting.done()  # waits for the write under way, which it cannot take back
    local.gate.set()
    assert await asyncio.wait_for(deleting, 5) == 1
    assert await local.exists(["k"]) == [False] and await shared.exists(["k"]) == [False]
    await layered.wait_fills()
    assert await local.exists(["k"]) == [False]
    await layered.close()


async def test_a_delete_drops_a_fill_not_yet_writing() -> None:
    """The fill's task gets to run while the delete waits for the shared store (after the local copy is
    gone): it must not write the value back."""

    class SlowDeletes(MemoryBackend):
        gate = asyncio.Event()

        async def delete(self, keys: Sequence[str]) -> int:
            await self.gate.wait()
            return await super().delete(keys)

    local, shared = MemoryBackend(), SlowDeletes()
    layered = LayeredBackend(local, shared)
    await shared.put([("k", b"v" * 16)])

    async def read_then_delete() -> int:
        await layered.get_into_many([_read("k", bytearray(16))])
        return await layered.delete(["k"])  # at once: the fill's task has not run yet

    deleting = asyncio.create_task(read_then_delete())
    await _spin()  # the fill's task runs while the delete waits
    assert not deleting.done() and await local.exists(["k"]) == [False]
    shared.gate.set()
    assert await asyncio.wait_for(deleting, 5) == 1
    await layered.wait_fills()
    assert await local.exists(["k"]) == [False] and layered.stats.fills == 0
    await layered.close()


async def test_a_value_read_before_a_delete_ended_is_not_filled_after_it() -> None:
    """A read that fetched the value, then a whole delete, then the read returns: its fill is dropped."""
    local, shared = MemoryBackend(), GatedShared()
    layered = LayeredBackend(local, shared)
    await MemoryBackend.put(shared, [("k", b"v" * 16)])
    reading = asyncio.create_task(layered.get(["k"]))
    await asyncio.wait_for(shared.entered.wait(), 5)  # fetched, not yet returned
    assert await layered.delete(["k"]) == 1
    shared.gate.set()
    assert await asyncio.wait_for(reading, 5) == [(b"v" * 16,)]  # read before the delete: served
    await layered.wait_fills()
    assert await local.exists(["k"]) == [False] and layered.stats.fills == 0
    # nothing kept once no read or fill is under way
    assert not (layered._invalidated or layered._since or layered._filling or layered._changing)
    await layered.close()


async def test_a_put_during_a_fill_of_its_key_is_not_overwritten_by_the_older_value() -> None:
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("k", b"a" * 8)])
    await layered.get_into_many([_read("k", bytearray(8))])
    await asyncio.wait_for(local.entered.wait(), 5)  # the fill of "a" is writing
    putting = asyncio.create_task(layered.put([("k", b"b" * 8)]))
    await _spin()
    assert not putting.done()
    local.gate.set()
    await asyncio.wait_for(putting, 5)
    await layered.wait_fills()
    assert await local.get(["k"]) == [(b"b" * 8,)] and await shared.get(["k"]) == [(b"b" * 8,)]
    await layered.close()


async def test_a_write_the_shared_store_refused_is_not_brought_back_by_a_late_fill() -> None:
    """A read fetched the value; a put of the key fails in the shared store (the local copy is removed);
    then the read returns: its fill must not put a copy back."""

    class RefusingPuts(GatedShared):
        async def put(self, items: Sequence[tuple[str, Value]]) -> None:
            raise BackendUnavailable("shared store down")

    local, shared = MemoryBackend(), RefusingPuts()
    layered = LayeredBackend(local, shared)
    await MemoryBackend.put(shared, [("k", b"old" * 4)])
    dest = bytearray(12)
    reading = asyncio.create_task(layered.get_into_many([_read("k", dest)]))
    await asyncio.wait_for(shared.entered.wait(), 5)
    with pytest.raises(BackendUnavailable):
        await layered.put([("k", b"new" * 4)])
    assert await local.exists(["k"]) == [False]
    shared.gate.set()
    assert await asyncio.wait_for(reading, 5) == [12]
    await layered.wait_fills()
    assert await local.exists(["k"]) == [False] and layered.stats.fills == 0
    await layered.close()


async def test_fills_past_the_bound_are_skipped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layered_module, "FILL_BYTES_IN_FLIGHT", 100)
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([(f"k{i}", bytes([i]) * 60) for i in range(3)])
    dests = [bytearray(60) for _ in range(3)]
    reads = [_read(f"k{i}", dests[i]) for i in range(3)]
    assert await asyncio.wait_for(layered.get_into_many(reads), 5) == [60, 60, 60]  # never waits for room
    assert layered.stats.fills_skipped == 2  # 60 bytes in flight: neither other value fits under 100
    await asyncio.wait_for(local.entered.wait(), 5)
    assert await asyncio.wait_for(layered.get_into_many([_read("k1", bytearray(60))]), 5) == [60]
    assert layered.stats.fills_skipped == 3  # still full while the first write is blocked
    local.gate.set()
    await layered.wait_fills()
    assert layered.stats.fills == 1 and await local.exists(["k0", "k1", "k2"]) == [True, False, False]
    assert await layered.get_into_many([_read("k1", bytearray(60))]) == [60]  # room again
    await layered.wait_fills()
    assert layered.stats.fills == 2 and await local.exists(["k1"]) == [True]
    assert layered.stats.as_dict()["fills_skipped"] == 3
    await layered.close()


async def test_close_lets_a_writing_fill_end_and_drops_the_rest() -> None:
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("a", b"a" * 8), ("b", b"b" * 8)])
    await layered.get_into_many([_read("a", bytearray(8))])
    await asyncio.wait_for(local.entered.wait(), 5)  # the fill of "a" is writing

    async def read_then_close() -> None:
        await layered.get_into_many([_read("b", bytearray(8))])
        await layered.close()  # at once: the fill of "b" has not started yet

    closing = asyncio.create_task(read_then_close())
    await _spin()
    assert not closing.done()  # waits for the write under way
    local.gate.set()
    await asyncio.wait_for(closing, 5)
    assert not _fill_tasks()  # nothing left running
    assert set(local._data) == {"a"} and layered.stats.fills == 1  # "b" was dropped, not written


async def test_a_fill_that_fails_is_counted_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A store error and a bug (any other exception) alike: counted in local_errors, never lost."""

    class Failing(MemoryBackend):
        def __init__(self, error: Exception) -> None:
            super().__init__()
            self.error = error

        async def put(self, items: Sequence[tuple[str, Value]]) -> None:
            raise self.error

    for error in (BackendError("disk full"), RuntimeError("a bug")):
        shared = MemoryBackend()
        layered = LayeredBackend(Failing(error), shared)
        await shared.put([("k", b"v" * 8)])
        with caplog.at_level(logging.WARNING, logger="asyncconn.layered"):
            assert await layered.get_into_many([_read("k", bytearray(8))]) == [8]
            await layered.wait_fills()
        assert layered.stats.local_errors == 1 and layered.stats.fills == 0
        assert str(error) in caplog.text
        caplog.clear()
        await layered.close()


async def test_fills_are_written_a_piece_at_a_time_and_a_delete_waits_only_for_its_own_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One local write of a fill at a time (the local store's reads never queue behind a whole batch), and a
    delete of a key whose piece has not begun does not wait for the piece being written."""
    monkeypatch.setattr(layered_module, "FILL_WRITE_BYTES", 1)

    class Recording(GatedLocal):
        def __init__(self) -> None:
            super().__init__()
            self.writes: list[list[str]] = []
            self.now = self.most = 0

        async def put(self, items: Sequence[tuple[str, Value]]) -> None:
            self.writes.append([key for key, _ in items])
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                await super().put(items)
            finally:
                self.now -= 1

    local, shared = Recording(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([(key, key.encode() * 8) for key in "abc"])
    await layered.get_into_many([_read("a", bytearray(8)), _read("b", bytearray(8))])
    await layered.get_into_many([_read("c", bytearray(8))])
    await asyncio.wait_for(local.entered.wait(), 5)  # "a" is being written, and blocked
    assert await asyncio.wait_for(layered.delete(["b"]), 5) == 1  # not behind "a"
    await _spin()
    assert local.writes == [["a"]]  # nothing else meanwhile: one fill write at a time
    local.gate.set()
    await layered.wait_fills()
    assert local.writes == [["a"], ["c"]] and local.most == 1  # "b" was deleted before its piece
    assert await local.exists(["a", "b", "c"]) == [True, False, True] and layered.stats.fills == 2
    await layered.close()


async def test_copies_reuse_memory_only_once_written_and_let_it_go_when_fills_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A copy's buffer is reused by a later fill only after the local store's write of it has returned (a
    value being written is never overwritten), and the kept buffers go once no fill is under way."""
    local, shared = GatedLocal(), MemoryBackend()
    layered = LayeredBackend(local, shared)
    await shared.put([("a", b"a" * 64), ("b", b"b" * 64), ("c", b"c" * 64)])
    await layered.get_into_many([_read("a", bytearray(64))])
    await asyncio.wait_for(local.entered.wait(), 5)  # "a" is being written from its copy
    await layered.get_into_many([_read("b", bytearray(64))])  # so "b" cannot have that memory
    assert layered._buffers.kept == 0
    local.gate.set()
    await layered.wait_fills()
    assert layered._buffers.kept == 128  # both copies kept for the next fills
    assert await local.get(["a", "b"]) == [(b"a" * 64,), (b"b" * 64,)]
    await layered.get_into_many([_read("c", bytearray(64))])  # reuses one
    assert layered._buffers.kept == 64
    await layered.wait_fills()
    assert await local.get(["a", "b", "c"]) == [(b"a" * 64,), (b"b" * 64,), (b"c" * 64,)]
    assert layered._buffers.kept == 128
    await layered.close()
    assert layered._buffers.kept == 0

    monkeypatch.setattr(layered_module, "FILL_BUFFERS_IDLE_S", 0.0)
    shared = MemoryBackend()
    await shared.put([("a", b"a" * 64)])
    layered = LayeredBackend(MemoryBackend(), shared)
    await layered.get_into_many([_read("a", bytearray(64))])
    assert layered._buffers.kept == 0
    await layered.wait_fills()
    await _spin()  # the idle timer of 0 s runs on the next turn of the loop
    assert layered._buffers.kept == 0
    await layered.close()
