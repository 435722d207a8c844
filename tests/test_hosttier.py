"""The host-memory tier: its LRU (bound, order, pins, bypass), and the tier in front of real stores.

A hit is proved to not touch the store by taking the store away (files removed, redis-server killed) and
reading equal bytes back; a miss is proved to go to the store by the same reads failing for other keys.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from asyncconn_backends.file import FileBackend
from asyncconn_backends.memory import MemoryBackend

from asyncconn import codec
from asyncconn.backend import NOT_CACHED, feed_sink, open_backend
from asyncconn.config import Settings
from asyncconn.exceptions import BackendError, BackendUnavailable
from asyncconn.hostarena import Extents
from asyncconn.hosttier import HostLRU, HostTier
from asyncconn.scattered import Scattered
from asyncconn.store import Fetch, TensorStore
from tests.servers import RedisServer

# -- the LRU ----------------------------------------------------------------------------------------------


def _hold(lru: HostLRU, key: str, nbytes: int) -> bool:
    """Reserve room for a value of ``nbytes`` and index it under ``key`` (as a filled write would)."""
    extent = lru.reserve(nbytes)
    if extent is None:
        return False
    lru.commit(key, extent)
    return True


def test_lru_evicts_least_recently_used_first_and_reports_it() -> None:
    evicted: list[list[str]] = []
    lru = HostLRU(100, align=1, on_evict=lambda keys: evicted.append(list(keys)))
    assert _hold(lru, "a", 40) and _hold(lru, "b", 40)
    assert lru.peek("a") is not None  # a is now the most recently used
    assert _hold(lru, "c", 40)
    assert "b" not in lru and "a" in lru and "c" in lru
    assert evicted == [["b"]]
    assert lru.used == 80 and lru.stats.evictions == 1 and lru.stats.entries == 2
    assert _hold(lru, "d", 100)  # evicts everything else, oldest first
    assert evicted[1:] == [["a", "c"]] and lru.used == 100


def test_lru_bypasses_a_value_over_the_bound_without_evicting() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 60)
    assert not _hold(lru, "big", 101)
    assert "big" not in lru and "a" in lru and lru.used == 60
    assert lru.stats.bypassed == 1 and lru.stats.evictions == 0


def test_lru_never_evicts_a_pinned_value_and_bypasses_when_everything_is_pinned() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 50)
    _hold(lru, "b", 50)
    entry = lru.pin("a")
    assert entry is not None
    assert _hold(lru, "c", 50)  # b goes, not the older but pinned a
    assert "a" in lru and "b" not in lru
    pinned_c = lru.pin("c")
    assert pinned_c is not None
    assert not _hold(lru, "d", 10)  # all held bytes are pinned: d does not fit, nothing evicted
    assert "a" in lru and "c" in lru and lru.used == 100 and lru.stats.bypassed == 1
    lru.unpin(entry)
    lru.unpin(pinned_c)
    assert lru.stats.pinned == 0
    assert _hold(lru, "d", 10)  # a, the least recently used, goes now
    assert "a" not in lru and lru.used == 60


def test_lru_counts_a_replaced_or_deleted_value_until_its_reader_ends() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 60)
    entry = lru.pin("a")
    assert entry is not None
    assert _hold(lru, "a", 30)  # replaced under a reader: the old bytes are still in use
    assert lru.used == 90 and entry.detached
    # Even with the new 30 bytes evicted, 60 + 50 > 100: the old bytes cannot go before their reader.
    assert not _hold(lru, "b", 50)
    assert "a" in lru
    assert lru.discard(["a"]) == 1
    assert lru.used == 60
    lru.unpin(entry)
    assert lru.used == 0 and lru.stats.held_bytes == 0 and lru.stats.entries == 0 and lru.stats.pinned == 0


def test_lru_claims_keep_values_until_unclaimed_from_another_thread() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 40)
    _hold(lru, "b", 40)
    assert lru.claim("r1", ["a", "x", "b"]) == [True, False, True]  # x is not held
    assert not _hold(lru, "c", 40)  # everything held is claimed: c is not kept, nothing evicted
    assert "a" in lru and "b" in lru and lru.stats.evictions == 0 and lru.claims == 1
    assert lru.discard(["a"]) == 1  # a delete still drops it; its memory is the claim's until unclaimed
    assert lru.used == 80
    # The scheduler thread releases the claim while this thread holds the index: no torn state.
    done = threading.Event()
    threading.Thread(target=lambda: (lru.unclaim("r1"), done.set())).start()
    assert done.wait(5)
    assert lru.claims == 0 and lru.stats.pinned == 0 and lru.used == 40
    lru.unclaim("r1")  # a second release is nothing
    assert _hold(lru, "c", 61)  # b, unclaimed now, is evicted for it
    assert "b" not in lru and lru.used == 61


def test_lru_claims_of_one_owner_add_up_and_a_clear_frees_their_memory_at_unclaim() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 30)
    _hold(lru, "b", 30)
    assert lru.claim("r", ["a"]) == [True]
    assert lru.claim("r", ["b", "a"]) == [True, True]
    assert lru.stats.pinned == 3
    lru.clear()
    assert len(lru) == 0 and lru.used == 60  # claimed memory is not reused before the release
    lru.unclaim("r")
    assert lru.used == 0 and lru.stats.pinned == 0


def test_lru_counts_a_reservation_until_it_is_committed_or_released() -> None:
    lru = HostLRU(100, align=1)
    _hold(lru, "a", 50)
    filling = lru.reserve(50)
    assert filling is not None and lru.used == 100 and len(lru) == 1
    assert not _hold(lru, "b", 60)  # a may go, not the room being filled: 50 + 60 > 100
    assert "a" in lru
    lru.release(filling)
    assert lru.used == 50
    since = lru.clock  # a fill's read starts
    late = lru.reserve(20)
    assert late is not None and lru.commit("late", late) is not None  # a write indexes "late" meanwhile
    older = lru.reserve(10)
    assert older is not None
    # The fill, from before "late" was indexed, defers to it: its room is given back.
    assert lru.commit("late", older, since=since) is None
    assert lru.used == 70 and lru.stats.held_bytes == 70


# -- the arena's extents ----------------------------------------------------------------------------------


def test_extents_reuse_an_exact_run_coalesce_and_scatter_rather_than_fail() -> None:
    extents = Extents(10 * 64, align=64)
    a, b, c = (extents.take(100) for _ in range(3))  # two units each
    assert a is not None and b is not None and c is not None
    assert [a.runs, b.runs, c.runs] == [((0, 2),), ((2, 2),), ((4, 2),)] and extents.free_units == 4
    extents.give(b)
    again = extents.take(128)
    assert again is not None and again.runs == b.runs  # the freed run of exactly that size, reused
    extents.give(a)
    extents.give(again)  # coalesces with a: units 0..4 free, and 6..10
    assert extents.free_units == 8
    whole = extents.take(8 * 64 - 1)  # no run of 8: taken in two runs, never refused
    assert whole is not None and sorted(whole.runs) == [(0, 4), (6, 4)] and extents.free_units == 0
    assert extents.take(1) is None
    arena = np.arange(10 * 64, dtype=np.int64).astype(np.uint8)
    assert sum(x.size for x in whole.arrays(arena, 64)) == 8 * 64 - 1
    extents.give(whole)
    with pytest.raises(AssertionError):
        extents.give(whole)
    extents.give(c)
    assert extents.free_units == 10 and extents.take(10 * 64) is not None


def test_setting_parses_sizes_and_defaults_to_off() -> None:
    assert Settings().host_cache_bytes == 0
    assert Settings.from_extra_config({"host_cache_bytes": "2MiB"}).host_cache_bytes == 2 << 20


# -- the tier over a backend ------------------------------------------------------------------------------


class _Gate:
    """A sink that blocks the copy thread until released: a read held in the middle of its copy."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.fed = 0

    def __call__(self, piece: memoryview) -> None:
        self.entered.set()
        assert self.release.wait(10)
        self.fed += piece.nbytes


