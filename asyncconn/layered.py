"""A store on this host in front of the shared one: ``local_store_url`` (a ``file://`` directory) before
``backend_url``.

Why: a node-local disk holds far more than host memory (the host tier) and serves a value at page-cache or
NVMe speed, while the shared store (Redis, a cluster, Mooncake, a shared directory) is what every engine in
the fleet sees. :class:`LayeredBackend` is a :class:`StorageBackend` made of the two, so everything above it
-- framing, checksums, timeouts, the loaders, the host tier -- is unchanged:

- a read goes to the local store first; what it misses is read from the shared store in one call, and each
  such value read whole is written to the local store before the read returns (the caller's buffers are the
  only copy, and they are the caller's again once this returns): a later read of it on this host never
  leaves the host;
- a write goes to both at once and completes when both have ended; it fails only if the shared store's
  write failed (the local copy is then removed again, so the local store never holds what the shared one
  refused). A failed local write is counted and logged, never raised: the shared store has the value;
- ``exists`` asks the shared store only: it is the fleet's truth, and a save skipped because this host's
  disk held a value the shared store has since expired would leave every other host missing it for good;
- ``delete`` removes from both (a corrupt value found on either is gone from both);
- removals reported (``on_removed``) are the shared store's: the local store's own ``max_bytes`` / ``max_age``
  sweep drops only this host's copy, never the value;
- what the local store holds is told apart, to whoever follows it (``on_local``, on the loop thread; a KV
  engine publishing this host's residency as KV events): keys it took in or served (``True``: a write of
  both ended, a fill, a local hit) and keys it let go (``False``: a delete, its own sweep).

A value the local store holds but the shared store has lost is still served when a lookup finds it (the
lookup asks the shared store, so that happens only between its answer and the read): the bytes are checked
like any other.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
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
)
from asyncconn.exceptions import AsyncConnError
from asyncconn.wrapped import WrappingBackend

__all__ = ["LayeredBackend", "LayeredStats", "LocalHook"]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Told, on the loop thread, keys the local store holds now (``True``) or no longer holds (``False``).
LocalHook = Callable[[Sequence[str], bool], None]


@dataclass
class LayeredStats:
    """Counters since the store was opened (plain ints: read them from any thread).

    ``local_hits``/``local_misses``: reads the local store served / passed on to the shared one;
    ``fills``: values read from the shared store and written locally; ``local_errors``: local reads or
    writes that failed (the shared store served or kept the value instead).
    """

    local_hits: int = 0
    local_misses: int = 0
    fills: int = 0
    local_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


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
        self._on_local: LocalHook | None = None

    @property
    def on_local(self) -> LocalHook | None:
        """Who follows what the local store holds (see the module docstring); None: no one."""
        return self._on_local

    @on_local.setter
    def on_local(self, hook: LocalHook | None) -> None:
        self._on_local = hook
        # The local store's own removals (its sweep) are this hook's, never the shared store's removals.
        if hasattr(self.local, "on_removed"):
            self.local.on_removed = None if hook is None else self._local_removed

    def _local_removed(self, keys: Sequence[str]) -> None:
        self._tell(keys, False)

    def _tell(self, keys: Sequence[str], held: bool) -> None:
        hook = self._on_local
        if hook is not None and keys:
            try:
                hook(keys, held)
            except Exception:  # a follower's bug must not fail a read or a write
                log.exception("local store: on_local hook failed")

    @property
    def removals_from(self) -> StorageBackend:
        """The shared store: its removals are this store's (what leaves the local disk alone stays in it)."""
        return self.shared

    # -- writes ------------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        checked_items(items)
        local, shared = await asyncio.gather(
            self._local(self.local.put(items), "put"), self.shared.put(items), return_exceptions=True
        )
        if isinstance(local, BaseException):  # not the local store's own failure (counted there): a bug
            raise local
        keys = [key for key, _ in items]
        if isinstance(shared, BaseException):
            if local[0]:  # the local store must not keep what the shared one may not have
                await self._local(self.local.delete(keys), "delete")
                self._tell(keys, False)
            raise shared
        if local[0]:
            self._tell(keys, True)

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        if (await self._local(self.local.delete(keys), "delete"))[0]:
            self._tell(keys, False)
        return await self.shared.delete(keys)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return await self.shared.exists(keys)

    # -- reads -------------------------------------------------------------------------------------------
    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        ok, found = await self._local(self.local.get(keys), "get")
        out: list[Sequence[Buffer] | None] = list(found) if ok and found is not None else [None] * len(keys)
        missing = [i for i, chunks in enumerate(out) if chunks is None]
        self.stats.local_hits += len(keys) - len(missing)
        if self._on_local is not None and len(missing) < len(keys):
            self._tell([key for key, chunks in zip(keys, out, strict=True) if chunks is not None], True)
        if missing:
            self.stats.local_misses += len(missing)
            fetched = await self.shared.get([keys[i] for i in missing])
            fills: list[tuple[str, Value]] = []
            for i, chunks in zip(missing, fetched, strict=True):
                out[i] = chunks
                if chunks:
                    fills.append((keys[i], chunks))
            await self._fill(fills)
        return out

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        checked_dests(key, dests)
        (length,) = await self.get_into_many([(key, dests, sink)])
        return length

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """The local store's reads, then its misses from the shared store in one call, each value that
        landed whole written locally. ``cached_only``: the local store's answer alone (a miss there is
        ``NOT_CACHED``: asked again without it, it goes to the shared store)."""
        for key, dests, _ in reads:
            checked_dests(key, dests)
        if cached_only:
            if not self.local.cached_reads:
                return [NOT_CACHED] * len(reads)
            ok, got = await self._local(self.local.get_into_many(reads, cached_only=True), "get")
            if not ok or got is None:
                return [NOT_CACHED] * len(reads)
            hits = [i for i, n in enumerate(got) if n is not None and n != NOT_CACHED]
            self.stats.local_hits += len(hits)
            if self._on_local is not None:
                self._tell([reads[i][0] for i in hits], True)
            return [NOT_CACHED if n is None else n for n in got]
        ok, local = await self._local(self.local.get_into_many(reads), "get")
        out: list[int | None] = list(local) if ok and local is not None else [None] * len(reads)
        missing = [i for i, length in enumerate(out) if length is None]
        self.stats.local_hits += len(reads) - len(missing)
        if self._on_local is not None and len(missing) < len(reads):
            self._tell([read[0] for read, length in zip(reads, out, strict=True) if length is not None], True)
        if missing:
            self.stats.local_misses += len(missing)
            lengths = await self.shared.get_into_many([reads[i] for i in missing])
            fills: list[tuple[str, Value]] = []
            for i, length in zip(missing, lengths, strict=True):
                out[i] = length
                key, dests, _ = reads[i]
                if length is not None and length == sum(d.nbytes for d in dests):  # landed whole
                    fills.append((key, dests))
            await self._fill(fills)
        return out

    async def _fill(self, items: list[tuple[str, Value]]) -> None:
        """Write values read from the shared store to the local one (a failure only costs a later read)."""
        if items and (await self._local(self.local.put(items), "put"))[0]:
            self.stats.fills += len(items)
            self._tell([key for key, _ in items], True)

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
        if not self._closed:
            self._closed = True
            try:
                await self.local.close()
            finally:
                await self.shared.close()
