"""How lookups reach a store: directly through a storage backend, or through a ZMQ lookup server.

A transport lives entirely on the runtime's loop thread. The client hands it a batch of
``(wire id, keys)`` with :meth:`LookupTransport.send` (never awaited: sending must not hold up the loop)
and the transport later calls ``deliver`` with ``(wire id, answer)`` pairs, many at a time, where an answer
is an ``int`` (PREFIX: leading keys present), a ``tuple[bool, ...]`` (EXISTS) or ``None`` (the store or
server failed). Answers may come back in any order, late, twice or never: the client matches them by
wire id and owns every timeout, so a transport keeps no per-lookup state it would have to clean up.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import cast

import zmq
import zmq.asyncio

from asyncconn.exceptions import AsyncConnError, ConfigError
from asyncconn.lookup import protocol
from asyncconn.lookup.curve import CurveClientKeys, apply_client
from asyncconn.lookup.protocol import Key, Kind
from asyncconn.store import TensorStore
from asyncconn.url import redact

__all__ = [
    "Answer",
    "Batch",
    "Deliver",
    "DirectTransport",
    "LookupTransport",
    "ZmqTransport",
    "leading",
    "send_nowait",
]

log = logging.getLogger(__name__)

Answer = int | tuple[bool, ...]
Deliver = Callable[[list[tuple[int, Answer | None]]], None]
Batch = Sequence[tuple[int, tuple[Key, ...]]]


class LookupTransport(abc.ABC):
    """The loop-side half of a lookup client. All methods run on the runtime loop."""

    @abc.abstractmethod
    async def start(self, kind: Kind, deliver: Deliver) -> None:
        """Connect; answers for ``kind`` queries go to ``deliver`` from now on."""

    @abc.abstractmethod
    def send(self, batch: Batch) -> None:
        """Issue lookups without waiting; answers (or ``None`` on failure) arrive through ``deliver``."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Stop, cancel work in flight and release sockets and store clients. Idempotent."""

    def busy(self) -> int:
        """Units of work in flight inside the transport (tests count it back to zero)."""
        return 0


def send_nowait(sock: zmq.asyncio.Socket, frames: list[bytes]) -> bool:
    """Send without waiting; False if the message could not be queued (peer queue full, socket closed).

    Goes through the asyncio socket (not a shadow) so that pyzmq re-checks its edge-triggered events for
    a pending receive; the returned future is already done and its exception is consumed here.
    """
    fut = cast("asyncio.Future[object]", sock.send_multipart(frames, flags=zmq.NOBLOCK))
    return fut.exception() is None


def leading(present: Sequence[bool]) -> int:
    """Number of leading True values (KV prefix hit)."""
    try:
        return present.index(False)
    except ValueError:
        return len(present)


#: How much longer than a lookup's deadline the direct transport's store calls may run (see below).
STORE_SLACK_S = 0.25


class DirectTransport(LookupTransport):
    """Ask the storage backend itself: one batched ``exists`` per drained batch (redis pipelines them).

    A batch is split into backend calls of at most ``max_batch_keys`` keys so that one huge burst cannot
    build one huge command; each call is its own task, so a slow call never delays the others.

    The store calls it opens are bounded by ``timeout`` plus :data:`STORE_SLACK_S`: the client's deadline
    (``timeout`` too) must be what decides that a lookup timed out, counted as a timeout. With equal bounds
    the store's own expiry raced it and a frozen store was now and then counted as a store error; the late
    store failure arrives after the client's deadline and is dropped as stale.
    """

    def __init__(
        self,
        store: TensorStore | str,
        *,
        key_prefix: str = "",
        timeout: float = 5.0,
        max_batch_keys: int = 8192,
        own_store: bool | None = None,
        connect_timeout: float | None = None,
    ) -> None:
        self._store_or_url = store
        #: Bound on opening the store in :meth:`start` (None: ``timeout``).
        self.connect_timeout = connect_timeout
        self._store: TensorStore | None = store if isinstance(store, TensorStore) else None
        self._own_store = own_store if own_store is not None else not isinstance(store, TensorStore)
        self._prefix = key_prefix
        self._timeout = timeout
        self._max_keys = max_batch_keys
        self._tasks: set[asyncio.Task[None]] = set()
        self._kind = Kind.PREFIX
        self._deliver: Deliver | None = None

    @property
    def store(self) -> TensorStore | None:
        """The store asked (once started): another client may share it (``LookupConfig.transport``)."""
        return self._store

    async def start(self, kind: Kind, deliver: Deliver) -> None:
        if self._store is None:
            assert isinstance(self._store_or_url, str)
            self._store = await TensorStore.open(
                self._store_or_url,
                timeout=self._timeout + STORE_SLACK_S,
                connect_timeout=self.connect_timeout,
            )
        self._kind, self._deliver = kind, deliver

    def send(self, batch: Batch) -> None:
        chunk: list[tuple[int, tuple[Key, ...]]] = []
        nkeys = 0
        for item in batch:
            if chunk and nkeys + len(item[1]) > self._max_keys:
                self._spawn(chunk)
                chunk, nkeys = [], 0
            chunk.append(item)
            nkeys += len(item[1])
        if chunk:
            self._spawn(chunk)

    def _spawn(self, chunk: list[tuple[int, tuple[Key, ...]]]) -> None:
        task = asyncio.get_running_loop().create_task(self._lookup(chunk))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _lookup(self, chunk: list[tuple[int, tuple[Key, ...]]]) -> None:
        assert self._store is not None and self._deliver is not None
        prefix = self._prefix
        flat = [protocol.store_key(prefix, k) for _, keys in chunk for k in keys]
        try:
            present = await self._store.exists(flat)
        except AsyncConnError as exc:
            log.debug("lookup: store exists() failed for %d lookups: %s", len(chunk), exc)
            self._deliver([(wid, None) for wid, _ in chunk])
            return
        out: list[tuple[int, Answer | None]] = []
        pos = 0
        exists = self._kind is Kind.EXISTS
        for wid, keys in chunk:
            seg = present[pos : pos + len(keys)]
            pos += len(keys)
            out.append((wid, tuple(seg) if exists else leading(seg)))
        self._deliver(out)

    def busy(self) -> int:
        return len(self._tasks)

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._store is not None and self._own_store:
            store, self._store = self._store, None
            await store.close()