async def test_a_value_is_not_evicted_under_a_read_copying_out_of_it() -> None:
    tier = HostTier(await open_backend("memory://"), 100, align=1)
    value = bytes(range(60))
    await tier.put([("a", value)])
    dest = bytearray(60)
    gate = _Gate()
    read = asyncio.ensure_future(tier.get_into("a", [memoryview(dest)], gate))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    # b needs a's room; a is pinned, so b is not kept. (Straight into the index: a put's own copy would
    # queue behind this read's on the tier's one copy thread.)
    assert tier.lru.reserve(60) is None
    assert tier.holds(["a", "b"]) == [True, False]
    assert tier.lru.used <= 100 and tier.stats.pinned == 1
    gate.release.set()
    assert await read == 60
    assert bytes(dest) == value and gate.fed == 60
    assert tier.stats.pinned == 0 and tier.stats.hits == 1
    await tier.put([("b", b"b" * 60)])  # a is free to go now
    assert tier.holds(["a", "b"]) == [False, True] and tier.stats.evictions == 1
    await tier.close()


async def test_a_cancelled_read_ends_its_copy_before_the_cancellation_and_leaves_no_pin() -> None:
    tier = HostTier(await open_backend("memory://"), 1 << 20)
    await tier.put([("a", b"x" * 1000)])
    dest = bytearray(1000)
    gate = _Gate()
    read = asyncio.ensure_future(tier.get_into_many([("a", [memoryview(dest)], gate)]))
    assert await asyncio.to_thread(gate.entered.wait, 10)
    read.cancel()
    await asyncio.sleep(0)
    assert not read.done()  # the copy thread still writes the buffer: the cancellation waits for it
    gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert gate.fed == 1000 and bytes(dest) == b"x" * 1000
    assert tier.stats.pinned == 0 and tier.holds(["a"]) == [True]
    await tier.close()


