"""Tensors in, tensors out: framing, validation, timeouts and counters on top of any :class:`StorageBackend`.

This is the layer the lookup client, the loaders and the adapters use. It turns a bad payload into a miss
(counted, logged once per key) rather than an exception that would reach vLLM, and bounds every call by a
timeout so a hung store degrades to :class:`BackendTimeout`, never to a hang.

A store belongs to the process that opened it: in a forked child every call raises
:class:`UsedAfterFork` at once, before the backend is touched, and ``close()`` only marks it closed. Its
connections are the parent's; a command the child wrote on one would interleave with the parent's and
hand each process the other's replies (wrong ``exists`` answers), and closing one from the child would
unregister it from the event-loop poller both processes share.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

import torch

from asyncconn import codec
from asyncconn.backend import NOT_CACHED, SelfChecked, StorageBackend, checked_keys, open_backend
from asyncconn.exceptions import (
    BackendError,
    BackendTimeout,
    BackendUnavailable,
    CodecError,
    FrameMismatch,
    InvalidInput,
)
from asyncconn.hostarena import HostMemory
from asyncconn.hosttier import HostTier
from asyncconn.layered import LayeredBackend
from asyncconn.reachability import Reachability
from asyncconn.runtime import fork_generation, forked_error, keep_inherited
from asyncconn.scattered import Scattered
from asyncconn.url import StoreURL, parse_url, redact

__all__ = ["Fetch", "StoreStats", "TensorStore"]

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0


class Fetch(enum.Enum):
    """Outcome of reading one value into a caller's buffer."""

    HIT = "hit"
    MISS = "miss"
    CORRUPT = "corrupt"  # present but not a valid frame for the destination (counted in stats.corrupt)
    NOT_CACHED = "not_cached"  # a ``cached_only`` read the store would have had to wait for (not counted)


