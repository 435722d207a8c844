"""A store on this host in front of the shared one: ``local_store_url`` (a ``file://`` directory) before
``backend_url``.

Why: a node-local disk holds far more than host memory (the host tier) and serves a value at page-cache or
NVMe speed, while the shared store (Redis, a cluster, Mooncake, a shared directory) is what every engine in
the fleet sees. :class:`LayeredBackend` is a :class:`StorageBackend` made of the two, so everything above it
-- framing, checksums, timeouts, the loaders, the host tier -- is unchanged:

- a read goes to the local store first; what it misses is read from the shared store in one call, and each
  such value read whole is *filled*: copied (a memory copy: the caller's buffers are the caller's again once
  the read returns) and written to the local store in the background, after the read has returned. A load
  never waits for the local disk; a later read of the value on this host never leaves the host;
- fills are owned: tasks of this store, at most :data:`FILL_BYTES_IN_FLIGHT` bytes of them copied and not yet
  written. A value past that bound is not filled (counted in ``fills_skipped``): the copies stay bounded
  when the disk is slower than the shared store, and the read never waits for room. They are written in
  pieces of about :data:`FILL_WRITE_BYTES`, one piece at a time, so the local store's own reads never
  queue behind a batch of them. The copies' memory is reused by later copies (``_Buffers``) and let go
  once fills stop. ``close`` lets the piece being written end and drops the rest; a failed fill is counted
  in ``local_errors``;
- a write goes to both at once and completes when both have ended; it fails only if the shared store's
  write failed (the local copy is then removed again, so the local store never holds what the shared one
  refused). A failed local write is counted and logged, never raised: the shared store has the value;
- ``exists`` asks the shared store only: it is the fleet's truth, and a save skipped because this host's
  disk held a value the shared store has since expired would leave every other host missing it for good;
- ``delete`` removes from both (a corrupt value found on either is gone from both);
- a write or a delete wins over fills: a fill write of its keys under way is waited for before the local
  store is touched, none starts while it runs, and a fill of a value read before it ended drops the key. So
  a late fill never brings back what a delete removed or a refused write took out, nor writes an older value
  over a newer one;
- removals reported (``on_removed``) are the shared store's: the local store's own ``max_bytes`` / ``max_age``
  sweep drops only this host's copy, never the value.

A value the local store holds but the shared store has lost is still served when a lookup finds it (the
lookup asks the shared store, so that happens only between its answer and the read): the bytes are checked
like any other.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, fields
from typing import ClassVar, TypeVar

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
    value_nbytes,
)
from asyncconn.exceptions import AsyncConnError
from asyncconn.wrapped import WrappingBackend

__all__ = [
    "FILL_BUFFERS_IDLE_S",
    "FILL_BYTES_IN_FLIGHT",
    "FILL_WRITE_BYTES",
    "LayeredBackend",
    "LayeredStats",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Bytes of fills copied and not yet written to the local store, at most. Why a fixed bound rather than a
#: setting: it only has to cover the loads of a few steps while the disk writes them, and to stop the copies
#: from growing without end when the local disk is slower than the shared store; a value past it costs only
#: a later read of the shared store (counted in ``fills_skipped``).
FILL_BYTES_IN_FLIGHT = 256 << 20

#: Bytes of one local write of a fill, about (whole values: one larger is written alone). Why fills are
#: written one such piece at a time, by one fill at a time: the local store's reads share its threads with
#: its writes, and a read queued behind a whole batch of fill writes would wait for all of them -- the wait
#: the background fill is there to take off the load.
FILL_WRITE_BYTES = 1 << 20

#: Seconds the memory of fills' copies is kept for the next fills once none is under way (see _Buffers).
FILL_BUFFERS_IDLE_S = 10.0

#: How many invalidation records (``_invalidated``) are kept before those no read can need are pruned.
_PRUNE_MIN = 1024


@dataclass
class LayeredStats:
    """Counters since the store was opened (plain ints: read them from any thread).

    ``local_hits``/``local_misses``: reads the local store served / passed on to the shared one;
    ``fills``: values read from the shared store and written locally; ``fills_skipped``: values read from
    the shared store and not written locally because :data:`FILL_BYTES_IN_FLIGHT` bytes of fills were under
    way; ``local_errors``: local reads or writes that failed (the shared store served or kept the value
    instead).
    """

    local_hits: int = 0
    local_misses: int = 0
    fills: int = 0
    fills_skipped: int = 0
    local_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _Fill:
    """Values read from the shared store, copied, to be written to the local store by ``task``."""

    items: list[tuple[str, Value]]
    nbytes: int
    #: The store's invalidation count when the read of these values began (see ``LayeredBackend._since``).
    since: int
    #: The keys of the local write under way, and a future done when it has ended: a write cannot be taken
    #: back once the local store has it, only waited for.
    writing: frozenset[str] = frozenset()
    written: asyncio.Future[None] | None = field(default=None, repr=False)
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class _Buffers:
    """The memory of fills' copies, kept for the next ones.

    Why: a fresh buffer per copy is memory the kernel faults in page by page while the copy runs, several
    times the cost of the copy itself, on the read's path; a buffer kept from an earlier fill is a plain
    memory copy. What is kept is bounded like the copies (:data:`FILL_BYTES_IN_FLIGHT`) and let go when
    fills stop (:data:`FILL_BUFFERS_IDLE_S`). A buffer comes back only once the local store's write of it
    has returned: the store holds no reference to it then.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[bytearray]] = {}
        self.kept = 0

    def snapshot(self, value: Sequence[Buffer]) -> Value:
        """A copy of ``value`` that no one can change: immutable ``bytes`` chunks as they are, else one
        memory copy of the whole into a kept buffer (the caller's buffers are its own again after the
        read)."""
        if all(type(chunk) is bytes for chunk in value):
            return tuple(value)
        parts = [memoryview(chunk).cast("B") for chunk in value]
        size = sum(part.nbytes for part in parts)
        free = self._free.get(size)
        if free:
            buf = free.pop()
            self.kept -= size
        else:
            buf = bytearray(size)
        view = memoryview(buf)
        offset = 0
        for part in parts:
            view[offset : offset + part.nbytes] = part
            offset += part.nbytes
        return buf

    def give(self, value: Value) -> None:
        """``value``, a copy the local store is done with, to be reused (when it is one of ours)."""
        if type(value) is bytearray and self.kept + len(value) <= FILL_BYTES_IN_FLIGHT:
            self._free.setdefault(len(value), []).append(value)
            self.kept += len(value)

    def clear(self) -> None:
        self._free.clear()
        self.kept = 0


