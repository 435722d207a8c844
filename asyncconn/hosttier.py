"""A bounded host-memory tier in front of any store: a least-recently-used cache of values, by bytes.

Why: every load went to the store, also for a prefix this worker had saved or loaded a moment before. The
tier is a :class:`StorageBackend` that wraps the store's backend (any of them, a composite one too), so
everything above it -- framing, checksums, timeouts, the loaders -- is unchanged:

- a read that hits copies the value from the tier straight into the caller's buffers (on a CPU engine those
  are the KV cache's blocks themselves) and never calls the store; a miss reads from the store and keeps a
  copy, within the bound;
- a write keeps a copy and goes on to the store; it completes when the store's write completes (write
  through: a save is already asynchronous, the engine's step never waits for it). The tier takes the value
  only once the store has accepted it, so a write the store refused or did not finish is never held;
- ``exists`` asks the store, never the tier: a save skipped because the tier held a value the store has
  since expired would leave the store without it for good, and every lookup -- the store's -- missing;
- ``delete`` removes from both.

Memory. The tier's memory is one arena of ``capacity`` bytes (:mod:`asyncconn.hostarena`), mapped and
faulted in once, on the copy thread, when the tier is made: the tier's resident memory is its bound from the
start and never grows. A value held is an extent of the arena; a write evicts the least recently used values
until its extent fits; a value larger than the bound, or one that cannot fit because every other value is
being read (pinned) or filled, is not kept (it still goes to the store). A value is pinned while a read
copies out of it: it is never evicted, nor its memory given to another value, under that read. The tier's
index belongs to the runtime loop thread; every copy into or out of the arena runs on the tier's one copy
thread, with the GIL released for large buffers, so neither the loop nor vLLM's threads wait for it.

A miss's fill, and why it is done this way. The caller reuses its buffers once ``get_into_many`` returns,
so a copy into the tier from them cannot run after the read returns. It used to run after the store's read
had ended, into new ``bytes`` (fresh memory: page faults as well as a copy), and the load waited for all of
it: the engine's first pass over a remote store took far longer with the tier than without it. Now:

- the fill goes into the arena (memory already faulted in): a plain copy;
- it starts as soon as a value has landed, while the store still sends the next ones: the tier hands the
  store a sink of its own that passes every piece on to the caller's sink and, when a value's last byte has
  landed, reserves its extent and queues its copy. When the store's read ends, only the copy of the values
  that landed last is left to wait for. (A read without a sink is handed to the store as it is -- a sink
  changes what some stores do -- and its fill starts when the read ends; ``TensorStore`` gives every read
  one, its frame check);
- a value is indexed only after the store's read has returned it whole; a failed or cancelled read drops
  its fills (waiting first for copies in flight: they read the caller's buffers). A value whose sink was fed
  other than exactly once (a layered store that read it locally, failed, and read it from the shared store
  over it) is copied again when the read ends: the copy thread runs in order, so the tier holds what
  landed last;
- while the arena is still being made (just after the tier is), a read's values are not kept: a load never
  waits behind the arena. A write's copy does wait for it (a save is off the engine's path).

Reading a miss into the arena first and copying it out to the caller would also keep the source valid, and
costs the same one copy. It was not done because the store would then write the tier's memory instead of
the caller's: the caller's sink (its checksum, fed as each value lands, on warm bytes) would have to be fed
by the tier after its copy out, and a store that checks as it reads (Mooncake) would check the tier's
bytes, not the caller's. As built, the store's read is exactly what it is without the tier.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import numpy as np

from asyncconn.backend import (
    NOT_CACHED,
    Buffer,
    IntoRead,
    Sink,
    StorageBackend,
    Value,
    checked_dests,
    checked_items,
    checked_keys,
    feed_sink,
    sink_verifies,
    value_nbytes,
)
from asyncconn.hostarena import (
    ALIGN,
    Extent,
    Extents,
    HostMemory,
    as_arena,
    byte_arrays,
    copy_segments,
    populated_memory,
)
from asyncconn.wrapped import WrappingBackend

__all__ = ["HostLRU", "HostTier", "OnEvict", "TierStats"]

T = TypeVar("T")
log = logging.getLogger(__name__)

#: Called on the loop thread with keys that left the tier: evicted under pressure, or deleted through it.
OnEvict = Callable[[Sequence[str]], None]


@dataclass
class TierStats:
    """Counters since the tier was made (plain ints: read them from any thread).

    ``hits``/``misses`` count reads (a hit never reached the store); ``bytes_hit`` the bytes served by the
    tier; ``evictions`` values dropped to make room; ``bypassed`` values not kept because they did not fit.
    ``held_bytes``/``entries``/``pinned`` are the state now (``held_bytes``: the values' own sizes).
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
    """One value held: its extent of the arena, readers copying out of it, and whether it is indexed.

    Out of the index, an entry is *detached* (its memory is given back when its last reader ends) or
    *withdrawn* (announced mode: evicted, still readable, its memory kept until the announcement of its
    eviction is acknowledged)."""

    __slots__ = ("announced", "detached", "extent", "key", "pins", "stamp", "withdrawn")

    def __init__(self, key: str, extent: Extent, stamp: int) -> None:
        self.key = key
        self.extent = extent
        self.stamp = stamp  # the index's clock when it was indexed
        self.pins = 0
        self.detached = False
        self.announced = False  # announced mode: its key was in a report taken
        self.withdrawn = False


class HostLRU:
    """The tier's index: key -> extent of the arena, least recently used first, within ``capacity`` bytes.

    ``used`` counts the arena's bytes taken: values indexed, values being filled (reserved, not indexed
    yet), and values replaced or deleted while a read still copies out of them (freed when that read ends).
    It never exceeds ``capacity``: the bound holds for memory, not only for the index.

    Announced mode (:meth:`announce`), for a reader elsewhere that must be able to rely on what it was told
    (a KV scheduler in another process, :mod:`asyncconn.vllm.kv.tiernews`): :meth:`take_news` reports the
    keys indexed and the announced keys evicted since the last report. An announced value evicted is
    *withdrawn*: out of the index, yet still readable by :meth:`pin` / :meth:`claim`, its memory kept
    until :meth:`acknowledge` says that report was seen. Values never announced are evicted at once.
    """

    def __init__(self, capacity: int, *, align: int = ALIGN, on_evict: OnEvict | None = None) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self.on_evict = on_evict
        self.stats = TierStats()
        self.extents = Extents(capacity, align)
        #: Advances on every value indexed: a fill started before a newer value was indexed defers to it.
        self.clock = 0
        self._index: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._pinned_units = 0  # indexed entries with readers: not evictable
        self._indexed_units = 0
        self._claims: dict[str, list[_Entry]] = {}  # owner -> entries it pinned with :meth:`claim`
        self._announcing = False
        self._seq = 1  # the number of the report being gathered
        self._admitted: dict[str, None] = {}  # keys indexed since the last report, not announced yet
        self._gone: list[str] = []  # announced keys withdrawn or deleted since the last report
        self._withdrawn: collections.deque[tuple[int, str, _Entry]] = collections.deque()  # by report
        self._withdrawn_by_key: dict[str, _Entry] = {}  # the latest withdrawn entry of each key
        self._withdrawn_units = 0
        # The index is the loop thread's, but :meth:`claim` / :meth:`unclaim` come from vLLM's scheduler
        # thread: every change is made under this lock (held for index work only, never across a copy).
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self.extents.used_bytes

    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def readable(self, key: str) -> bool:
        """Whether a read of ``key`` would be served now: indexed, or withdrawn and not yet acknowledged
        (nothing is marked used: for checks)."""
        with self._lock:
            return key in self._index or key in self._withdrawn_by_key

    def pin(self, key: str) -> _Entry | None:
        """The entry under ``key``, marked most recently used and pinned; ``None`` when not held."""
        with self._lock:
            return self._pin(key)

    def unpin(self, entry: _Entry) -> None:
        with self._lock:
            self._unpin(entry)

    def claim(self, owner: str, keys: Sequence[str]) -> list[bool]:
        """Pin each of ``keys`` the tier holds for ``owner`` until :meth:`unclaim` (any thread): which were
        held. A claimed value stays readable -- never evicted, its memory never reused -- so a load planned
        on the claim is served by the tier. Claiming again for an owner adds to its claims."""
        with self._lock:
            entries = [self._pin(key) for key in keys]
            held = [entry for entry in entries if entry is not None]
            if held:
                self._claims.setdefault(owner, []).extend(held)
        return [entry is not None for entry in entries]

    def unclaim(self, owner: str) -> None:
        """Release ``owner``'s claims (any thread; nothing when it has none)."""
        with self._lock:
            for entry in self._claims.pop(owner, ()):
                self._unpin(entry)

    @property
    def claims(self) -> int:
        """Owners holding claims now."""
        return len(self._claims)

    def _pin(self, key: str) -> _Entry | None:
        entry = self._index.get(key)
        if entry is None:
            entry = self._withdrawn_by_key.get(key)  # evicted, announced: readable until acknowledged
            if entry is None:
                return None
        else:
            self._index.move_to_end(key)
            if entry.pins == 0:
                self._pinned_units += entry.extent.units
        entry.pins += 1
        self.stats.pinned += 1
        return entry

    def _unpin(self, entry: _Entry) -> None:
        entry.pins -= 1
        self.stats.pinned -= 1
        if entry.pins:
            return
        if entry.detached:
            if self._withdrawn_by_key.get(entry.key) is entry:  # acknowledged while pinned: readable so far
                del self._withdrawn_by_key[entry.key]
            self.extents.give(entry.extent)
        elif not entry.withdrawn:
            self._pinned_units -= entry.extent.units

    # -- announced mode ---------------------------------------------------------------------------------
    def announce(self) -> None:
        """Enter announced mode (see the class docstring); once, before the first value is indexed."""
        with self._lock:
            self._announcing = True

    def take_news(self) -> tuple[int, list[str], list[str]] | None:
        """``(report number, keys indexed, keys gone)`` since the last report, the indexed ones now
        announced; None when there is nothing new (a report number is used only when taken)."""
        with self._lock:
            if not (self._admitted or self._gone):
                return None
            admitted = list(self._admitted)
            for key in admitted:
                self._index[key].announced = True
            gone, self._gone = self._gone, []
            self._admitted = {}
            seq = self._seq
            self._seq += 1
            return seq, admitted, gone

    def acknowledge(self, seq: int) -> None:
        """Reports up to ``seq`` were seen: their withdrawn values' memory is free (once unpinned)."""
        with self._lock:
            withdrawn = self._withdrawn
            while withdrawn and withdrawn[0][0] <= seq:
                _, key, entry = withdrawn.popleft()
                self._free_withdrawn(key, entry)

    @property
    def withdrawn(self) -> int:
        """Withdrawn values whose memory waits for an acknowledgement."""
        return len(self._withdrawn)

    def _free_withdrawn(self, key: str, entry: _Entry) -> None:
        """Acknowledged: the memory is free -- once no claim or read pins it; until then the value stays
        readable (a load planned on it may not have started its read)."""
        self._withdrawn_units -= entry.extent.units
        entry.withdrawn = False
        if entry.pins:
            entry.detached = True
            return
        if self._withdrawn_by_key.get(key) is entry:
            del self._withdrawn_by_key[key]
        self.extents.give(entry.extent)

    def _withdraw(self, key: str) -> None:
        """Evict an announced value: out of the index, readable and its memory kept until acknowledged."""
        entry = self._index.pop(key)
        units = entry.extent.units
        self._indexed_units -= units
        self.stats.held_bytes -= entry.extent.size
        self.stats.entries -= 1
        if entry.pins:
            self._pinned_units -= units
        entry.withdrawn = True
        self._withdrawn.append((self._seq, key, entry))
        self._withdrawn_by_key[key] = entry
        self._withdrawn_units += units
        self._gone.append(key)

    def reserve(self, nbytes: int) -> Extent | None:
        """Room for a value of ``nbytes``, evicting least recently used values as needed; ``None`` when it
        cannot fit (larger than the bound, or the rest is pinned or being filled) -- then nothing is
        evicted -- or, in announced mode, when its room is still withdrawn (evicted now, free once
        acknowledged). The room is the caller's until :meth:`commit` or :meth:`release`."""
        evicted: list[str] = []
        with self._lock:
            extent = self._reserve(nbytes, evicted)
        if evicted:
            self._report(evicted)
        return extent

    def _reserve(self, nbytes: int, evicted: list[str]) -> Extent | None:
        extents = self.extents
        need = extents.units_for(nbytes)
        evictable = self._indexed_units - self._pinned_units
        if need > extents.units or extents.free_units + evictable < need:
            self.stats.bypassed += 1
            return None
        if extents.free_units < need:
            for old_key in list(self._index):  # oldest first
                if extents.free_units >= need:
                    break
                entry = self._index[old_key]
                if entry.pins == 0 and not entry.announced:
                    self._drop(old_key)
                    evicted.append(old_key)
        if extents.free_units < need:
            # Announced mode: values the scheduler was told of go last, withdrawn (their room comes back
            # once it has seen them go), and no more of them than the room this value needs.
            for old_key in list(self._index):
                if extents.free_units + self._withdrawn_units >= need:
                    break
                if self._index[old_key].pins == 0:
                    self._withdraw(old_key)
                    evicted.append(old_key)
        self.stats.evictions += len(evicted)
        if extents.free_units < need:  # announced mode: the room frees once the scheduler has seen it go
            self.stats.bypassed += 1
            return None
        extent = extents.take(nbytes)
        assert extent is not None  # enough units were free or evictable
        return extent

    def release(self, extent: Extent) -> None:
        """A reservation given up (its fill failed or was not wanted)."""
        with self._lock:
            self.extents.give(extent)

    def commit(self, key: str, extent: Extent, *, since: int | None = None) -> _Entry | None:
        """Index ``extent`` (reserved, filled) under ``key``, replacing any older value. With ``since`` (the
        clock when the fill's read started), a value indexed under ``key`` after it is newer and stays:
        the reservation is released and ``None`` returned."""
        with self._lock:
            held = self._index.get(key)
            if since is not None and held is not None and held.stamp > since:
                self.extents.give(extent)
                return None
            old = self._drop(key, replaced=True)
            announced = old is not None and old.announced
            self.clock += 1
            entry = _Entry(key, extent, self.clock)
            entry.announced = announced  # the key stays held: nothing to announce again
            if self._announcing and not announced:
                self._admitted[key] = None
            self._index[key] = entry
            self._indexed_units += extent.units
            self.stats.held_bytes += extent.size
            self.stats.entries += 1
            return entry

    def peek(self, key: str) -> _Entry | None:
        """The entry under ``key`` (marked most recently used), not pinned."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None:
                self._index.move_to_end(key)
            return entry

    def discard(self, keys: Sequence[str]) -> int:
        """Stop holding ``keys`` (reported to ``on_evict``); how many were held."""
        with self._lock:
            for key in keys:  # a withdrawn value deleted is not read again either
                self._withdrawn_by_key.pop(key, None)
            gone = [key for key in keys if self._drop(key)]
        if gone:
            self._report(gone)
        return len(gone)

    def forget(self, key: str) -> None:
        """Stop holding ``key`` without reporting it (it is about to be replaced). Announced mode: an
        announced value is withdrawn instead (readable until acknowledged: the same key holds the same
        bytes), as the new value may yet not be kept."""
        with self._lock:
            entry = self._index.get(key)
            if entry is not None and entry.announced:
                self._withdraw(key)
            else:
                self._drop(key)

    def clear(self) -> None:
        """Hold nothing (claimed values' memory is given back as their owners unclaim them)."""
        with self._lock:
            for key in list(self._index):
                self._drop(key)
            while self._withdrawn:
                _, key, entry = self._withdrawn.popleft()
                self._free_withdrawn(key, entry)

    def _drop(self, key: str, *, replaced: bool = False) -> _Entry | None:
        """Unindex ``key`` now (its memory free once unpinned); the entry, if it was held. An announced key
        that goes (not ``replaced`` by a new value) is reported gone; one not announced yet never is."""
        entry = self._index.pop(key, None)
        if entry is None:
            return None
        if self._announcing:
            self._admitted.pop(key, None)
            if entry.announced and not replaced:
                self._gone.append(key)
        units = entry.extent.units
        self._indexed_units -= units
        self.stats.held_bytes -= entry.extent.size
        self.stats.entries -= 1
        if entry.pins:  # a read still copies out of it: its memory is not free yet
            entry.detached = True
            self._pinned_units -= units
        else:
            self.extents.give(entry.extent)
        return entry

    def _report(self, keys: list[str]) -> None:
        if self.on_evict is not None:
            self.on_evict(keys)


class HostTier(WrappingBackend):
    """``inner`` behind a host-memory LRU of at most ``capacity`` bytes (see the module's docstring).

    Reads straight into caller memory and serves ``cached_only`` reads: a value in the tier is a memory
    copy; a miss is the inner store's (its ``cached_only`` answer when it can give one, else
    ``NOT_CACHED``). ``on_evict`` is told the keys that leave the tier. ``memory`` makes the arena (called
    once, on the copy thread, with its size): by default anonymous memory faulted in at once; a CUDA engine's
    connector passes its pinned allocator. Should it fail, the tier holds nothing and every call goes to
    the store. Owned by the runtime loop thread.
    """

    reads_into: ClassVar[bool] = True
    batch_reads: ClassVar[bool] = True
    cached_reads: ClassVar[bool] = True

    def __init__(
        self,
        inner: StorageBackend,
        capacity: int,
        *,
        on_evict: OnEvict | None = None,
        memory: HostMemory | None = None,
        align: int = ALIGN,
    ) -> None:
        self.inner = inner
        self.lru = HostLRU(capacity, align=align, on_evict=on_evict)
        # One thread: copies into and out of the tier are memory copies; a second would only contend for the
        # GIL (the sink's checksum holds it). Its first job makes the arena, so every copy runs after it and
        # nothing waits for the memory on the loop or in the engine's start.
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="asyncconn-hosttier")
        self._arena: concurrent.futures.Future[np.ndarray] = self._copier.submit(
            _make_arena, memory or populated_memory, self.lru.extents.nbytes
        )
        self._closed = False

    built_as: ClassVar[str] = "wraps an open backend: HostTier(backend, capacity)"

    @property
    def removals_from(self) -> StorageBackend:
        """The inner store: its removals are the tier's (what leaves the tier alone stays in the store)."""
        return self.inner

    @property
    def stats(self) -> TierStats:
        return self.lru.stats

    async def ready(self) -> None:
        """Wait until the arena is made (raises what making it raised)."""
        await asyncio.wrap_future(self._arena)

    def holds(self, keys: Sequence[str]) -> list[bool]:
        """Which keys the tier holds now (no store call): where a hit on them would be served from."""
        return [key in self.lru for key in keys]

    def _reserve(self, nbytes: int, *, fill: bool = False) -> Extent | None:
        """Room for a value, unless the arena could not be made (then the tier keeps nothing). A read's
        ``fill`` is not kept while the arena is still being made: a load never waits for it (a write,
        off the engine's path, does: its copy runs after it)."""
        if self._closed or (self._arena.done() and self._arena.exception() is not None):
            return None
        if fill and not self._arena.done():
            return None
        return self.lru.reserve(nbytes)

    # -- writes ------------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        """Copy each value into the arena while the store writes it (both read the caller's buffers); index
        the copies once the store has accepted the write."""
        checked_items(items)
        reserved: list[tuple[str, Extent, Value]] = []
        for key, value in items:
            size = value_nbytes(value)
            if size > self.lru.capacity:
                self.lru.discard([key])  # an older value under the key may differ: not served any more
            else:
                self.lru.forget(key)
            extent = self._reserve(size)
            if extent is not None:
                reserved.append((key, extent, value))
        if not reserved:
            await self.inner.put(items)
            return
        job = self._copier.submit(_fill_values, self._arena, self.lru.extents.align, reserved)
        try:
            try:
                await self.inner.put(items)
            finally:  # (the copy reads the caller's buffers: it ends before the caller goes on)
                await _all_ended([job])
        except BaseException:  # refused, failed or cancelled: the store may not have it
            for _, extent, _ in reserved:
                self.lru.release(extent)
            raise
        failed = job.exception() is not None  # no arena: the store's write stands, the tier keeps nothing
        for key, extent, _ in reserved:
            if failed:
                self.lru.release(extent)
            else:
                self.lru.commit(key, extent)

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        self.lru.discard(keys)
        return await self.inner.delete(keys)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.inner.exists(keys)

    # -- reads -------------------------------------------------------------------------------------------
    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        """Hits as copies of the held bytes (made on the copy thread); misses from the store, kept."""
        checked_keys(keys)
        out: list[Sequence[Buffer] | None] = [None] * len(keys)
        hits: list[tuple[int, _Entry]] = []
        missing: list[int] = []
        for i, key in enumerate(keys):
            entry = self.lru.pin(key)
            if entry is None:
                missing.append(i)
            else:
                hits.append((i, entry))
        if hits:
            copying = self._copier.submit(
                _copy_out, self._arena, self.lru.extents.align, [e for _, e in hits]
            )
            try:
                copies = await _until_done(asyncio.wrap_future(copying))
            finally:
                for _, entry in hits:
                    self.lru.unpin(entry)
            for (i, _), data in zip(hits, copies, strict=True):
                out[i] = (data,)
                self._hit(len(data))
        if missing:
            self.stats.misses += len(missing)
            since = self.lru.clock
            found = await self.inner.get([keys[i] for i in missing])
            fills: list[tuple[str, Extent, Value]] = []
            for i, chunks in zip(missing, found, strict=True):
                out[i] = chunks
                if chunks:
                    extent = self._reserve(value_nbytes(chunks), fill=True)
                    if extent is not None:
                        fills.append((keys[i], extent, chunks))
            if fills:  # the store's chunks are ours: nothing else writes them meanwhile
                job = self._copier.submit(_fill_values, self._arena, self.lru.extents.align, fills)
                try:
                    await _all_ended([job])
                except BaseException:
                    for _, extent, _ in fills:
                        self.lru.release(extent)
                    raise
                for key, extent, _ in fills:
                    if job.exception() is None:
                        self.lru.commit(key, extent, since=since)
                    else:
                        self.lru.release(extent)
        return out

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        checked_dests(key, dests)
        (length,) = await self.get_into_many([(key, dests, sink)])
        return length

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """Hits copied from the tier (on the copy thread, each value pinned until its copy has ended), then
        the misses from the store in one call, each copied into the tier as it lands; a miss read whole is
        kept."""
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
            job = self._copier.submit(_copy_hits, self._arena, self.lru.extents.align, reads, hits)
            try:
                copied = await _until_done(asyncio.wrap_future(job))
            finally:
                for _, entry in hits:
                    self.lru.unpin(entry)
            for (i, _), length in zip(hits, copied, strict=True):
                out[i] = length
                self._hit(length)
        if missing:
            lengths = await self._read_filling([reads[i] for i in missing], cached_only)
            for i, got in zip(missing, lengths, strict=True):
                out[i] = got
                if got != NOT_CACHED:  # (that read is asked again, and counted then)
                    self.stats.misses += 1
        return out

    async def _read_filling(self, reads: list[IntoRead], cached_only: bool) -> list[int | None]:
        """The store's read of ``reads``, each value copied into the tier as soon as it has landed."""
        fill = _Fill(self, reads)
        try:
            lengths = await self._inner_reads(fill.reads, cached_only)
        except BaseException:
            await fill.abandon()
            raise
        await fill.finish(lengths)
        return lengths

    async def _inner_reads(self, reads: Sequence[IntoRead], cached_only: bool) -> list[int | None]:
        if not cached_only:
            return await self.inner.get_into_many(reads)
        if not self.inner.cached_reads:
            return [NOT_CACHED] * len(reads)
        return await self.inner.get_into_many(reads, cached_only=True)

    def _hit(self, nbytes: int) -> None:
        self.stats.hits += 1
        self.stats.bytes_hit += nbytes

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.lru.clear()
            # Copies already queued still run (they hold the arena); the memory goes with the last of them.
            self._copier.shutdown(wait=False)
            self._arena = concurrent.futures.Future()
            self._arena.set_exception(RuntimeError("the host tier is closed"))
            await self.inner.close()


class _Fill:
    """The fills of one store read: a sink per value that notices its last byte land, the extents reserved
    for them, and their copies queued on the copy thread. Its methods run on the loop thread, except the
    sinks' (on whichever thread the store lands values)."""

    def __init__(self, tier: HostTier, reads: list[IntoRead]) -> None:
        self.tier = tier
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.since = tier.lru.clock
        self.closed = False
        self.sizes = [sum(d.nbytes for d in dests) for _, dests, _ in reads]
        self.started: dict[int, tuple[Extent, concurrent.futures.Future[None]] | None] = {}
        self.jobs: list[concurrent.futures.Future[None]] = []  # every copy queued (some values twice)
        # A read without a sink is handed on as it is: a sink changes what some stores do (Mooncake checks
        # a value as it feeds it, and no longer reads a torn one again), so its fill starts after the read.
        self.reads: list[IntoRead] = [
            (key, dests, _Landing(self, i, sink, size) if sink is not None else None)
            for i, ((key, dests, sink), size) in enumerate(zip(reads, self.sizes, strict=True))
        ]

    def landed(self, index: int) -> None:
        """(any thread) Value ``index`` has landed whole in the caller's buffers: start its fill."""
        if threading.get_ident() == self.loop_thread:
            self.start(index)
            return
        with contextlib.suppress(RuntimeError):  # the loop is closing: nothing is kept
            self.loop.call_soon_threadsafe(self.start, index)

    def start(self, index: int) -> None:
        if self.closed or index in self.started:
            return
        extent = self.tier._reserve(self.sizes[index], fill=True)
        if extent is None:
            self.started[index] = None
            return
        self.started[index] = (extent, self._copy(index, extent))

    def _copy(self, index: int, extent: Extent) -> concurrent.futures.Future[None]:
        _, dests, _ = self.reads[index]
        job = self.tier._copier.submit(
            _fill_values, self.tier._arena, self.tier.lru.extents.align, [("", extent, dests)]
        )
        self.jobs.append(job)
        return job

    async def finish(self, lengths: list[int | None]) -> None:
        """Start the fills of values read whole that no sink started, wait for every copy, and index the
        values read whole (a copy that failed, or of a value not read whole, is given up).

        A value whose sink was fed other than exactly once (a layered store read it locally, failed, and
        read it again from the shared store) is copied again now that its bytes are final: the copy thread
        runs jobs in order, so the later copy is what the tier holds."""
        whole = {i for i, (got, size) in enumerate(zip(lengths, self.sizes, strict=True)) if got == size}
        for i in sorted(whole):
            started = self.started.get(i)
            landing = self.reads[i][2]
            if started is not None and not (isinstance(landing, _Landing) and landing.fed == self.sizes[i]):
                extent = started[0]
                self.started[i] = (extent, self._copy(i, extent))
            else:
                self.start(i)
        self.closed = True
        try:
            await _all_ended(self.jobs)
        except BaseException:  # cancelled (once the copies have ended)
            self._give_up()
            raise
        for i, started in self.started.items():
            if started is None:
                continue
            extent, job = started
            if i in whole and job.exception() is None:
                self.tier.lru.commit(self.reads[i][0], extent, since=self.since)
            else:
                self.tier.lru.release(extent)

    async def abandon(self) -> None:
        """The store's read failed or was cancelled: wait for the copies in flight (they read the caller's
        buffers), then give every reservation up."""
        self.closed = True
        try:
            await _all_ended(self.jobs)
        finally:
            self._give_up()

    def _give_up(self) -> None:
        for started in self.started.values():
            if started is not None:
                self.tier.lru.release(started[0])
        self.started.clear()


class _Landing:
    """The sink the store is handed for one value: passes every piece on to the caller's sink, and tells
    the fill when the value's last byte has landed."""

    __slots__ = ("fed", "fill", "index", "sink", "size", "verifies_value")

    def __init__(self, fill: _Fill, index: int, sink: Sink, size: int) -> None:
        self.fill = fill
        self.index = index
        self.sink = sink
        self.size = size
        self.fed = 0
        # The store may skip its own checksum for a caller that checks the value: only the caller can say.
        self.verifies_value = sink_verifies(sink)

    def __call__(self, piece: memoryview) -> None:
        self.sink(piece)
        self._count(piece.nbytes)

    def feed_many(self, pieces: Sequence[memoryview]) -> None:
        feed_sink(self.sink, pieces)
        self._count(sum(p.nbytes for p in pieces))

    def _count(self, nbytes: int) -> None:
        self.fed += nbytes
        if self.fed == self.size:
            self.fill.landed(self.index)


# -- on the copy thread ----------------------------------------------------------------------------------


def _make_arena(memory: HostMemory, nbytes: int) -> np.ndarray:
    try:
        return as_arena(memory(nbytes), nbytes)
    except BaseException as exc:
        log.warning("host tier: its %d bytes of memory could not be made (%r); it keeps nothing", nbytes, exc)
        raise


def _fill_values(
    arena: concurrent.futures.Future[np.ndarray], align: int, fills: list[tuple[str, Extent, Value]]
) -> None:
    """Each value's bytes (one buffer or its chunks) into its extent."""
    memory = arena.result()  # made by this thread's first job: done
    for _, extent, value in fills:
        parts = [value] if isinstance(value, (bytes, bytearray, memoryview)) else list(value)
        copy_segments(byte_arrays(parts), extent.arrays(memory, align))


def _copy_out(arena: concurrent.futures.Future[np.ndarray], align: int, entries: list[_Entry]) -> list[bytes]:
    memory = arena.result()
    return [b"".join(a.data for a in entry.extent.arrays(memory, align)) for entry in entries]


def _copy_hits(
    arena: concurrent.futures.Future[np.ndarray],
    align: int,
    reads: Sequence[IntoRead],
    hits: list[tuple[int, _Entry]],
) -> list[int]:
    """Each hit's value into its read's buffers, fed to its sink; the values' lengths.

    A value whose length differs from its buffers' is not written (the caller reports the mismatch), as
    ``StorageBackend.get_into`` says.
    """
    memory = arena.result()
    lengths = []
    for i, entry in hits:
        _, dests, sink = reads[i]
        targets = [d.cast("B") for d in dests]
        size = entry.extent.size
        if size == sum(t.nbytes for t in targets):
            copy_segments(entry.extent.arrays(memory, align), byte_arrays(targets))
            if sink is not None:
                feed_sink(sink, targets)
        lengths.append(size)
    return lengths


async def _until_done(job: asyncio.Future[T]) -> T:
    """Await a copy; if cancelled, let the cancellation through only once the copy has ended: the caller
    must never reuse a buffer the copy thread still reads or writes, nor an entry be evicted under it."""
    try:
        return await asyncio.shield(job)
    except asyncio.CancelledError:
        await asyncio.wait([job])
        raise


async def _all_ended(jobs: Sequence[concurrent.futures.Future[Any]]) -> None:
    """Wait for every copy to end, whatever it ends with (its error is the caller's to look at), even if
    this task is cancelled meanwhile: the cancellation is passed on once they have all ended."""
    if not jobs:
        return
    waiting = asyncio.gather(*(asyncio.wrap_future(job) for job in jobs), return_exceptions=True)
    cancelled = False
    while not waiting.done():
        try:
            await asyncio.wait([waiting])
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
