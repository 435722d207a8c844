"""``memory://[name]``: an in-process store.

The fast fake for unit tests of the library's own logic, and the embedded default within one process.
Backends opened with the same name in one process share one dict (so a "producer" and a "consumer" in
one test see each other); an empty name gives a private store. Values are copied in, so the caller may
reuse its buffers as soon as ``put`` returns.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import ClassVar

from asyncconn.backend import Buffer, StorageBackend, Value, checked_items, checked_keys
from asyncconn.exceptions import BackendUnavailable
from asyncconn.url import Param, StoreURL

__all__ = ["MemoryBackend"]

_shared: dict[str, dict[str, bytes]] = {}
_shared_lock = threading.Lock()


def _join(value: Value) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    return b"".join(value)


class MemoryBackend(StorageBackend):
    """A dict of key -> bytes; optional simulated latency for benchmarks and timeout tests."""

    params: ClassVar[dict[str, Param]] = {
        "latency": Param.duration(0.0, "simulated delay added to every call (benchmarks, fault tests)"),
        "max_bytes": Param.size(0, "refuse puts past this many stored bytes (0: unbounded)"),
    }

    def __init__(self, name: str = "", *, latency: float = 0.0, max_bytes: int = 0) -> None:
        if name:
            with _shared_lock:
                self._data = _shared.setdefault(name, {})
        else:
            self._data = {}
        self.latency = latency
        self.max_bytes = max_bytes
        self._closed = False

    @classmethod
    async def from_url(cls, url: StoreURL) -> MemoryBackend:
        opts = url.options(cls.params)
        name = (url.host or "") + url.path
        return cls(name, latency=opts["latency"], max_bytes=opts["max_bytes"])

    async def _enter(self) -> None:
        if self._closed:
            raise BackendUnavailable("memory backend is closed")
        if self.latency:
            await asyncio.sleep(self.latency)

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        checked_items(items)
        await self._enter()
        new = {key: _join(value) for key, value in items}
        if self.max_bytes:
            size = sum(map(len, self._data.values())) + sum(map(len, new.values()))
            if size > self.max_bytes:
                raise BackendUnavailable(f"memory backend full ({size} > {self.max_bytes} bytes)")
        self._data.update(new)

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        await self._enter()
        data = self._data
        return [(v,) if (v := data.get(k)) is not None else None for k in keys]

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        checked_keys(keys)
        await self._enter()
        return [k in self._data for k in keys]

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        await self._enter()
        return sum(self._data.pop(k, None) is not None for k in keys)

    async def close(self) -> None:
        self._closed = True

    def __len__(self) -> int:
        return len(self._data)
