"""Test doubles for the transfer tests: a store whose calls wait on a gate the test opens.

Only our own logic is tested against these (ordering of cancel, release and failure); real bytes flow through
the memory backend elsewhere. The gate is an ``asyncio.Event`` on the runtime loop, opened from the test
thread with ``runtime.call_soon(backend.gate.set)``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import ClassVar

from asyncconn.backend import Buffer, IntoRead, Sink, StorageBackend, Value
from asyncconn.exceptions import BackendUnavailable
from asyncconn.url import StoreURL


def _join(value: Value) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return b"".join(bytes(c) for c in value)


class GatedBackend(StorageBackend):
    """A dict store whose put/get wait on ``gate``; optionally fails puts or writes after being cancelled."""

    reads_into: ClassVar[bool] = True

    def __init__(self, *, gated: bool = True) -> None:
        self.data: dict[str, bytes] = {}
        self.gate = asyncio.Event()
        if not gated:
            self.gate.set()
        self.entered = threading.Event()  # a get or put has started
        self.cancel_seen = threading.Event()  # a get_into was cancelled while waiting
        self.only_keys: set[str] | None = None  # when set, only puts of these keys wait on the gate
        self.fail_puts = False
        self.write_after_cancel = False
        self.late_writes = 0
        self.puts = 0

    @classmethod
    async def from_url(cls, url: StoreURL) -> GatedBackend:
        return cls()

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        self.entered.set()
        if self.only_keys is None or any(k in self.only_keys for k, _ in items):
            await self.gate.wait()
        if self.fail_puts:
            raise BackendUnavailable("store went away mid-save")
        self.puts += 1
        self.data.update((k, _join(v)) for k, v in items)

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        self.entered.set()
        await self.gate.wait()
        return [(self.data[k],) if k in self.data else None for k in keys]

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        self.entered.set()
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancel_seen.set()
            if self.write_after_cancel:
                # A client that finishes its read into caller memory after being cancelled (a DMA in flight).
                await self.gate.wait()
                for dest in dests:
                    dest.cast("B")[:] = b"\xee" * dest.nbytes
                self.late_writes += 1
            raise
        return self._read_value(key, dests, sink)

    def _read_value(self, key: str, dests: Sequence[memoryview], sink: Sink | None) -> int | None:
        value = self.data.get(key)
        if value is None:
            return None
        if len(value) != sum(d.nbytes for d in dests):
            return len(value)
        offset = 0
        for dest in dests:
            dest.cast("B")[:] = value[offset : offset + dest.nbytes]
            offset += dest.nbytes
            if sink is not None:
                sink(dest)
        return len(value)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self.data for k in keys]

    async def delete(self, keys: Sequence[str]) -> int:
        return sum(self.data.pop(k, None) is not None for k in keys)

    async def close(self) -> None:
        return None


class GatedBatchBackend(GatedBackend):
    """A :class:`GatedBackend` that serves ``get_into_many`` in one call (``batch_reads``), as ``file://``
    does: the whole batch waits on the gate once, and ``batches`` records each call's keys. A batch holding
    a key of ``fail_keys`` raises (a store error fails the whole call, per the contract)."""

    batch_reads: ClassVar[bool] = True

    def __init__(self, *, gated: bool = True) -> None:
        super().__init__(gated=gated)
        self.batches: list[list[str]] = []
        self.fail_keys: set[str] = set()

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        if cached_only:  # like the contract's default: this fake cannot tell what is in memory
            return await super().get_into_many(reads, cached_only=True)
        self.entered.set()
        self.batches.append([key for key, _, _ in reads])
        try:
            await self.gate.wait()
        except asyncio.CancelledError:
            self.cancel_seen.set()
            raise
        if any(key in self.fail_keys for key, _, _ in reads):
            raise BackendUnavailable("store went away mid-read")
        return [self._read_value(key, dests, sink) for key, dests, sink in reads]