class ZmqTransport(LookupTransport):
    """A DEALER socket to a lookup server: many requests in flight, replies matched by an id frame.

    The DEALER reconnects by itself when the server dies or restarts; requests sent meanwhile wait in the
    socket's queue (up to ``max_queued``, then they fail at once as errors) and the client's deadlines turn
    whatever is never answered into misses. Replies are read in bursts: one awaited receive, then every
    message already queued is taken without waiting, and all of them are delivered in one call.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        max_queued: int = 100_000,
        max_message: int = 64 * 1024 * 1024,
        reconnect_ivl_ms: int = 100,
        reconnect_ivl_max_ms: int = 2000,
        curve: CurveClientKeys | None = None,
    ) -> None:
        if "://" not in endpoint:
            raise ConfigError(f"lookup_server: not a ZMQ endpoint: {endpoint!r} (e.g. tcp://127.0.0.1:5570)")
        self.endpoint = endpoint
        self._max_queued = max_queued
        self._max_message = max_message
        self._reconnect = (reconnect_ivl_ms, reconnect_ivl_max_ms)
        self._curve = curve
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._kind = Kind.PREFIX
        self._deliver: Deliver | None = None

    async def start(self, kind: Kind, deliver: Deliver) -> None:
        self._kind, self._deliver = kind, deliver
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self._max_queued)
            sock.setsockopt(zmq.RCVHWM, self._max_queued)
            sock.setsockopt(zmq.MAXMSGSIZE, self._max_message)
            sock.setsockopt(zmq.RECONNECT_IVL, self._reconnect[0])
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, self._reconnect[1])
            if self._curve is not None:
                apply_client(sock, self._curve)
            sock.connect(self.endpoint)
        except zmq.ZMQError as exc:
            sock.close(0)
            ctx.term()
            raise ConfigError(f"lookup_server: cannot connect to {redact(self.endpoint)!r}: {exc}") from None
        self._ctx, self._sock = ctx, sock
        self._reader = asyncio.get_running_loop().create_task(self._read())

    def send(self, batch: Batch) -> None:
        sock = self._sock
        assert sock is not None and self._deliver is not None
        failed: list[tuple[int, Answer | None]] = []
        kind = self._kind
        for wid, keys in batch:
            try:
                frames = [b"", protocol.encode_id(wid), *protocol.encode_query(kind, keys)]
            except AsyncConnError as exc:
                log.warning("lookup: cannot encode keys: %s", exc)
                failed.append((wid, None))
                continue
            if not send_nowait(sock, frames):  # queue full (server gone for long) or socket closed
                failed.append((wid, None))
        if failed:
            self._deliver(failed)

    async def _read(self) -> None:
        sock = self._sock
        assert sock is not None and self._deliver is not None
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        deliver = self._deliver
        exists = self._kind is Kind.EXISTS
        while True:
            try:
                frames = await sock.recv_multipart()
            except zmq.ZMQError as exc:
                if sock.closed:
                    return
                log.warning("lookup: receive from %s failed: %s", self.endpoint, exc)
                await asyncio.sleep(0.01)
                continue
            out: list[tuple[int, Answer | None]] = []
            while True:
                item = self._parse_reply(frames, exists)
                if item is not None:
                    out.append(item)
                if len(out) >= 4096:
                    break
                try:
                    frames = shadow.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
            if out:
                deliver(out)

    @staticmethod
    def _parse_reply(frames: list[bytes], exists: bool) -> tuple[int, Answer | None] | None:
        if len(frames) != 3 or frames[0]:
            return None
        wid = protocol.parse_id(frames[1])
        if wid is None:
            return None
        reply = frames[2]
        if reply == protocol.ERROR:
            return wid, None
        if exists:
            if not reply.startswith(protocol.OK):
                return wid, None
            return wid, tuple(b == 1 for b in reply[1:])
        return wid, protocol.decode_u32(reply)

    async def close(self) -> None:
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()