class LayeredBackend(WrappingBackend):
    """``local`` in front of ``shared`` (see the module docstring). Owned by the runtime loop thread."""

    built_as: ClassVar[str] = "joins two open backends: LayeredBackend(local, shared)"
    reads_into: ClassVar[bool] = True
    batch_reads: ClassVar[bool] = True
    cached_reads: ClassVar[bool] = True

    def __init__(self, local: StorageBackend, shared: StorageBackend) -> None:
        self.local = local
        self.shared = shared
        self.stats = LayeredStats()
        self._closed = False
        self._warned = False
        # Fills under way: their tasks (owned: awaited or cancelled by close), the fill that will write each
        # key (at most one per key), and the bytes they hold.
        self._fills: dict[asyncio.Task[None], _Fill] = {}
        self._filling: dict[str, _Fill] = {}
        self._fill_bytes = 0
        # Why fills are checked against writes and deletes: a value read from the shared store before a
        # write or delete of its key ended may be older than what the change left, so its fill must not land
        # after the change. ``_seq`` counts the changes that ended; each read from the shared store and each
        # fill holds the count it began at (``_since``); ``_invalidated`` is, per key, the count its last
        # change ended at (kept while an older holder may need it); ``_changing`` the keys being written or
        # deleted now (no fill of them starts meanwhile).
        self._seq = 0
        self._since: collections.Counter[int] = collections.Counter()
        self._invalidated: dict[str, int] = {}
        self._prune_at = _PRUNE_MIN
        self._changing: collections.Counter[str] = collections.Counter()
        self._fill_lock = asyncio.Lock()  # one fill write at a time (see FILL_WRITE_BYTES)
        self._buffers = _Buffers()
        self._idle: asyncio.TimerHandle | None = None  # lets the buffers go once fills have stopped

    @property
    def removals_from(self) -> StorageBackend:
        """The shared store: its removals are this store's (what leaves the local disk alone stays in it)."""
        return self.shared

    # -- writes ------------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        checked_items(items)
        keys = [key for key, _ in items]
        writing = self._change_begins(keys)
        try:
            local, shared = await asyncio.gather(
                self._put_local(items, writing), self.shared.put(items), return_exceptions=True
            )
            if isinstance(local, BaseException):  # not the local store's own failure (counted there): a bug
                raise local
            if isinstance(shared, BaseException):
                if local[0]:  # the local store must not keep what the shared one may not have
                    await self._local(self.local.delete(keys), "delete")
                raise shared
        finally:
            self._change_ends(keys)

    async def _put_local(
        self, items: Sequence[tuple[str, Value]], writing: set[asyncio.Future[None]]
    ) -> tuple[bool, None]:
        if writing:  # a fill writing an older value of these keys lands first, not over this write
            await asyncio.wait(writing)
        return await self._local(self.local.put(items), "put")

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        writing = self._change_begins(keys)
        try:
            if writing:  # a fill writing these keys lands first, then is deleted with the rest
                await asyncio.wait(writing)
            await self._local(self.local.delete(keys), "delete")
            return await self.shared.delete(keys)
        finally:
            self._change_ends(keys)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.shared.exists(keys)

    def _change_begins(self, keys: Sequence[str]) -> set[asyncio.Future[None]]:
        """``keys`` are about to be written or deleted: no fill of them starts until :meth:`_change_ends`.
        Returns the fill writes of them under way, for the caller to wait for before it touches the local
        store (a fill not yet writing a key will skip it)."""
        for key in keys:
            self._changing[key] += 1
        writing: set[asyncio.Future[None]] = set()
        for key in keys:
            fill = self._filling.get(key)
            if fill is not None and key in fill.writing and fill.written is not None:
                writing.add(fill.written)
        return writing

    def _change_ends(self, keys: Sequence[str]) -> None:
        """The change of ``keys`` ended: a value read from the shared store before now may predate it, so
        fills of reads that began before now drop these keys."""
        if self._since:  # else no read or fill is under way: none can hold an older value
            self._seq += 1
            for key in keys:
                self._invalidated[key] = self._seq
        for key in keys:
            left = self._changing[key] - 1
            if left:
                self._changing[key] = left
            else:
                del self._changing[key]

    def _stale(self, key: str, since: int) -> bool:
        """Whether a value of ``key`` read from the shared store since ``since`` must not be filled."""
        return key in self._changing or self._invalidated.get(key, -1) > since

    def _begin(self) -> int:
        since = self._seq
        self._since[since] += 1
        return since

    def _end(self, since: int) -> None:
        left = self._since[since] - 1
        if left:
            self._since[since] = left
        else:
            del self._since[since]
        if not self._since:
            self._invalidated.clear()
        elif len(self._invalidated) > self._prune_at:  # keep only what a holder still under way may need
            oldest = min(self._since)
            self._invalidated = {key: seq for key, seq in self._invalidated.items() if seq > oldest}
            self._prune_at = max(_PRUNE_MIN, 2 * len(self._invalidated))

    # -- reads -------------------------------------------------------------------------------------------
    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        ok, found = await self._local(self.local.get(keys), "get")
        out: list[Sequence[Buffer] | None] = list(found) if ok and found is not None else [None] * len(keys)
        missing = [i for i, chunks in enumerate(out) if chunks is None]
        self.stats.local_hits += len(keys) - len(missing)
        if missing:
            self.stats.local_misses += len(missing)
            since = self._begin()
            try:
                fetched = await self.shared.get([keys[i] for i in missing])
                fills: list[tuple[str, Sequence[Buffer]]] = []
                for i, chunks in zip(missing, fetched, strict=True):
                    out[i] = chunks
                    if chunks:
                        fills.append((keys[i], chunks))
                self._fill_later(fills, since)
            finally:
                self._end(since)
        return out

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        checked_dests(key, dests)
        (length,) = await self.get_into_many([(key, dests, sink)])
        return length

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """The local store's reads, then its misses from the shared store in one call, each value that
        landed whole copied and written locally in the background. ``cached_only``: the local store's answer
        alone (a miss there is ``NOT_CACHED``: asked again without it, it goes to the shared store)."""
        for key, dests, _ in reads:
            checked_dests(key, dests)
        if cached_only:
            if not self.local.cached_reads:
                return [NOT_CACHED] * len(reads)
            ok, got = await self._local(self.local.get_into_many(reads, cached_only=True), "get")
            if not ok or got is None:
                return [NOT_CACHED] * len(reads)
            self.stats.local_hits += sum(1 for n in got if n is not None and n != NOT_CACHED)
            return [NOT_CACHED if n is None else n for n in got]
        ok, local = await self._local(self.local.get_into_many(reads), "get")
        out: list[int | None] = list(local) if ok and local is not None else [None] * len(reads)
        missing = [i for i, length in enumerate(out) if length is None]
        self.stats.local_hits += len(reads) - len(missing)
        if missing:
            self.stats.local_misses += len(missing)
            since = self._begin()
            try:
                lengths = await self.shared.get_into_many([reads[i] for i in missing])
                fills: list[tuple[str, Sequence[Buffer]]] = []
                for i, length in zip(missing, lengths, strict=True):
                    out[i] = length
                    key, dests, _ = reads[i]
                    if length is not None and length == sum(d.nbytes for d in dests):  # landed whole
                        fills.append((key, dests))
                self._fill_later(fills, since)
            finally:
                self._end(since)
        return out

    # -- fills -------------------------------------------------------------------------------------------
    def _fill_later(self, values: list[tuple[str, Sequence[Buffer]]], since: int) -> None:
        """Copy ``values`` (read from the shared store by a read that began at ``since``) and write them to
        the local store in a task of this store: the read returns without waiting for the local disk."""
        if self._closed or not values:
            return
        items: list[tuple[str, Value]] = []
        taken: set[str] = set()
        nbytes = 0
        for key, value in values:
            if key in taken or key in self._filling or self._stale(key, since):
                continue  # written by a fill under way, or older than a change of the key
            size = value_nbytes(value)
            if self._fill_bytes + nbytes + size > FILL_BYTES_IN_FLIGHT:
                self.stats.fills_skipped += 1
                continue
            items.append((key, self._buffers.snapshot(value)))
            taken.add(key)
            nbytes += size
        if not items:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        fill = _Fill(items, nbytes, since)
        self._since[since] += 1  # held until the fill has ended (see _end)
        self._fill_bytes += nbytes
        for key in taken:
            self._filling[key] = fill
        task = asyncio.get_running_loop().create_task(self._write_fill(fill), name="asyncconn-local-fill")
        fill.task = task
        self._fills[task] = fill
        task.add_done_callback(functools.partial(self._fill_ended, fill))

    async def _write_fill(self, fill: _Fill) -> None:
        """Write ``fill`` to the local store a piece at a time (see :data:`FILL_WRITE_BYTES`), each piece
        without the keys a write or delete has changed since their read (it wins), until the store closes."""
        items = fill.items
        start = 0
        while start < len(items) and not self._closed:
            async with self._fill_lock:
                piece: list[tuple[str, Value]] = []
                nbytes = 0
                while start < len(items) and (not piece or nbytes < FILL_WRITE_BYTES) and not self._closed:
                    key, value = items[start]
                    start += 1
                    if self._stale(key, fill.since):
                        self._unfill(key, fill)
                        self._buffers.give(value)
                    else:
                        piece.append((key, value))
                        nbytes += value_nbytes(value)
                if not piece:
                    continue
                fill.writing = frozenset(key for key, _ in piece)
                fill.written = asyncio.get_running_loop().create_future()
                try:
                    ok, _ = await self._local(self.local.put(piece), "put")
                finally:
                    fill.written.set_result(None)
                    fill.writing = frozenset()
                    for key, _ in piece:
                        self._unfill(key, fill)
                for _, value in piece:  # the write has returned (not raised past here): reuse its copies
                    self._buffers.give(value)
                if ok:
                    self.stats.fills += len(piece)

    def _unfill(self, key: str, fill: _Fill) -> None:
        if self._filling.get(key) is fill:
            del self._filling[key]

    def _fill_ended(self, fill: _Fill, task: asyncio.Task[None]) -> None:
        del self._fills[task]
        self._fill_bytes -= fill.nbytes
        for key, _ in fill.items:
            self._unfill(key, fill)
        self._end(fill.since)
        if not self._fills and not self._closed:
            self._idle = asyncio.get_running_loop().call_later(FILL_BUFFERS_IDLE_S, self._buffers.clear)
        if not task.cancelled() and (exc := task.exception()) is not None:  # not a store error: a bug
            self.stats.local_errors += 1
            log.error("local store: a fill failed", exc_info=exc)

    async def wait_fills(self) -> None:
        """Wait until the fills under way have ended (written, failed or dropped)."""
        while self._fills:
            await asyncio.wait(list(self._fills))

    async def _local(self, call: Awaitable[T], what: str) -> tuple[bool, T | None]:
        """Await a call of the local store: (True, its result), or (False, None) when it failed with a
        store error (counted, logged once): the shared store is there for it. Anything else propagates."""
        try:
            return True, await call
        except AsyncConnError as exc:
            self.stats.local_errors += 1
            if not self._warned:
                self._warned = True
                log.warning("local store: %s failed (%s); the shared store serves instead", what, exc)
            return False, None

    async def close(self) -> None:
        """Let the fill write under way end (a file write cannot be stopped part way, and the local store is
        closed next), drop the rest of the fills, then close both stores."""
        if not self._closed:
            self._closed = True
            try:
                for task, fill in self._fills.items():
                    if not fill.writing:
                        task.cancel()
                await self.wait_fills()
            finally:
                if self._idle is not None:
                    self._idle.cancel()
                self._buffers.clear()
                try:
                    await self.local.close()
                finally:
                    await self.shared.close()
