"""A local ``file://`` store in front of a shared one (``local_store_url``): reads, fills, writes, faults.

A read served locally is proved to not touch the shared store by killing its redis-server and reading equal
bytes back; a value read from the shared store is proved written locally by finding its file and reading it
back with the shared store gone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from asyncconn_backends.file import FileBackend
from asyncconn_backends.memory import MemoryBackend

from asyncconn.backend import NOT_CACHED
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


async def test_what_the_local_store_holds_is_told_to_its_follower(tmp_path: Path) -> None:
    """``on_local`` (the KV engine's local-store events): a write of both, a fill and a local hit are
    told as held; a refused write, a delete and the local sweep's removals as let go -- each key told
    once per change, and what it says matches the directory. A follower that raises fails nothing."""
    local = FileBackend(tmp_path / "local", max_bytes=6 * 1024, sweep_interval=3600)
    shared = MemoryBackend()
    layered = LayeredBackend(local, shared)
    told: list[tuple[str, bool]] = []
    layered.on_local = lambda keys, held: told.extend((key, held) for key in keys)
    assert local.on_removed is not None and shared.on_removed is None  # the sweep's, not the store's

    await layered.put([("a", b"a" * 1024), ("b", b"b" * 1024)])
    assert told == [("a", True), ("b", True)]
    await shared.put([("far", b"f" * 1024)])  # another host's save
    dest = bytearray(1024)
    told.clear()
    assert await layered.get_into_many([("far", [memoryview(dest)], None)]) == [1024]  # a fill
    assert await layered.get_into_many([("a", [memoryview(dest)], None)]) == [1024]  # a local hit
    got = await layered.get(["b", "nowhere"])
    assert got[1] is None and got[0] is not None and b"".join(got[0]) == b"b" * 1024
    assert told == [("far", True), ("a", True), ("b", True)]

    told.clear()
    await layered.delete(["b"])
    assert told == [("b", False)]

    class Refusing(MemoryBackend):
        async def put(self, items: object) -> None:
            raise BackendUnavailable("shared store down")

    refused = LayeredBackend(FileBackend(tmp_path / "other"), Refusing())
    heard: list[tuple[str, bool]] = []
    refused.on_local = lambda keys, held: heard.extend((key, held) for key in keys)
    with pytest.raises(BackendUnavailable):
        await refused.put([("k", b"x" * 100)])
    assert heard == [("k", False)]  # written locally, removed again: never told as held
    await refused.close()

    # Past max_bytes, the local sweep evicts: each removed key is told as let go, and only those.
    await layered.put([(f"v{i}", bytes([i]) * 1024) for i in range(8)])
    told.clear()
    report = await local.sweep()
    assert report is not None and report.evicted > 0
    gone = {key for key, held in told if not held}
    assert len(gone) == report.evicted and not any(held for _, held in told)
    keys = ["a", "far", *(f"v{i}" for i in range(8))]
    on_disk = dict(zip(keys, await local.exists(keys), strict=True))
    assert gone == {key for key, there in on_disk.items() if not there}
    assert await shared.exists(sorted(gone)) == [True] * len(gone)  # the value stays in the store

    def broken(keys: object, held: bool) -> None:
        raise RuntimeError("a follower's bug")

    layered.on_local = broken
    await layered.put([("c", b"c" * 10)])  # no error
    layered.on_local = None
    assert local.on_removed is None
    await layered.close()