async def test_a_write_the_store_refuses_is_not_kept() -> None:
    tier = HostTier(MemoryBackend(max_bytes=10), 1000, align=1)
    with pytest.raises(BackendUnavailable):
        await tier.put([("a", b"x" * 20)])
    assert tier.holds(["a"]) == [False] and tier.lru.used == 0
    await tier.close()


async def test_a_write_over_the_bound_reaches_the_store_and_drops_the_older_value() -> None:
    evicted: list[str] = []
    tier = HostTier(await open_backend("memory://"), 100, align=1, on_evict=evicted.extend)
    await tier.put([("a", b"1" * 50)])
    await tier.put([("a", [b"2" * 60, b"2" * 60])])  # 120 bytes, in two chunks
    assert tier.holds(["a"]) == [False] and evicted == ["a"] and tier.stats.bypassed == 1
    assert await tier.get(["a"]) == [(b"2" * 120,)]  # from the store: a miss, and still not kept
    assert tier.stats.misses == 1 and tier.holds(["a"]) == [False] and tier.lru.used == 0
    await tier.close()


async def test_a_value_of_the_wrong_length_is_not_written_and_a_bad_frame_is_never_a_hit(
    tmp_path: Path,
) -> None:
    store = await TensorStore.open(f"file://{tmp_path}", host_cache_bytes=1 << 20)
    tier = store.host_tier
    assert tier is not None
    good = torch.arange(64, dtype=torch.float32)
    await store.put([("k", good)])
    short = bytearray(b"\xee" * 8)
    assert await tier.get_into("k", [memoryview(short)]) == len(codec.encode(good, key="k"))
    assert short == b"\xee" * 8  # a length mismatch writes nothing
    # A value of the right length whose frame is bad (from the store, then kept by the tier): corrupt
    # every time, never a hit.
    frame = bytearray(codec.encode(good, key="k"))
    frame[-1] ^= 0xFF
    await tier.inner.put([("bad", bytes(frame))])
    for _ in range(2):
        assert await store.read_into("bad", torch.empty(64)) is Fetch.CORRUPT
    assert tier.holds(["bad"]) == [True] and store.stats.corrupt == 2
    assert await store.read_into("bad", torch.empty(32)) is Fetch.CORRUPT  # short destination
    await store.close()


