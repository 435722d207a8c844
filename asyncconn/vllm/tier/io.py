"""The tier's store traffic, on asyncconn's loop thread: presence checks and chunk copies between the
primary tier's host memory and the store.

Every chunk goes through a private staging tensor, never straight between the store and vLLM's memory:
- write: the chunk is copied out of its primary slot, then framed (checksummed, bound to its name) and
  put. Whatever the store does afterwards -- even a write thread outliving a timeout -- it reads only the
  copy.
- read: the value lands in staging and is checked (header, length, checksum, name) before one copy into
  the primary slot; a missing, partial, corrupt or late value leaves the slot untouched and fails that
  chunk. A read thread outliving its timeout writes only into staging nobody reads.
So a primary slot is touched only by one synchronous copy on the loop thread, inside the job's
coroutine: when a job's future is done, the job no longer touches vLLM's memory.

At most ``max_inflight`` chunks are copied or in the store's hands at once (each holds one staging
buffer); the others wait on the loop. While :attr:`draining`, a chunk still waiting fails at once instead
of starting (vLLM's ``drain_jobs`` may cancel queued transfers, never a running one).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from asyncconn import codec
from asyncconn.exceptions import BackendError
from asyncconn.store import Fetch, TensorStore

__all__ = ["Outcome", "TierIO"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Outcome:
    """A job's result: which chunks made it (in the job's order) and how long the job took."""

    ok: list[bool]
    seconds: float


@dataclass
class TierCounts:
    """Running totals (plain ints: read from any thread)."""

    written: int = 0
    write_failures: int = 0
    read: int = 0
    read_misses: int = 0
    read_corrupt: int = 0
    read_failures: int = 0
    checks_failed: int = 0


class TierIO:
    """Presence checks, writes and reads of chunks of ``row_bytes`` bytes. Call its coroutines on the loop."""

    def __init__(
        self,
        store: TensorStore,
        primary: memoryview,
        *,
        row_bytes: int,
        max_inflight: int,
        lookup_timeout: float,
    ) -> None:
        self.store = store
        self._primary = primary  # flat bytes of the primary tier; sliced only on the loop, per copy
        self.row_bytes = row_bytes
        self.lookup_timeout = lookup_timeout
        self._slots = asyncio.Semaphore(max_inflight)
        self.counts = TierCounts()
        #: Set by the scheduler thread while it drains: chunks still waiting for a slot fail at once.
        self.draining = False
        #: Chunks holding a slot now (being copied or in the store's hands).
        self.busy = 0

    async def exists(self, names: Sequence[str]) -> list[bool]:
        """Which values are present; a store that fails or does not answer in time says none is."""
        try:
            async with asyncio.timeout(self.lookup_timeout):
                return await self.store.exists(names)
        except (BackendError, TimeoutError) as exc:
            self.counts.checks_failed += 1
            log.debug("%s: presence check of %d chunks failed: %s", self.store.name, len(names), exc)
            return [False] * len(names)

    async def write(self, chunks: Sequence[tuple[str, int]]) -> Outcome:
        """Store the chunks at these primary byte offsets under these names."""
        start = time.monotonic()
        ok = await asyncio.gather(*(self._write_one(name, offset) for name, offset in chunks))
        return Outcome(list(ok), time.monotonic() - start)

    async def read(self, chunks: Sequence[tuple[str, int]]) -> Outcome:
        """Load the values under these names into the primary slots at these byte offsets."""
        start = time.monotonic()
        ok = await asyncio.gather(*(self._read_one(name, offset) for name, offset in chunks))
        return Outcome(list(ok), time.monotonic() - start)

    async def _write_one(self, name: str, offset: int) -> bool:
        async with self._slots:
            if self.draining:
                self.counts.write_failures += 1
                return False
            self.busy += 1
            try:
                return await self._put(name, offset)
            finally:
                self.busy -= 1

    async def _put(self, name: str, offset: int) -> bool:
        staging = torch.empty(self.row_bytes, dtype=torch.uint8)
        with self._primary[offset : offset + self.row_bytes] as source:
            codec.tensor_bytes(staging)[:] = source
        try:
            await self.store.put([(name, staging)])
        except BackendError as exc:
            self.counts.write_failures += 1
            log.debug("%s: write of %s failed: %s", self.store.name, name, exc)
            return False
        self.counts.written += 1
        return True

    async def _read_one(self, name: str, offset: int) -> bool:
        async with self._slots:
            if self.draining:
                self.counts.read_failures += 1
                return False
            self.busy += 1
            try:
                return await self._get(name, offset)
            finally:
                self.busy -= 1

    async def _get(self, name: str, offset: int) -> bool:
        staging = torch.empty(self.row_bytes, dtype=torch.uint8)
        try:
            status = await self.store.read_into(name, staging)
        except BackendError as exc:
            self.counts.read_failures += 1
            log.debug("%s: read of %s failed: %s", self.store.name, name, exc)
            return False
        if status is not Fetch.HIT:
            if status is Fetch.CORRUPT:
                self.counts.read_corrupt += 1
            else:
                self.counts.read_misses += 1
            return False
        with self._primary[offset : offset + self.row_bytes] as dest:
            dest[:] = codec.tensor_bytes(staging)
        self.counts.read += 1
        return True
