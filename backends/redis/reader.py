"""The chunk read fast path: ``MGET`` over raw connections whose bulk replies land in their final buffers.

Why it exists: through redis-py and hiredis every payload byte is copied six times on its way from the
socket to a ``bytes`` chunk (event loop read buffer -> ``bytes`` -> StreamReader buffer -> ``bytes`` ->
hiredis buffer -> reply ``bytes``), which kept large reads well behind ``redis-benchmark``. Here the
protocol hands the kernel the chunk's own ``bytearray`` once the ``$<len>`` line is parsed, so the payload
is copied once (kernel -> chunk). With :meth:`ChunkReader.mget_into` the caller names that memory itself
(slices of the destination tensor, or several pieces in order), so nothing is allocated per read. The
backends connect through :mod:`.sockets`, whose transport fills a value's pieces several per receive
(:meth:`_RespProtocol.get_buffers`); any asyncio transport works too, one buffer per receive.

Scope is deliberately small: RESP2 replies to ``AUTH``, ``SELECT``, ``MGET`` and ``HMGET``, and to the
pipelined ``MULTI ... EXEC`` of a chunked write (``writer`` builds it;
:meth:`ChunkReader.execute` sends it), on plain TCP or unix sockets (``rediss://`` stays on redis-py). Every
other command goes through redis-py. Nothing read is evaluated; a declared bulk length above the caller's
cap (the manifest's total) is a protocol error, so a hostile server cannot make us allocate more than the
value we asked for -- or, where the caller says so (a transaction's replies), it is read
past and reported as :data:`SKIPPED`.

Ownership: a connection is either idle in :class:`ChunkReader` or lent to exactly one request. A request
that fails or is cancelled closes its connection (a half-read reply cannot be resumed) instead of
returning it, and drops its references to the caller's memory, so nothing is written there once the call
has returned; :meth:`ChunkReader.close` closes the idle ones.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any, cast

from asyncconn.exceptions import BackendError, BackendUnavailable

__all__ = ["SKIPPED", "ChunkReader", "ReplyError", "Skipped", "Slot"]

_LINE_BUFFER = 64 * 1024


class Skipped:
    """The type of :data:`SKIPPED`: a bulk reply longer than the request's cap, read past unseen."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIPPED"


SKIPPED = Skipped()
Reply = bytearray | bytes | memoryview | tuple[memoryview, ...] | int | Skipped | None
#: Where one bulk reply may land: one buffer, or several filled in order (a frame's header, then its payload).
Slot = memoryview | tuple[memoryview, ...]
#: What one request sends: one buffer, or several written out in order without being joined.
Payload = bytes | Sequence[bytes | memoryview]


class ReplyError(BackendError):
    """The server answered a command with an error reply (``-ERR ...``)."""


class _ProtocolError(BackendError):
    pass


class _RespProtocol(asyncio.BufferedProtocol):
    """Parses RESP2 replies; bulk strings are received straight into their own ``bytearray``."""

    def __init__(self) -> None:
        self._line = bytearray(_LINE_BUFFER)
        self._view = memoryview(self._line)
        self._fill = 0
        self._dest: memoryview | None = None
        self._dest_fill = 0
        self._dest_rest: list[memoryview] = []  # a scattered slot's views still to fill, in order
        self._skip = 0  # the CRLF after a bulk string still to come
        self._discard = 0  # bytes of an oversized bulk string still to read past
        self._skip_oversized = False
        self._waiter: asyncio.Future[list[Reply]] | None = None
        self._replies: list[Reply] = []
        self._tops_left = 0
        self._array_left = 0
        self._max_bulk = 0
        self._slots: Sequence[Slot] = ()  # indexed by reply position
        self.transport: asyncio.Transport | None = None
        self.lost = False

    # -- requests ------------------------------------------------------------------------------------
    def request(
        self,
        payload: Payload,
        replies: int,
        max_bulk: int,
        slots: Sequence[Slot] = (),
        *,
        skip_oversized: bool = False,
    ) -> asyncio.Future[list[Reply]]:
        """Send ``payload`` and return a future for ``replies`` top-level replies (arrays flattened).

        With ``slots``, the n-th reply (arrays flattened), when it is a bulk string of exactly the slot's
        size, is received into that caller memory (a tuple of views: filled one after another) and appears
        in the replies as the slot itself; one of another length gets its own ``bytearray`` as usual (the
        caller decides what a mismatch means). A bulk string over ``max_bulk`` is a protocol error, or
        with ``skip_oversized`` is read past and appears as :data:`SKIPPED`. A payload given as several
        buffers is handed to the transport as they are (uvloop sends them with one ``writev``; nothing is
        joined).
        """
        assert self.transport is not None and self._waiter is None
        waiter: asyncio.Future[list[Reply]] = asyncio.get_running_loop().create_future()
        if self.lost:
            waiter.set_exception(BackendUnavailable("connection closed by the server"))
            return waiter
        self._waiter, self._replies, self._tops_left, self._max_bulk = waiter, [], replies, max_bulk
        self._slots, self._skip_oversized = slots, skip_oversized
        if isinstance(payload, bytes):
            self.transport.write(payload)
        else:
            self.transport.writelines(payload)
        return waiter

    def done(self) -> None:
        """End the request: drop every reference to the caller's memory (it must never be written again)."""
        self._waiter = None
        self._slots = ()
        self._dest = None
        self._dest_rest = []

    # -- transport callbacks -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self._fail(BackendUnavailable(f"connection lost: {exc or 'closed by the server'}"))

    def eof_received(self) -> bool:
        return False

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._dest is not None and not self.lost:
            return self._dest[self._dest_fill :]
        if self._fill == len(self._line):
            self._abort(_ProtocolError("reply line longer than 64 KiB"))
            return self._view  # the transport is closing; the bytes are discarded
        return self._view[self._fill :]

    def get_buffers(self, limit: int) -> list[memoryview]:
        """What :meth:`get_buffer` would hand out, call after call, if each buffer were filled whole: the
        rest of a value's pieces, then (once its last piece is among them) the line buffer, which takes the
        CRLF after it and the next reply's header. For :class:`~.sockets.SocketTransport`."""
        first = self.get_buffer(-1)
        if self._dest is None or self.lost:
            return [first]
        views = [first, *self._dest_rest[: limit - 1]]
        if len(views) < limit and len(views) == len(self._dest_rest) + 1 and self._fill < len(self._line):
            views.append(self._view[self._fill :])
        return views

    def buffers_updated(self, nbytes: int) -> None:
        """``nbytes`` received into the buffers :meth:`get_buffers` named, in order."""
        while nbytes and not self.lost:
            if self._dest is None:
                self.buffer_updated(nbytes)  # the line buffer, the last one named
                return
            take = min(nbytes, len(self._dest) - self._dest_fill)
            self.buffer_updated(take)
            nbytes -= take

    def buffer_updated(self, nbytes: int) -> None:
        if self.lost:  # aborted: whatever still arrives is discarded
            self._fill = 0
            return
        if self._dest is not None:
            self._dest_fill += nbytes
            if self._dest_fill == len(self._dest):
                if self._dest_rest:
                    self._dest, self._dest_fill = self._dest_rest.pop(0), 0
                else:
                    self._dest, self._skip = None, 2
            return
        self._fill += nbytes
        try:
            self._parse()
        except (ValueError, _ProtocolError) as exc:
            self._abort(exc if isinstance(exc, _ProtocolError) else _ProtocolError(f"bad reply: {exc}"))

    # -- parsing -------------------------------------------------------------------------------------
    def _parse(self) -> None:
        line, view, pos = self._line, self._view, 0
        while True:
            if self._discard:
                take = min(self._discard, self._fill - pos)
                pos += take
                self._discard -= take
                if self._discard:
                    break
                self._skip = 2
            if self._skip:
                take = min(self._skip, self._fill - pos)
                if line[pos : pos + take] != b"\r\n"[2 - self._skip : 2 - self._skip + take]:
                    raise _ProtocolError("bulk string not followed by CRLF")
                pos += take
                self._skip -= take
                if self._skip:
                    break
                self._item_done()
            end = line.find(b"\r\n", pos, self._fill)
            if end < 0:
                break
            kind, body = line[pos], bytes(view[pos + 1 : end])
            pos = end + 2
            if self._waiter is None:
                raise _ProtocolError("reply with no request")
            if kind == 0x2A:  # '*'
                count = int(body)
                if count <= 0:  # nil or empty array: no items follow
                    if count < 0:
                        self._replies.append(None)
                    self._top_done()
                else:
                    self._array_left = count
            elif kind == 0x24:  # '$'
                length = int(body)
                if length < 0:
                    self._replies.append(None)
                    self._item_done()
                    continue
                if length > self._max_bulk and self._skip_oversized:
                    self._replies.append(SKIPPED)
                    self._discard = length
                    continue
                if length > self._max_bulk:
                    raise _ProtocolError(f"bulk reply of {length} bytes, over the {self._max_bulk} expected")
                index = len(self._replies)
                slot = self._slots[index] if index < len(self._slots) else None
                if slot is not None and _slot_size(slot) == length:
                    reply: Reply = slot
                    views = [v for v in slot if v.nbytes] if isinstance(slot, tuple) else [slot]
                else:
                    chunk = bytearray(length)
                    reply, views = chunk, [memoryview(chunk)]
                self._replies.append(reply)
                while views:  # what has arrived already goes in now; the rest is received in place
                    dest = views[0]
                    have = min(dest.nbytes, self._fill - pos)
                    dest[:have] = view[pos : pos + have]
                    pos += have
                    if have < dest.nbytes:
                        break
                    views.pop(0)
                if views:
                    self._dest, self._dest_fill, self._dest_rest = views[0], have, views[1:]
                    break
                self._skip = 2
            elif kind == 0x2B:  # '+'
                self._replies.append(body)
                self._item_done()
            elif kind == 0x3A:  # ':'
                self._replies.append(int(body))
                self._item_done()
            elif kind == 0x2D:  # '-'
                self._replies.append(None)
                self._fail(ReplyError(body.decode("utf-8", "replace")))
                self._item_done()
            else:
                raise _ProtocolError(f"unknown reply type {chr(kind)!r}")
        rest = self._fill - pos
        if rest and pos:
            line[:rest] = view[pos : self._fill]
        self._fill = rest

    def _item_done(self) -> None:
        if self._array_left:
            self._array_left -= 1
            if self._array_left:
                return
        self._top_done()

    def _top_done(self) -> None:
        self._tops_left -= 1
        if self._tops_left == 0 and self._waiter is not None:
            if not self._waiter.done():
                self._waiter.set_result(self._replies)
            self._waiter = None

    def _fail(self, exc: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def _abort(self, exc: BaseException) -> None:
        self._fail(exc)
        self.done()
        self.lost = True
        if self.transport is not None:
            self.transport.abort()


def _slot_size(slot: Slot) -> int:
    return sum(v.nbytes for v in slot) if isinstance(slot, tuple) else slot.nbytes


def _command(*args: bytes) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(out)


class ChunkReader:
    """A small pool of raw connections that run ``MGET`` and chunked writes; see the module docstring."""

    def __init__(
        self,
        connect: Callable[[Callable[[], _RespProtocol]], Any],
        *,
        username: str | None,
        password: str | None,
        db: int,
        max_connections: int,
    ) -> None:
        self._connect = connect
        self._handshake: list[bytes] = []
        if password is not None:
            auth = [username.encode(), password.encode()] if username else [password.encode()]
            self._handshake.append(_command(b"AUTH", *auth))
        if db:
            self._handshake.append(_command(b"SELECT", str(db).encode()))
        self._idle: list[_RespProtocol] = []
        self._in_use: set[_RespProtocol] = set()
        self._slots = asyncio.Semaphore(max_connections)
        self._closed = False

    async def _open(self) -> _RespProtocol:
        _, proto = await self._connect(_RespProtocol)
        assert isinstance(proto, _RespProtocol)
        if self._handshake:
            try:
                fut = proto.request(b"".join(self._handshake), len(self._handshake), 0)
                try:
                    await fut
                finally:
                    proto.done()
            except ReplyError as exc:
                _close(proto)
                if str(exc).startswith(("WRONGPASS", "NOAUTH", "NOPERM")):
                    raise BackendUnavailable(f"authentication failed ({exc})") from None
                raise
            except BaseException:
                _close(proto)
                raise
        return proto

    async def mget(self, names: Sequence[str], max_bulk: int) -> list[bytes | bytearray | None]:
        """``MGET names``; each present value is a fresh ``bytearray`` of at most ``max_bulk`` bytes."""
        replies = await self._request((b"MGET",), names, max_bulk, ())
        return [r if isinstance(r, bytearray) else None for r in replies]

    async def hmget(self, key: str, fields: Sequence[str], max_bulk: int) -> list[bytes | bytearray | None]:
        """``HMGET key fields``: :meth:`mget` over the fields of one hash (a chunked value's chunks)."""
        replies = await self._request((b"HMGET", key.encode()), fields, max_bulk, ())
        return [r if isinstance(r, bytearray) else None for r in replies]

    async def hmget_into(
        self, key: str, fields: Sequence[str], slots: Sequence[memoryview], max_bulk: int
    ) -> list[memoryview | bytearray | None]:
        """``HMGET key fields``, each value received into its slot: :meth:`mget_into` over one hash."""
        if len(slots) != len(fields):
            raise ValueError("hmget_into needs one slot per field")
        replies = await self._request((b"HMGET", key.encode()), fields, max_bulk, slots)
        return [r if isinstance(r, (memoryview, bytearray)) else None for r in replies]

    async def mget_into(
        self, names: Sequence[str], slots: Sequence[Slot], max_bulk: int
    ) -> list[Slot | bytearray | None]:
        """``MGET names``, each value received straight into its slot (same index) when it fits exactly.

        Why: allocating a fresh buffer per chunk and copying it into the destination afterwards cost more
        than the network (a 1 MiB ``bytearray`` is zero-filled and, once glibc has handed the freed memory
        back, page-faulted in again on every read; measured in docs/redis.md). A reply is the
        slot itself when it landed there, a ``bytearray`` (at most ``max_bulk`` bytes) when its length was not
        the slot's (the caller's layout guess was wrong: nothing was written to the slot), ``None`` for a
        missing key. The slots
        are written only while this call runs; on failure or cancellation their contents are unspecified.
        """
        if len(slots) != len(names):
            raise ValueError("mget_into needs one slot per name")
        replies = await self._request((b"MGET",), names, max_bulk, slots)
        return [r if isinstance(r, (memoryview, tuple, bytearray)) else None for r in replies]

    async def getex_into(self, name: str, slot: Slot, max_bulk: int, px: int) -> Slot | bytearray | None:
        """``GETEX name PX px``: :meth:`mget_into` of one value that also re-arms its ttl, in one command.

        Why: a read with ``refresh_on_hit`` otherwise needs a second round trip for its ``PEXPIRE``. Needs
        Redis 6.2 or later; an older server answers an error (:class:`ReplyError`), for the caller to fall
        back on.
        """
        (reply,) = await self._request((b"GETEX",), [name], max_bulk, [slot], (b"PX", b"%d" % px))
        return reply if isinstance(reply, (memoryview, tuple, bytearray)) else None

    async def _request(
        self,
        command: tuple[bytes, ...],
        names: Sequence[str],
        max_bulk: int,
        slots: Sequence[Slot],
        suffix: tuple[bytes, ...] = (),
    ) -> list[Reply]:
        """``command`` (``MGET``, ``GETEX``, or ``HMGET`` and its key) followed by ``names``, whose values
        are read, then ``suffix`` (``GETEX``'s options)."""
        payload = _command(*command, *(n.encode() for n in names), *suffix)
        return await self._run(payload, 1, max_bulk, slots, skip_oversized=False)

    async def execute(
        self, payload: Sequence[bytes | memoryview], replies: int, max_bulk: int
    ) -> list[Reply]:
        """Send pre-built commands (``payload``, written un-joined) and return their ``replies`` replies.

        Arrays are flattened into the list. A bulk reply over ``max_bulk`` is :data:`SKIPPED`, not an
        error: a transaction's replies are only recognised, never kept, and reading past a large one
        keeps the connection usable. An error reply raises
        :class:`ReplyError` once the connection has been closed (the rest of the replies are not read).
        A dead pooled connection is retried once on a fresh one, so ``payload`` must be safe to send
        twice (a chunked write is: same keys, same bytes, same version).
        """
        return await self._run(payload, replies, max_bulk, (), skip_oversized=True)

    async def _run(
        self,
        payload: Payload,
        replies: int,
        max_bulk: int,
        slots: Sequence[Slot],
        *,
        skip_oversized: bool,
    ) -> list[Reply]:
        if self._closed:
            raise BackendUnavailable("chunk reader is closed")
        async with self._slots:
            reused = bool(self._idle)
            try:
                proto = await self._take()
                return await self._run_on(proto, payload, replies, max_bulk, slots, skip_oversized)
            except BackendUnavailable:
                if not reused:
                    raise
                # An idle connection can be dead (the server restarted). Every request sent here is
                # idempotent (MGET; a chunked write of one version): once more, on a connection opened now.
                proto = await self._open_lent()
                return await self._run_on(proto, payload, replies, max_bulk, slots, skip_oversized)

    async def _take(self) -> _RespProtocol:
        while self._idle:
            proto = self._idle.pop()
            if not proto.lost:
                self._in_use.add(proto)
                return proto
            _close(proto)
        return await self._open_lent()

    async def _open_lent(self) -> _RespProtocol:
        proto = await self._open()
        self._in_use.add(proto)
        return proto

    async def _run_on(
        self,
        proto: _RespProtocol,
        payload: Payload,
        replies: int,
        max_bulk: int,
        slots: Sequence[Slot],
        skip_oversized: bool,
    ) -> list[Reply]:
        ok = False
        try:
            fut = proto.request(payload, replies, max_bulk, slots, skip_oversized=skip_oversized)
            try:
                got = await fut
            finally:
                proto.done()
            ok = True
        finally:
            self._in_use.discard(proto)
            if ok and not self._closed and not proto.lost:
                self._idle.append(proto)
            else:
                _close(proto)
        return got

    async def close(self) -> None:
        self._closed = True
        for proto in [*self._idle, *self._in_use]:
            _close(proto)
        self._idle.clear()

    def held(self) -> dict[str, int]:
        """Connections held now: ``connected`` (an open socket) and ``in_use`` (lent out), as for the pool."""
        every = [*self._idle, *self._in_use]
        return {"connected": sum(not p.lost for p in every), "in_use": len(self._in_use)}


def _close(proto: _RespProtocol) -> None:
    proto.lost = True
    if proto.transport is not None:
        proto.transport.abort()