async def test_file_store_hits_are_served_from_the_tier_byte_equal(tmp_path: Path) -> None:
    store = await TensorStore.open(f"file://{tmp_path}/store", host_cache_bytes=1 << 20)
    tier = store.host_tier
    assert tier is not None
    values = {f"k{i}": torch.randn(256) for i in range(4)}
    await store.put(values.items())
    assert await store.exists(list(values)) == [True] * 4
    for path in (tmp_path / "store").rglob("*"):  # the store is emptied: only the tier can answer
        if path.is_file():
            path.unlink()
    assert await store.exists(list(values)) == [False] * 4  # exists asks the store, not the tier
    out = torch.empty(256)
    assert await store.read_into("k0", out) is Fetch.HIT
    assert torch.equal(out, values["k0"])
    # The CPU engine's in-place path: cached_only reads scattered straight into pieces (the KV cache).
    assert store.cached_reads
    pieces = [torch.empty(128), torch.empty(128)]
    views = tuple(codec.tensor_bytes(p) for p in pieces)
    dest = Scattered(torch.float32, (256,), views)
    got = await store.read_into_many([("k1", dest), ("gone", torch.empty(256))], cached_only=True)
    assert got == [Fetch.HIT, Fetch.MISS]
    assert torch.equal(torch.cat(pieces), values["k1"])
    decoded = await store.get(["k2", "k3"])
    assert all(torch.equal(t, values[k]) for t, k in zip(decoded, ["k2", "k3"], strict=True) if t is not None)
    assert tier.stats.hits == 4 and tier.stats.misses == 1
    assert tier.stats.bytes_hit == 4 * len(codec.encode(values["k0"], key="k0"))
    await store.delete(["k0"])
    assert tier.holds(["k0", "k1"]) == [False, True]
    await store.close()


async def test_a_miss_is_read_from_the_store_and_kept(tmp_path: Path) -> None:
    writer = await TensorStore.open(f"file://{tmp_path}")
    reader = await TensorStore.open(f"file://{tmp_path}", host_cache_bytes=1 << 20)
    tier = reader.host_tier
    assert tier is not None
    value = torch.randn(100)
    await writer.put([("k", value)])
    out = torch.empty(100)
    assert await reader.read_into("k", out) is Fetch.HIT and tier.stats.misses == 1
    assert tier.holds(["k"]) == [True]
    await writer.delete(["k"])
    out.zero_()
    assert await reader.read_into("k", out) is Fetch.HIT and tier.stats.hits == 1
    assert torch.equal(out, value)
    await writer.close()
    await reader.close()


class _NoCachedReads(MemoryBackend):
    """A store that cannot serve ``cached_only`` reads (as redis cannot)."""

    async def get_into_many(
        self, reads: Sequence[tuple[str, Sequence[memoryview], object]], *, cached_only: bool = False
    ) -> list[int | None]:
        assert not cached_only, "a cached_only read must not reach a store that cannot serve it"
        return await super().get_into_many(reads)  # type: ignore[arg-type]


async def test_cached_only_misses_are_not_cached_over_a_store_without_cached_reads() -> None:
    tier = HostTier(_NoCachedReads(), 1 << 20)
    await tier.inner.put([("k", b"v" * 10)])
    dest = bytearray(10)
    assert await tier.get_into_many([("k", [memoryview(dest)], None)], cached_only=True) == [NOT_CACHED]
    assert tier.stats.misses == 0  # asked again without cached_only, and counted then
    assert await tier.get_into_many([("k", [memoryview(dest)], None)]) == [10]
    assert tier.stats.misses == 1 and tier.holds(["k"]) == [True]
    assert await tier.get_into_many([("k", [memoryview(bytearray(10))], None)], cached_only=True) == [10]
    await tier.close()


async def test_redis_hits_are_served_with_the_server_gone(fresh_redis: RedisServer) -> None:
    store = await TensorStore.open(f"{fresh_redis.url}?timeout=2", timeout=2.0, host_cache_bytes=1 << 20)
    tier = store.host_tier
    assert tier is not None
    value = torch.randn(1000)
    await store.put([("kv", value)])
    fresh_redis.kill()
    out = torch.empty(1000)
    assert await store.read_into("kv", out) is Fetch.HIT
    assert torch.equal(out, value) and tier.stats.hits == 1
    with pytest.raises(BackendError):  # a miss does go to the (gone) store
        await store.read_into("other", torch.empty(1000))
    await store.close()


async def test_the_store_removals_hook_set_on_the_tier_is_the_stores(tmp_path: Path) -> None:
    """The KV worker hooks ``on_removed`` on the backend it holds: through the tier it must reach the store
    (a value the tier drops is still in the store, so only the store's removals are BlockRemoved)."""
    inner = FileBackend(tmp_path / "s", max_bytes=4 << 10)
    tier = HostTier(inner, 1 << 20)
    told: list[str] = []
    tier.on_removed = told.extend
    try:
        assert inner.on_removed == told.extend
        await tier.put([("old", b"x" * 3000)])
        await tier.put([("new", b"y" * 3000)])
        os.utime(inner._path("old"), (1, 1))  # the older use: evicted first
        await inner.sweep()
        assert told == ["old"]
        tier.on_removed = None
        assert inner.on_removed is None
    finally:
        await tier.close()


