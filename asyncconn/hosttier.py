"""A bounded host-memory tier in front of any store: a least-recently-used cache of values, by bytes.

Why: every load went to the store, also for a prefix this worker had saved or loaded a moment before. The
tier is a :class:`StorageBackend` that wraps the store's backend (any of them, a composite one too), so
everything above it -- framing, checksums, timeouts, the loaders -- is unchanged:

- a read that hits copies the value from the tier straight into the caller's buffers (on a CPU engine those
  are the KV cache's blocks themselves) and never calls the store; a miss reads from the store and keeps a
  copy, within the bound;
- a write keeps a copy and goes on to the store; it completes when the store's write completes (write
  through: a save is already asynchronous, the engine's step never waits for it). A write the store refused
  or did not finish is dropped from the tier again, so the tier holds only what the store accepted;
- ``exists`` asks the store, never the tier: a save skipped because the tier held a value the store has
  since expired would leave the store without it for good, and every lookup -- the store's -- missing;
- ``delete`` removes from both.

The tier is bounded by ``capacity`` bytes and never grows past it: a write evicts the least recently used
values first; a value larger than the bound, or one that cannot fit because every other value is being
read (pinned), is not kept (it still goes to the store). A value is pinned while a read copies out of it:
it is never evicted, nor its memory counted free, under that read. The tier's index belongs to the runtime
loop thread; every copy into or out of it runs on the tier's one copy thread, with the GIL released for
large buffers, so neither the loop nor vLLM's threads wait for it.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar, TypeVar

import numpy as np

from asyncconn.backend import (
    NOT_CACHED,
    Buffer,
    IntoRead,
    RemovedHook,
    Sink,
    StorageBackend,
    Value,
    checked_dests,
    checked_items,
    checked_keys,
    feed_sink,
    value_nbytes,
)
from asyncconn.url import StoreURL

__all__ = ["HostTier", "OnEvict", "TierStats"]

T = TypeVar("T")

#: Called on the loop thread with keys that left the tier: evicted under pressure, or deleted through it.
OnEvict = Callable[[Sequence[str]], None]


@dataclass
class TierStats:
    """Counters since the tier was made (plain ints: read them from any thread).

    ``hits``/``misses`` count reads (a hit never reached the store); ``bytes_hit`` the bytes served by the
    tier; ``evictions`` values dropped to make room; ``bypassed`` values not kept because they did not fit.
    ``held_bytes``/``entries``/``pinned`` are the state now.
    """

    hits: int = 0
    misses: int = 0
    bytes_hit: int = 0
    evictions: int = 0
    bypassed: int = 0
    held_bytes: int = 0
    entries: int = 0
    pinned: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Entry:
    """One value held: its bytes (immutable), readers copying out of it, and whether it is still indexed."""

    __slots__ = ("data", "detached", "pins")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pins = 0
        self.detached = False


class HostLRU:
    """The tier's index: key -> value bytes, least recently used first, bounded by ``capacity`` bytes.

    ``used`` counts the values indexed plus those replaced or deleted while a read still copies out of them
    (their memory is freed when that read ends): the bound holds for memory, not only for the index.
    """

    def __init__(self, capacity: int, *, on_evict: OnEvict | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.on_evict = on_evict
        self.stats = TierStats()
        self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._pinned_bytes = 0  # indexed entries with readers: not evictable
        self._detached_bytes = 0  # entries out of the index whose readers have not finished

    @property
    def used(self) -> int:
        return self.stats.held_bytes + self._detached_bytes

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def pin(self, key: str) -> _Entry | None:
        """The entry under ``key``, marked most recently used and pinned; ``None`` when not held."""
        entry = self._index.get(key)
        if entry is None:
            return None
        self._index.move_to_end(key)
        if entry.pins == 0:
            self._pinned_bytes += len(entry.data)
        entry.pins += 1
        self.stats.pinned += 1
        return entry

    def unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        self.stats.pinned -= 1
        if entry.pins:
            return
        if entry.detached:
            self._detached_bytes -= len(entry.data)
        else:
            self._pinned_bytes -= len(entry.data)

    def get(self, key: str) -> bytes | None:
        """The bytes under ``key`` (marked most recently used), for a caller that keeps its own reference."""
        entry = self._index.get(key)
        if entry is None:
            return None
        self._index.move_to_end(key)
        return entry.data

    def put(self, key: str, data: bytes) -> bool:
        """Hold ``data`` under ``key``, evicting least recently used values as needed; False when it cannot
        fit (larger than the bound, or the rest is pinned) -- then nothing is evicted and ``key`` is not
        held (an older value under it is dropped: it may differ)."""
        self._drop(key)
        size = len(data)
        evictable = self.stats.held_bytes - self._pinned_bytes
        if size > self.capacity or self.used - evictable + size > self.capacity:
            self.stats.bypassed += 1
            return False
        evicted: list[str] = []
        if self.used + size > self.capacity:
            for old_key in list(self._index):  # oldest first
                if self.used + size <= self.capacity:
                    break
                if self._index[old_key].pins == 0:
                    self._drop(old_key)
                    evicted.append(old_key)
        self._index[key] = _Entry(data)
        self.stats.held_bytes += size
        self.stats.entries += 1
        if evicted:
            self.stats.evictions += len(evicted)
            self._report(evicted)
        return True

    def discard(self, keys: Sequence[str]) -> int:
        """Stop holding ``keys`` (reported to ``on_evict``); how many were held."""
        gone = [key for key in keys if self._drop(key)]
        if gone:
            self._report(gone)
        return len(gone)

    def discard_entry(self, key: str, data: bytes) -> None:
        """Stop holding ``key`` if it still holds exactly ``data`` (a write the store did not accept)."""
        entry = self._index.get(key)
        if entry is not None and entry.data is data:
            self.discard([key])

    def clear(self) -> None:
        for key in list(self._index):
            self._drop(key)

    def _drop(self, key: str) -> bool:
        entry = self._index.pop(key, None)
        if entry is None:
            return False
        size = len(entry.data)
        self.stats.held_bytes -= size
        self.stats.entries -= 1
        if entry.pins:  # a read still copies out of it: its memory is not free yet
            entry.detached = True
            self._pinned_bytes -= size
            self._detached_bytes += size
        return True

    def _report(self, keys: list[str]) -> None:
        if self.on_evict is not None:
            self.on_evict(keys)


def _joined(values: list[Value]) -> list[bytes]:
    """(copy thread) Each value as one ``bytes``: ``bytes.join`` copies large buffers without the GIL."""
    return [b"".join([v] if isinstance(v, (bytes, bytearray, memoryview)) else v) for v in values]


def _scatter(src: memoryview, dests: list[memoryview]) -> None:
    """(copy thread) ``src`` into ``dests`` in order; numpy copies large arrays without the GIL (vLLM's
    thread and the loop run meanwhile)."""
    offset = 0
    for dest in dests:
        n = dest.nbytes
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(src[offset : offset + n], np.uint8))
        offset += n


class HostTier(StorageBackend):
    """``inner`` behind a host-memory LRU of at most ``capacity`` bytes (see the module's docstring).

    Reads straight into caller memory and serves ``cached_only`` reads: a value in the tier is a memory
    copy; a miss is the inner store's (its ``cached_only`` answer when it can give one, else
    ``NOT_CACHED``). ``on_evict`` is told the keys that leave the tier. Owned by the runtime loop thread.
    """

    reads_into: ClassVar[bool] = True
    batch_reads: ClassVar[bool] = True
    cached_reads: ClassVar[bool] = True

    def __init__(self, inner: StorageBackend, capacity: int, *, on_evict: OnEvict | None = None) -> None:
        self.inner = inner
        self.lru = HostLRU(capacity, on_evict=on_evict)
        # One thread: copies out of the tier are memory copies; a second would only contend for the GIL
        # (the sink's checksum holds it).
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncconn-hosttier")
        self._closed = False

    @classmethod
    async def from_url(cls, url: StoreURL) -> HostTier:
        raise TypeError("a HostTier wraps an open backend: HostTier(backend, capacity)")

    @property  # type: ignore[override]
    def on_removed(self) -> RemovedHook | None:
        """The store's removals hook: the inner store's (what leaves the tier alone stays in the store)."""
        return self.inner.on_removed

    @on_removed.setter
    def on_removed(self, hook: RemovedHook | None) -> None:
        self.inner.on_removed = hook

    @property
    def stats(self) -> TierStats:
        return self.lru.stats

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the tier holds now (no store call): where a hit on them would be served from."""
        return [key in self.lru for key in keys]

    # -- writes ------------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        checked_items(items)
        kept = [(key, data) for key, data in await self._copies(items) if self.lru.put(key, data)]
        try:
            await self.inner.put(items)
        except BaseException:  # refused, failed or cancelled: the store may not have it
            for key, data in kept:
                self.lru.discard_entry(key, data)
            raise

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        self.lru.discard(keys)
        return await self.inner.delete(keys)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    # -- reads -------------------------------------------------------------------------------------------
    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        out: list[Sequence[Buffer] | None] = [None] * len(keys)
        missing: list[int] = []
        for i, key in enumerate(keys):
            data = self.lru.get(key)
            if data is None:
                missing.append(i)
            else:
                out[i] = (data,)  # immutable bytes: the caller's reference keeps it whole
                self._hit(len(data))
        if missing:
            self.stats.misses += len(missing)
            found = await self.inner.get([keys[i] for i in missing])
            for i, chunks in zip(missing, found, strict=True):
                out[i] = chunks
            fills = [(keys[i], chunks) for i, chunks in zip(missing, found, strict=True) if chunks]
            self._keep(await self._copies(fills))
        return out

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        checked_dests(key, dests)
        (length,) = await self.get_into_many([(key, dests, sink)])
        return length

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """Hits copied from the tier (on the copy thread, each value pinned until its copy has ended), then
        the misses from the store in one call; a miss read whole is kept in the tier."""
        for key, dests, _ in reads:
            checked_dests(key, dests)
        out: list[int | None] = [None] * len(reads)
        hits: list[tuple[int, _Entry]] = []
        missing: list[int] = []
        for i, (key, _, _) in enumerate(reads):
            entry = self.lru.pin(key)
            if entry is None:
                missing.append(i)
            else:
                hits.append((i, entry))
        if hits:
            try:
                copied = await _until_done(
                    asyncio.get_running_loop().run_in_executor(self._copier, _copy_hits, reads, hits)
                )
            finally:
                for _, entry in hits:
                    self.lru.unpin(entry)
            for (i, _), length in zip(hits, copied, strict=True):
                out[i] = length
                self._hit(length)
        if missing:
            lengths = await self._inner_reads([reads[i] for i in missing], cached_only)
            fills: list[tuple[str, Value]] = []
            for i, got in zip(missing, lengths, strict=True):
                out[i] = got
                if got == NOT_CACHED:  # (that read is asked again, and counted then)
                    continue
                self.stats.misses += 1
                key, dests, _ = reads[i]
                if got is not None and got == sum(d.nbytes for d in dests):  # landed whole
                    fills.append((key, dests))
            self._keep(await self._copies(fills))
        return out

    async def _inner_reads(self, reads: list[IntoRead], cached_only: bool) -> list[int | None]:
        if not cached_only:
            return await self.inner.get_into_many(reads)
        if not self.inner.cached_reads:
            return [NOT_CACHED] * len(reads)
        return await self.inner.get_into_many(reads, cached_only=True)

    async def _copies(self, items: Sequence[tuple[str, Value]]) -> list[tuple[str, bytes]]:
        """Copies of the values that can fit the tier, made on the copy thread (a value larger than the
        bound is not even copied: any older value under its key is dropped, it may differ)."""
        fits: list[tuple[str, Value]] = []
        for key, value in items:
            if value_nbytes(value) <= self.lru.capacity:
                fits.append((key, value))
            else:
                self.lru.discard([key])
                self.stats.bypassed += 1
        if not fits:
            return []
        job = asyncio.get_running_loop().run_in_executor(self._copier, _joined, [v for _, v in fits])
        copied: list[bytes] = await _until_done(job)
        return list(zip((k for k, _ in fits), copied, strict=True))

    def _keep(self, copies: list[tuple[str, bytes]]) -> None:
        for key, data in copies:
            self.lru.put(key, data)

    def _hit(self, nbytes: int) -> None:
        self.stats.hits += 1
        self.stats.bytes_hit += nbytes

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.lru.clear()
            self._copier.shutdown(wait=False)
            await self.inner.close()


def _copy_hits(reads: Sequence[IntoRead], hits: list[tuple[int, _Entry]]) -> list[int]:
    """(copy thread) Each hit's value into its read's buffers, fed to its sink; the values' lengths.

    A value whose length differs from its buffers' is not written (the caller reports the mismatch), as
    ``StorageBackend.get_into`` says.
    """
    lengths = []
    for i, entry in hits:
        _, dests, sink = reads[i]
        targets = [d.cast("B") for d in dests]
        data = memoryview(entry.data)
        if data.nbytes == sum(t.nbytes for t in targets):
            _scatter(data, targets)
            if sink is not None:
                feed_sink(sink, targets)
        lengths.append(data.nbytes)
    return lengths


async def _until_done(job: asyncio.Future[T]) -> T:
    """Await a copy; if cancelled, let the cancellation through only once the copy has ended: the caller
    must never reuse a buffer the copy thread still writes into, nor an entry be evicted under it."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise
