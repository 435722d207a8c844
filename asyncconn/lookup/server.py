"""The ZMQ lookup server: answers Mooncake-framed and pipelined lookups from one store, on one asyncio loop.

One ROUTER socket serves every client. A plain REQ client written for vLLM's Mooncake store works
unchanged; DEALER clients put an id frame in front and get replies out of order (see ``protocol``). The
read loop takes one message with an await, then every message already queued (up to ``max_batch``), and
answers the whole burst with ONE ``exists`` call on the store, in its own task -- so many requests are in
flight at once, the store sees batched queries, and a slow batch never stops the socket from reading.
At most ``max_inflight`` batches run at once; past that the loop stops reading and ZMQ's queues push back.

Mooncake ``lookup`` semantics: vLLM's client sends the block-aligned token count and the prompt's block
hashes in order, so the hit length is the number of leading present blocks times ``block_size`` (tokens
per block hash, a server option that must match the engine), capped at the token count -- the cap matters
when hashes are finer than the scheduler's block (hybrid models), where they can cover a few tokens past
the aligned count. No (group, boundary) entries are appended (one KV cache group).

``reset`` asks for a wipe of the store (vLLM uses it between RL weight updates). A storage backend has no
"delete everything" operation and one store may be shared, so by default the server answers ``ERROR``
(not applied) -- never a false "ok" that would let stale KV be served. ``on_reset`` may implement it.

Safety: every message is parsed by ``protocol.parse_body`` with size caps; anything malformed or oversized
is answered with ``ERROR`` and counted, and the loop keeps serving. ``MAXMSGSIZE`` drops (disconnects) a
peer that sends a frame larger than ``max_message`` before it is buffered. Binds loopback / ipc by
default; an ipc socket file is made ``0600``; a non-loopback TCP bind needs CURVE keys (``curve``, see
``lookup.curve``) and is refused without them unless ``insecure=True`` (then it is logged as a warning).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, fields

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from asyncconn.exceptions import AsyncConnError, ConfigError, LookupProtocolError
from asyncconn.lookup import curve as curve_keys
from asyncconn.lookup import protocol
from asyncconn.lookup.protocol import Kind, Query
from asyncconn.lookup.transports import leading, send_nowait
from asyncconn.store import TensorStore

__all__ = ["DEFAULT_BIND", "LookupServer", "ServerStats"]

log = logging.getLogger(__name__)

DEFAULT_BIND = "tcp://127.0.0.1:5570"


@dataclass
class ServerStats:
    """Counters since start (plain ints, loop thread writes, any thread reads)."""

    requests: int = 0
    lookups: int = 0
    resets: int = 0
    errors: int = 0
    store_errors: int = 0
    batches: int = 0
    dropped_replies: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class LookupServer:
    """Serve lookups from ``store`` on ``bind``: ``start()`` then ``close()``, or ``serve_forever()``."""

    def __init__(
        self,
        store: TensorStore,
        bind: str = DEFAULT_BIND,
        *,
        block_size: int = 16,
        key_prefix: str = "",
        max_keys: int = protocol.DEFAULT_MAX_KEYS,
        max_message: int = 16 * 1024 * 1024,
        max_batch: int = 512,
        max_inflight: int = 64,
        on_reset: Callable[[], bool] | None = None,
        curve: curve_keys.CurveServerKeys | None = None,
        insecure: bool = False,
    ) -> None:
        if block_size <= 0:
            raise ConfigError(f"lookup server: block_size must be > 0, got {block_size}")
        self.store = store
        self.bind = bind
        self.block_size = block_size
        self.key_prefix = key_prefix
        self.max_keys = max_keys
        self.max_message = max_message
        self.max_batch = max_batch
        self.stats = ServerStats()
        self._on_reset = on_reset
        self._curve = curve
        self._insecure = insecure
        self._auth: AsyncioAuthenticator | None = None
        self._slots = asyncio.Semaphore(max_inflight)
        self._tasks: set[asyncio.Task[None]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self.endpoint: str | None = None

    async def start(self) -> str:
        """Bind and start serving; return the bound endpoint (the real port for ``tcp://host:*``)."""
        if not curve_keys.is_loopback(self.bind) and self._curve is None:
            if not self._insecure:
                raise ConfigError(
                    f"lookup server: {self.bind!r} is reachable beyond this host: give CURVE keys, "
                    "or pass insecure=True (--insecure) to serve it without authentication"
                )
            log.warning(
                "lookup server: binding %s, reachable beyond this host; it has no authentication", self.bind
            )
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            if self._curve is not None:
                self._auth = curve_keys.start_authenticator(ctx, self._curve)
                curve_keys.apply_server(sock, self._curve)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.bind(self.bind)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if endpoint.startswith("ipc://"):
                os.chmod(endpoint[len("ipc://") :], 0o600)
        except (zmq.ZMQError, OSError) as exc:
            sock.close(0)
            self._stop_auth()
            ctx.term()
            raise ConfigError(f"lookup server: cannot bind {self.bind!r}: {exc}") from None
        self._ctx, self._sock, self.endpoint = ctx, sock, endpoint
        self._reader = asyncio.get_running_loop().create_task(self._read())
        log.info("lookup server: serving %s on %s", self.store.name, endpoint)
        return endpoint

    def busy(self) -> int:
        """Batches being answered right now (tests count it back to zero)."""
        return len(self._tasks)

    async def serve_forever(self) -> None:
        if self._reader is None:
            await self.start()
        assert self._reader is not None
        await self._reader

    async def close(self) -> None:
        """Stop reading, cancel batches in flight, close the socket. The store stays open (caller owns it)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)
        self._stop_auth()
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def _stop_auth(self) -> None:
        auth, self._auth = self._auth, None
        if auth is not None:
            auth.stop()

    # -- loop --------------------------------------------------------------------------------------------
    async def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        loop = asyncio.get_running_loop()
        while True:
            await self._slots.acquire()
            try:
                first = await sock.recv_multipart()
            except BaseException:
                self._slots.release()
                raise
            batch = [first]
            while len(batch) < self.max_batch:
                try:
                    batch.append(shadow.recv_multipart(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
            task = loop.create_task(self._answer(batch))
            self._tasks.add(task)
            task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()
        if not task.cancelled() and task.exception() is not None:
            log.error("lookup server: batch failed", exc_info=task.exception())

    async def _answer(self, batch: list[list[bytes]]) -> None:
        stats = self.stats
        stats.batches += 1
        # (route frames, id frame or None, parsed query or None for an error reply)
        parsed: list[tuple[list[bytes], bytes | None, Query | None]] = []
        for frames in batch:
            stats.requests += 1
            route, id_frame, body = _split(frames)
            query: Query | None = None
            if body is not None:
                try:
                    query = protocol.parse_body(body, max_keys=self.max_keys)
                except LookupProtocolError as exc:
                    log.debug("lookup server: bad request: %s", exc)
            if query is None:
                stats.errors += 1
            parsed.append((route, id_frame, query))
        prefix = self.key_prefix
        flat = [protocol.store_key(prefix, k) for _, _, q in parsed if q is not None for k in q.keys]
        present: list[bool] | None = []
        if flat:
            try:
                present = await self._exists(flat)
            except AsyncConnError as exc:
                stats.store_errors += 1
                log.warning(
                    "lookup server: store failed, answering %d requests with errors: %s", len(parsed), exc
                )
                present = None
        sock = self._sock
        if sock is None:
            return
        pos = 0
        for route, id_frame, query in parsed:
            reply = protocol.ERROR
            if query is not None:
                n = len(query.keys)
                seg = present[pos : pos + n] if present is not None else None
                pos += n
                reply = self._reply(query, seg)
            frames = [*route, id_frame, reply] if id_frame is not None else [*route, reply]
            if not send_nowait(sock, frames):  # the peer's queue is full or it is gone
                stats.dropped_replies += 1

    async def _exists(self, keys: list[str]) -> list[bool]:
        """One store call per ``max_keys`` keys (a burst of big requests never builds one giant command)."""
        step = self.max_keys
        if len(keys) <= step:
            return await self.store.exists(keys)
        parts = await asyncio.gather(
            *(self.store.exists(keys[i : i + step]) for i in range(0, len(keys), step))
        )
        return [flag for part in parts for flag in part]

    def _reply(self, query: Query, seg: list[bool] | None) -> bytes:
        kind = query.kind
        if kind is Kind.RESET:
            self.stats.resets += 1
            ok = self._on_reset() if self._on_reset is not None else False
            return protocol.OK if ok else protocol.ERROR
        if seg is None:
            return protocol.ERROR
        self.stats.lookups += 1
        if kind is Kind.EXISTS:
            return protocol.OK + bytes(seg)
        hit = leading(seg)
        if kind is Kind.LOOKUP:
            return protocol.encode_u32(min(hit * self.block_size, query.token_count))
        return protocol.encode_u32(hit)


def _split(frames: list[bytes]) -> tuple[list[bytes], bytes | None, list[bytes] | None]:
    """(route, id frame, body) of a ROUTER message; body None when the envelope itself is malformed.

    The route is the identity plus the empty delimiter REQ and our DEALER clients send; it is echoed back.
    """
    if len(frames) < 2 or frames[1] != b"":
        return frames[:1], None, None
    route, rest = frames[:2], frames[2:]
    if rest and protocol.parse_id(rest[0]) is not None:
        return route, rest[0], rest[1:]
    return route, None, rest