# -- the arena: memory, bound, reuse, fills during the read -----------------------------------------------


class _Stepped(MemoryBackend):
    """A store whose batch read lands its values one at a time, feeding each one's sink as it lands, and
    waits for ``go`` after the first: a store still sending the rest of a load."""

    def __init__(self) -> None:
        super().__init__()
        self.first_landed = asyncio.Event()
        self.go = asyncio.Event()

    async def get_into_many(
        self, reads: Sequence[tuple[str, Sequence[memoryview], object]], *, cached_only: bool = False
    ) -> list[int | None]:
        out: list[int | None] = []
        for n, read in enumerate(reads):
            if n == 1:
                self.first_landed.set()
                await self.go.wait()
            out.append(await self.get_into(*read))  # type: ignore[arg-type]
        return out


def _count_into(fed: list[int]) -> Callable[[memoryview], None]:
    return lambda piece: fed.append(piece.nbytes)


def _arena(tier: HostTier) -> np.ndarray:
    return tier._arena.result()


async def test_the_arena_is_made_once_within_the_bound_and_faulted_in() -> None:
    tier = HostTier(await open_backend("memory://"), (1 << 20) + 50)
    await tier.ready()
    arena = _arena(tier)
    assert arena.nbytes == tier.lru.extents.nbytes == 1 << 20  # the bound, in whole 64-byte units
    # Faulted in at once: the pages are resident before any value is written (mincore through the mmap).
    resident = _resident_pages(arena)
    assert resident == arena.nbytes // os.sysconf("SC_PAGE_SIZE")
    await tier.close()


def _resident_pages(arena: np.ndarray) -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    page = os.sysconf("SC_PAGE_SIZE")
    address = arena.ctypes.data
    start = address - address % page
    length = arena.nbytes + (address - start)
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


async def test_the_bound_is_never_exceeded_and_every_hit_is_byte_equal() -> None:
    """Random writes and reads of random sizes through a small tier: after every call the arena's bytes
    taken (values held, filled, or pinned) are within the bound and add up to the values held."""
    import random

    rng = random.Random(5)
    capacity = 64 << 10
    tier = HostTier(await open_backend("memory://"), capacity)
    written: dict[str, bytes] = {}
    for step in range(400):
        key = f"k{rng.randrange(40)}"
        if rng.random() < 0.4 or key not in written:
            size = rng.choice([1, 63, 64, 4096, 9000, 20_000, 70_000])
            value = rng.randbytes(size)
            if rng.random() < 0.5:
                await tier.put([(key, value)])
            else:
                await tier.inner.put([(key, value)])
                tier.lru.forget(key)  # (written around the tier: not what it holds)
            written[key] = value
        else:
            keys = rng.sample(sorted(written), min(4, len(written)))
            dests = [bytearray(len(written[k])) for k in keys]
            reads = [(k, [memoryview(d)], None) for k, d in zip(keys, dests, strict=True)]
            assert await tier.get_into_many(reads) == [len(d) for d in dests]  # type: ignore[arg-type]
            assert [bytes(d) for d in dests] == [written[k] for k in keys], step
        lru = tier.lru
        assert lru.used <= capacity and lru.stats.pinned == 0
        held_units = sum(lru.extents.units_for(len(written[k])) for k in written if k in lru)
        assert lru.used == held_units * lru.extents.align, step  # nothing taken but what is held
        assert lru.stats.held_bytes == sum(len(written[k]) for k in written if k in lru)
    assert tier.stats.evictions > 0 and tier.stats.bypassed > 0 and tier.stats.hits > 0
    await tier.close()