@dataclass
class StoreStats:
    """Counters since the store was opened (plain ints: read them from any thread)."""

    puts: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    errors: int = 0
    timeouts: int = 0
    bytes_written: int = 0
    bytes_read: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class TensorStore:
    """Frame, check and time-bound tensor traffic to one backend. Use it on the runtime loop."""

    def __init__(
        self,
        backend: StorageBackend,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        max_payload: int = codec.DEFAULT_MAX_PAYLOAD,
        name: str = "store",
    ) -> None:
        self.backend = backend
        self.timeout = timeout
        self.max_payload = max_payload
        self.name = name
        self.stats = StoreStats()
        #: Reachable or not, as this store's calls see it; logs one line when it goes away, one when back.
        self.reachability = Reachability(name)
        self._closing = False
        self._generation = fork_generation()
        self._pid = os.getpid()

    @classmethod
    async def open(
        cls,
        url: str | StoreURL,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        connect_timeout: float | None = None,
        host_cache_bytes: int = 0,
        local_url: str | StoreURL | None = None,
        host_memory: HostMemory | None = None,
    ) -> TensorStore:
        """Connect and return a store whose calls are bounded by ``timeout``.

        ``connect_timeout`` (default: ``timeout``) bounds only this first connection. Connectors open their
        store while vLLM starts, where a short per-call bound chosen for the serving path would fail the
        engine's start on a momentarily busy host. ``host_cache_bytes`` > 0 puts a host-memory tier of that
        many bytes in front of the backend (:class:`~asyncconn.hosttier.HostTier`; :attr:`host_tier`);
        ``host_memory`` makes its memory (default: anonymous memory faulted in at once; a CUDA engine's
        pinned allocator). ``local_url``: a store on this host in front of ``url``
        (:class:`~asyncconn.layered.LayeredBackend`; :attr:`layered`), behind the host tier when there is one.
        """
        parsed = url if isinstance(url, StoreURL) else parse_url(url)
        wait = timeout if connect_timeout is None else connect_timeout
        try:
            backend = await asyncio.wait_for(open_backend(parsed), wait)
        except TimeoutError:
            raise BackendTimeout(f"{redact(parsed.raw)}: could not connect within {wait:g}s") from None
        if local_url is not None:
            local = local_url if isinstance(local_url, StoreURL) else parse_url(local_url)
            try:
                backend = await asyncio.wait_for(_layered(backend, local), wait)
            except TimeoutError:
                raise BackendTimeout(f"{redact(local.raw)}: could not open within {wait:g}s") from None
        if host_cache_bytes > 0:
            backend = HostTier(backend, host_cache_bytes, memory=host_memory)
        return cls(backend, timeout=timeout, name=redact(parsed.raw))

    @property
    def host_tier(self) -> HostTier | None:
        """The host-memory tier in front of the store (its counters, ``on_evict``), if there is one."""
        return self.backend if isinstance(self.backend, HostTier) else None

    @property
    def layered(self) -> LayeredBackend | None:
        """The local store in front of the shared one (its counters), if there is one."""
        backend = self.backend.inner if isinstance(self.backend, HostTier) else self.backend
        return backend if isinstance(backend, LayeredBackend) else None

    async def put(self, items: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Encode and store tensors (zero-copy of the payload: header and view are written as parts)."""
        pairs = list(items)
        checked_keys([key for key, _ in pairs])  # before a key seeds a frame checksum
        await self.put_frames([(key, *codec.encode_parts(tensor, key=key)) for key, tensor in pairs])

    async def put_frames(self, items: Iterable[tuple[str, bytes, memoryview]]) -> None:
        """Store values framed already: ``(key, header, payload)`` as :func:`codec.encode_parts` made them
        *for that key*.

        Why: the frame header's checksum is a pass over every byte. The save tracker's copy thread makes it
        right after copying a value into staging, off the loop thread, which this method runs on. The caller
        vouches for the pairing; a reader rejects a frame that does not match (its checksum is key-bound).
        """
        batch = []
        nbytes = 0
        for key, header, payload in items:
            # The frame's checksum covers header and payload, and every read of ours verifies it.
            batch.append((key, SelfChecked((header, payload))))
            nbytes += len(header) + payload.nbytes
        if not batch:
            return
        await self._call(self.backend.put(batch), "put")
        self.stats.puts += len(batch)
        self.stats.bytes_written += nbytes

    async def get(self, keys: Sequence[str]) -> list[torch.Tensor | None]:
        """Fetch and decode; a missing or invalid value is ``None`` (invalid ones are counted as corrupt)."""
        if not keys:
            return []
        values = await self._call(self.backend.get(keys), "get")
        out: list[torch.Tensor | None] = []
        for key, chunks in zip(keys, values, strict=True):
            tensor = None
            if chunks is not None:
                try:
                    tensor = codec.decode(chunks, max_payload=self.max_payload, key=key)
                except CodecError as exc:
                    self._corrupt(key, exc)
                else:
                    self.stats.bytes_read += sum(memoryview(c).nbytes for c in chunks)
            self._count(tensor is not None)
            out.append(tensor)
        return out

    async def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Load one value into ``out`` (contiguous CPU, e.g. pinned staging). False on a miss or bad value.

        On False the contents of ``out`` are unspecified: it is a staging buffer, never a tensor vLLM reads.
        Backends that read into caller memory land the payload straight in ``out`` (one copy); others are
        decoded from their chunks into ``out`` after validation (one copy from the client's buffers).
        """
        return await self.read_into(key, out) is Fetch.HIT

    async def read_into(self, key: str, out: torch.Tensor) -> Fetch:
        """:meth:`get_into` that also tells a miss from a bad value (a loader reports them differently)."""
        codec.check_tensor(out, "the destination")
        if self.backend.reads_into and out.is_contiguous() and out.device.type == "cpu":
            status = await self._get_into_direct(key, out)
        else:
            (chunks,) = await self._call(self.backend.get([key]), "get")
            status = Fetch.MISS
            if chunks is not None:
                try:
                    codec.decode_into(chunks, out, max_payload=self.max_payload, key=key)
                    status = Fetch.HIT
                    self.stats.bytes_read += sum(memoryview(c).nbytes for c in chunks)
                except CodecError as exc:
                    self._corrupt(key, exc)
                    status = Fetch.CORRUPT
        self._count(status is Fetch.HIT)
        return status

    @property
    def batch_reads(self) -> bool:
        """Whether :meth:`read_into_many` reads a batch in one backend call (worth grouping loads for)."""
        return self.backend.batch_reads and self.backend.reads_into

    async def read_into_many(
        self, items: Sequence[tuple[str, torch.Tensor | Scattered]], *, cached_only: bool = False
    ) -> list[Fetch]:
        """:meth:`read_into` for several values in one backend call; outcomes in order.

        A bad value is a CORRUPT outcome for that value only; a store error or timeout raises for the whole
        batch (as it would have failed each read). Destinations a backend cannot read into straight are
        read one by one. ``cached_only``: only values the backend holds in memory (:attr:`cached_reads`);
        the others are NOT_CACHED, with nothing or part of them written (see
        ``StorageBackend.get_into_many``).
        """
        for _, out in items:
            if not isinstance(out, Scattered):
                codec.check_tensor(out, "the destination")
        if cached_only and not self.cached_reads:
            return [Fetch.NOT_CACHED] * len(items)
        direct = self.backend.reads_into and all(
            isinstance(o, Scattered) or (o.is_contiguous() and o.device.type == "cpu") for _, o in items
        )
        if not direct and any(isinstance(o, Scattered) for _, o in items):
            raise InvalidInput(f"{self.name}: a Scattered destination needs a backend that reads into memory")
        if not (direct and (self.batch_reads or cached_only)):
            # One after another, not gathered: a read failing would leave the others writing into their
            # destinations after this call has raised.
            return [await self._read_one(key, out) for key, out in items]
        reads = [_DirectRead(key, out, self.max_payload) for key, out in items]
        requests = [r.request() for r in reads]
        # The keyword only when asked for: a backend written before it existed still serves plain batches.
        call = (
            self.backend.get_into_many(requests, cached_only=True)
            if cached_only
            else self.backend.get_into_many(requests)
        )
        lengths = await self._call(call, "get")
        statuses = [
            Fetch.NOT_CACHED if length == NOT_CACHED else self._settle(read, length)
            for read, length in zip(reads, lengths, strict=True)
        ]
        for status in statuses:
            if status is not Fetch.NOT_CACHED:
                self._count(status is Fetch.HIT)
        return statuses

    @property
    def cached_reads(self) -> bool:
        """Whether :meth:`read_into_many` can serve ``cached_only`` reads (``file://``: the page cache)."""
        return self.backend.cached_reads and self.backend.reads_into

    @property
    def cancellable_reads(self) -> bool:
        """Whether a read into the caller's memory stops writing it once cancelled (``redis://``: see
        ``StorageBackend.cancellable_reads``). A host tier in front of such a store is too: a hit is one
        memory copy, and a miss the store's read (the tier's fill only reads the caller's memory, and a
        cancelled read waits for it)."""
        backend = self.backend.inner if isinstance(self.backend, HostTier) else self.backend
        return backend.cancellable_reads and backend.reads_into

    async def _read_one(self, key: str, out: torch.Tensor | Scattered) -> Fetch:
        if not isinstance(out, Scattered):
            return await self.read_into(key, out)
        status = await self._get_into_direct(key, out)
        self._count(status is Fetch.HIT)
        return status

    async def _get_into_direct(self, key: str, out: torch.Tensor | Scattered) -> Fetch:
        read = _DirectRead(key, out, self.max_payload)
        try:  # the verifier itself as the sink: a bad frame stops the read at once
            length = await self._call(self.backend.get_into(key, read.dests(), read.verifier), "get")
        except CodecError as exc:
            read.error = exc
            length = 0
        return self._settle(read, length)

    def _settle(self, read: _DirectRead, length: int | None) -> Fetch:
        """The outcome of one direct read the backend has finished (``length``: what it reported)."""
        try:
            if read.error is not None:
                raise read.error
            if length is None:
                return Fetch.MISS
            expected = len(read.header) + read.nbytes
            if length != expected:
                raise FrameMismatch(
                    f"stored value is {length} bytes; a frame of {read.dtype}{list(read.shape)} is {expected}"
                )
            read.verifier.finish()
        except CodecError as exc:
            self._corrupt(read.key, exc)
            return Fetch.CORRUPT
        self.stats.bytes_read += length
        return Fetch.HIT

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        return await self._call(self.backend.exists(keys), "exists")

    async def delete(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        return await self._call(self.backend.delete(keys), "delete")

    async def close(self) -> None:
        self._closing = True  # a call failing from here on is the close, not the store going away
        if self._generation != fork_generation():  # the connections are the parent's: leave them be
            keep_inherited(self.backend)
            return
        await self.backend.close()

    # -- helpers ---------------------------------------------------------------------------------------
    async def _call(self, coro: Awaitable[T], what: str) -> T:
        if self._generation != fork_generation():
            if asyncio.iscoroutine(coro):
                coro.close()
            raise forked_error(f"store {self.name}", self._pid)
        reach = self.reachability
        try:
            async with asyncio.timeout(self.timeout):
                result = await coro
        except TimeoutError:
            self.stats.timeouts += 1
            if not self._closing:
                reach.failed(f"{what} timed out after {self.timeout:g}s")
            raise BackendTimeout(f"{self.name}: {what} did not finish within {self.timeout:g}s") from None
        except BackendUnavailable as exc:
            self.stats.errors += 1
            if not self._closing:
                reach.failed(f"{what}: {exc}")
            raise
        except BackendError:
            self.stats.errors += 1
            reach.answered()  # the store answered, with an error of its own: it is there
            raise
        if not reach.reachable:
            reach.answered()
        return result

    def _count(self, hit: bool) -> None:
        self.stats.gets += 1
        if hit:
            self.stats.hits += 1
        else:
            self.stats.misses += 1

    def _corrupt(self, key: str, exc: CodecError) -> None:
        self.stats.corrupt += 1
        log.warning("%s: value under %r is not a valid frame, treated as a miss: %s", self.name, key, exc)


class _DirectRead:
    """One value read straight into a destination (a tensor or pieces): its header buffer, payload views
    and checker.

    Also the read's sink. Fed a bad frame it keeps the error and ignores the rest instead of raising, so a
    backend reading a batch in one job does not fail the other values' reads for it; the store reports the
    error when the read is settled.
    """

    __slots__ = ("dtype", "error", "header", "key", "nbytes", "payload", "shape", "verifier")

    #: Every byte fed is checked against the frame's checksum (``asyncconn.backend.sink_verifies``).
    verifies_value = True

    def __init__(self, key: str, out: torch.Tensor | Scattered, max_payload: int) -> None:
        self.key = key
        if isinstance(out, Scattered):
            self.dtype, self.shape = out.dtype, out.shape
            self.payload: Sequence[memoryview] = out.views
            self.nbytes = out.nbytes
        else:
            self.dtype, self.shape = out.dtype, tuple(out.shape)
            self.payload = (codec.tensor_bytes(out),)
            self.nbytes = self.payload[0].nbytes
        self.header = bytearray(codec.header_size(len(self.shape)))
        self.verifier = codec.FrameVerifier(out, max_payload=max_payload, key=key)
        self.error: CodecError | None = None

    def dests(self) -> list[memoryview]:
        return [memoryview(self.header), *self.payload]

    def request(self) -> tuple[str, list[memoryview], _DirectRead]:
        """The read as ``get_into_many`` takes it, with this object as its (never raising) sink."""
        return self.key, self.dests(), self

    def __call__(self, piece: memoryview) -> None:
        if self.error is None:
            try:
                self.verifier.feed(piece)
            except CodecError as exc:
                self.error = exc

    def feed_many(self, pieces: Sequence[memoryview]) -> None:
        """Consecutive pieces in one call (``asyncconn.backend.feed_sink``)."""
        if self.error is None:
            try:
                self.verifier.feed_many(pieces)
            except CodecError as exc:
                self.error = exc


async def _layered(shared: StorageBackend, local: StoreURL) -> LayeredBackend:
    """``shared`` behind the local store at ``local`` (closed again if that cannot be opened)."""
    try:
        return LayeredBackend(await open_backend(local), shared)
    except BaseException:
        await shared.close()
        raise
