"""A third-party storage backend in ~40 lines: a dict with a per-key TTL.

Register it in your package's pyproject.toml and every asyncconn user can name it by URL::

    [project.entry-points."asyncconn.backends"]
    ttlmem = "examples.custom_backend:TTLMemoryBackend"

or, without packaging, at run time: ``asyncconn.register_backend("ttlmem", TTLMemoryBackend)``.
Then ``backend_url = "ttlmem://?ttl=30s"``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import ClassVar

from asyncconn.backend import Buffer, StorageBackend, Value
from asyncconn.exceptions import BackendUnavailable
from asyncconn.url import Param, StoreURL


class TTLMemoryBackend(StorageBackend):
    """Values expire ``ttl`` seconds after they were written."""

    params: ClassVar[dict[str, Param]] = {"ttl": Param.duration(60.0, "seconds a value lives")}

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._data: dict[str, tuple[float, bytes]] = {}
        self._closed = False

    @classmethod
    async def from_url(cls, url: StoreURL) -> TTLMemoryBackend:
        return cls(url.options(cls.params)["ttl"])

    def _live(self, key: str) -> bytes | None:
        if self._closed:
            raise BackendUnavailable("closed")
        entry = self._data.get(key)
        if entry is None or entry[0] < time.monotonic():
            self._data.pop(key, None)
            return None
        return entry[1]

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        deadline = time.monotonic() + self.ttl
        for key, value in items:
            data = bytes(value) if isinstance(value, (bytes, bytearray, memoryview)) else b"".join(value)
            self._data[key] = (deadline, data)

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        return [(v,) if (v := self._live(k)) is not None else None for k in keys]

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        return [self._live(k) is not None for k in keys]

    async def delete(self, keys: Sequence[str]) -> int:
        return sum(self._data.pop(k, None) is not None for k in keys)

    async def close(self) -> None:
        self._closed = True