async def test_an_evicted_values_room_is_reused_in_place() -> None:
    size = 10_000
    room = -(-size // 64) * 64
    tier = HostTier(await open_backend("memory://"), 2 * room)
    values = {k: os.urandom(size) for k in "abc"}
    await tier.put([("a", values["a"])])
    await tier.put([("b", values["b"])])
    a_runs = tier.lru.peek("a").extent.runs  # type: ignore[union-attr]
    tier.lru.peek("b")  # (peeking made a the most recently used: b is again)
    await tier.put([("c", values["c"])])  # a, the least recently used, goes; c takes its room
    assert tier.holds(["a", "b", "c"]) == [False, True, True]
    assert tier.lru.peek("c").extent.runs == a_runs  # type: ignore[union-attr]
    assert tier.lru.used == 2 * room
    for key in "bc":
        dest = bytearray(size)
        assert await tier.get_into(key, [memoryview(dest)]) == size and bytes(dest) == values[key]
    assert tier.stats.hits == 2
    await tier.close()


async def test_a_miss_is_copied_into_the_tier_while_the_store_still_sends_the_rest() -> None:
    """The fill of a value starts when it lands, not after the store's read ends: with the store holding
    back the second value, the first is already in the tier's memory. (The tier used to copy every value
    after the store's read had returned, and the load waited for it.)"""
    store = _Stepped()
    tier = HostTier(store, 1 << 20)
    first, second = os.urandom(5000), os.urandom(7000)
    await store.put([("k0", first), ("k1", second)])
    dests = [bytearray(5000), bytearray(7000)]
    fed: list[int] = []  # (a read has a sink, as TensorStore's have: the tier's own wraps it)
    read = asyncio.ensure_future(
        tier.get_into_many(
            [
                ("k0", [memoryview(dests[0])], _count_into(fed)),
                ("k1", [memoryview(dests[1])], _count_into(fed)),
            ]
        )
    )
    await asyncio.wait_for(store.first_landed.wait(), 10)
    arena = _arena(tier)
    for _ in range(1000):  # the copy runs on the tier's thread
        if arena.tobytes().find(first) >= 0:
            break
        await asyncio.sleep(0.01)
    assert arena.tobytes().find(first) >= 0, "the first value was not copied while the read went on"
    assert not read.done() and tier.holds(["k0"]) == [False]  # indexed only once the read has returned it
    store.go.set()
    assert await read == [5000, 7000]
    assert [bytes(d) for d in dests] == [first, second] and tier.holds(["k0", "k1"]) == [True, True]
    assert fed == [5000, 7000]  # the caller's sinks saw every byte
    await store.delete(["k0", "k1"])  # the tier answers alone now
    again = [bytearray(5000), bytearray(7000)]
    got = await tier.get_into_many(
        [("k0", [memoryview(again[0])], None), ("k1", [memoryview(again[1])], None)]
    )
    assert got == [5000, 7000] and [bytes(d) for d in again] == [first, second]
    await tier.close()


async def test_a_read_cancelled_mid_fill_leaves_nothing_taken_nor_pinned() -> None:
    store = _Stepped()
    tier = HostTier(store, 1 << 20)
    await store.put([("k0", b"0" * 5000), ("k1", b"1" * 5000)])
    await tier.put([("hit", b"h" * 3000)])
    taken = tier.lru.used
    dests = [bytearray(3000), bytearray(5000), bytearray(5000)]
    fed: list[int] = []
    reads = [(k, [memoryview(d)], _count_into(fed)) for k, d in zip(["hit", "k0", "k1"], dests, strict=True)]
    read = asyncio.ensure_future(tier.get_into_many(reads))  # type: ignore[arg-type]
    await asyncio.wait_for(store.first_landed.wait(), 10)
    assert tier.lru.used > taken  # k0 landed: its room is taken, its copy queued
    read.cancel()
    with pytest.raises(asyncio.CancelledError):
        await read
    assert tier.lru.used == taken and tier.stats.pinned == 0
    assert tier.holds(["hit", "k0", "k1"]) == [True, False, False]
    assert tier.lru.extents.free_units * 64 + taken == tier.lru.extents.nbytes
    await tier.close()


class _HangingPut(MemoryBackend):
    def __init__(self) -> None:
        super().__init__()
        self.writing = asyncio.Event()

    async def put(self, items: Sequence[tuple[str, object]]) -> None:  # type: ignore[override]
        self.writing.set()
        await asyncio.sleep(3600)


async def test_a_write_cancelled_while_the_store_writes_is_not_kept_nor_its_room_taken() -> None:
    store = _HangingPut()
    tier = HostTier(store, 1 << 20)
    write = asyncio.ensure_future(tier.put([("k", b"v" * 10_000)]))
    await asyncio.wait_for(store.writing.wait(), 10)
    write.cancel()
    with pytest.raises(asyncio.CancelledError):
        await write
    assert tier.holds(["k"]) == [False] and tier.lru.used == 0
    await tier.close()


async def test_a_tier_whose_memory_cannot_be_made_keeps_nothing_and_passes_through() -> None:
    def no_memory(nbytes: int) -> bytearray:
        raise MemoryError(f"{nbytes}")

    tier = HostTier(await open_backend("memory://"), 1 << 20, memory=no_memory)
    with pytest.raises(MemoryError):
        await tier.ready()
    await tier.put([("k", b"v" * 100)])
    dest = bytearray(100)
    assert await tier.get_into("k", [memoryview(dest)]) == 100 and dest == b"v" * 100
    assert await tier.get(["k"]) == [(b"v" * 100,)]
    assert tier.holds(["k"]) == [False] and tier.lru.used == 0
    await tier.close()


async def test_a_tier_over_caller_memory_uses_it() -> None:
    """The arena may come from a given allocator (a CUDA engine's pinned one): the tier writes there."""
    given = torch.zeros(1 << 16, dtype=torch.uint8)
    tier = HostTier(await open_backend("memory://"), 1 << 16, memory=lambda n: given[:n])
    await tier.put([("k", b"\x07" * 1000)])
    assert int((given == 7).sum()) == 1000
    await tier.close()


async def test_a_load_does_not_wait_for_the_tiers_memory_to_be_made() -> None:
    """The arena is made on the copy thread after the tier is: a read meanwhile is served by the store and
    not kept (it would wait behind the arena); a write waits (its copy runs after) and is kept."""
    making = threading.Event()

    def slow_memory(nbytes: int) -> bytearray:
        assert making.wait(10)
        return bytearray(nbytes)

    tier = HostTier(await open_backend("memory://"), 1 << 20, memory=slow_memory)
    await tier.inner.put([("k", b"v" * 1000)])
    dest = bytearray(1000)
    got = await asyncio.wait_for(tier.get_into_many([("k", [memoryview(dest)], None)]), 5)
    assert got == [1000] and dest == b"v" * 1000 and tier.holds(["k"]) == [False] and tier.lru.used == 0
    write = asyncio.ensure_future(tier.put([("w", b"w" * 1000)]))
    await asyncio.sleep(0.05)
    assert not write.done()  # its copy waits for the memory
    making.set()
    await asyncio.wait_for(write, 10)
    assert tier.holds(["w"]) == [True]
    await tier.get_into_many([("k", [memoryview(dest)], None)])
    assert tier.holds(["k"]) == [True]
    await tier.close()


class _LandsTwice(MemoryBackend):
    """A store that lands every value twice, feeding its sink each time: first other bytes, then the value
    (as a layered store does when its local read fails and the shared store is read instead)."""

    async def get_into_many(
        self, reads: Sequence[tuple[str, Sequence[memoryview], object]], *, cached_only: bool = False
    ) -> list[int | None]:
        for _, dests, sink in reads:
            for dest in dests:
                dest.cast("B")[:] = b"\xee" * dest.nbytes
            feed_sink(sink, list(dests))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)  # (the first landing's copy runs meanwhile)
        return await super().get_into_many(reads)  # type: ignore[arg-type]


async def test_a_value_landed_twice_is_held_as_it_landed_last() -> None:
    store = _LandsTwice()
    tier = HostTier(store, 1 << 20)
    await tier.ready()
    value = os.urandom(3000)
    await store.put([("k", value)])
    dest = bytearray(3000)
    assert await tier.get_into_many([("k", [memoryview(dest)], lambda piece: None)]) == [3000]
    assert dest == value and tier.holds(["k"]) == [True]
    await store.delete(["k"])
    again = bytearray(3000)
    assert await tier.get_into("k", [memoryview(again)]) == 3000 and again == value  # from the tier
    await tier.close()


async def test_closing_the_tier_gives_its_memory_back() -> None:
    import gc
    import weakref

    tier = HostTier(await open_backend("memory://"), 1 << 20)
    await tier.put([("k", b"v" * 1000)])
    arena = weakref.ref(_arena(tier))
    await tier.close()
    await asyncio.sleep(0.05)  # (the copy thread lets its last job go)
    gc.collect()
    assert arena() is None
