"""A socket transport that receives into several buffers with one system call (``recvmsg_into``).

Why it exists: an in-place read lands a value in many separate pieces (each layer's blocks of a KV cache: 28
pieces of 32 KiB for a 14-layer model's 896 KiB value). asyncio's :class:`asyncio.BufferedProtocol` offers the
kernel one buffer per read, so such a value took one ``recv`` and two Python calls per piece on the event
loop -- on a 2-core box sharing its cores with vLLM and a loopback redis-server, the loop's receive was the
read's bottleneck. Here the protocol names every buffer the next bytes will fill (:class:`MultiBuffered`:
the rest of the current value's pieces, then its line buffer for the CRLF and the next reply's header),
and one ``recvmsg_into`` fills as many as have arrived.

Only what :mod:`.reader`'s protocol uses is implemented: ``write``/``writelines`` (sent at once where the
socket takes them, the rest on writability, never joined), ``abort``/``close``, ``is_closing``. Errors and
end of stream close the socket and reach the protocol as ``connection_lost`` -- soon, never from inside a
call the protocol made. The socket is non-blocking; every callback runs on the loop that opened it.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar

__all__ = ["MultiBuffered", "SocketTransport", "open_tcp", "open_unix"]

_P = TypeVar("_P", bound="MultiBuffered")

#: At most this many buffers per system call (Linux allows 1,024).
MAX_BUFFERS = 256


class MultiBuffered(Protocol):
    """A protocol that can name the next several buffers its bytes go to, in order."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None: ...

    def connection_lost(self, exc: Exception | None) -> None: ...

    def eof_received(self) -> bool | None: ...

    def get_buffers(self, limit: int) -> list[memoryview]:
        """At most ``limit`` buffers, each filled whole before the next gets a byte."""
        ...

    def buffers_updated(self, nbytes: int) -> None:
        """``nbytes`` were received into the buffers the last :meth:`get_buffers` named, in order."""
        ...


class SocketTransport(asyncio.Transport):
    """A connected non-blocking socket driven by the loop's reader and writer callbacks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, protocol: MultiBuffered) -> None:
        super().__init__()
        self._loop, self._sock, self._protocol = loop, sock, protocol
        self._fd = sock.fileno()
        self._pending: collections.deque[memoryview] = collections.deque()  # unsent bytes, in order
        self._closing = False
        protocol.connection_made(self)
        loop.add_reader(self._fd, self._readable)

    # -- asyncio.Transport --------------------------------------------------------------------------
    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._sock if name == "socket" else default

    def is_closing(self) -> bool:
        return self._closing

    def write(self, data: bytes | bytearray | memoryview) -> None:  # type: ignore[override]
        self.writelines([data])

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:  # type: ignore[override]
        if self._closing:
            return
        queued = bool(self._pending)
        self._pending.extend(memoryview(d).cast("B") for d in list_of_data if len(d))
        if not queued:
            self._send()
            if self._pending and not self._closing:
                self._loop.add_writer(self._fd, self._send)

    def close(self) -> None:
        self._lose(None)

    def abort(self) -> None:
        self._lose(None)

    # -- the loop's callbacks -----------------------------------------------------------------------
    def _readable(self) -> None:
        # A short read means the socket is drained: wait for the next readiness instead of asking again.
        for _ in range(32):
            if self._closing:
                return
            views = self._protocol.get_buffers(MAX_BUFFERS)
            offered = sum(v.nbytes for v in views)
            try:
                nbytes = self._sock.recvmsg_into(views)[0]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lose(exc)
                return
            if nbytes == 0:
                self._protocol.eof_received()
                self._lose(None)
                return
            self._protocol.buffers_updated(nbytes)
            if nbytes < offered:
                return

    def _send(self) -> None:
        while self._pending and not self._closing:
            batch = [self._pending[i] for i in range(min(len(self._pending), MAX_BUFFERS))]
            offered = sum(v.nbytes for v in batch)
            try:
                sent = self._sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._lose(exc)
                return
            rest = sent
            while rest:
                head = self._pending[0]
                if rest < head.nbytes:
                    self._pending[0] = head[rest:]
                    break
                rest -= head.nbytes
                self._pending.popleft()
            if sent < offered:
                return  # the socket's buffer is full: the writer callback sends the rest
        if not self._closing:
            self._loop.remove_writer(self._fd)

    def _lose(self, exc: Exception | None) -> None:
        if self._closing:
            return
        self._closing = True
        self._pending.clear()
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        self._loop.call_soon(self._protocol.connection_lost, exc)


async def open_tcp(host: str, port: int, protocol_factory: Callable[[], _P]) -> tuple[SocketTransport, _P]:
    """Connect to ``host:port`` (each address it resolves to, in turn) with ``TCP_NODELAY`` on, as
    ``loop.create_connection`` does; returns the transport and its protocol."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError | None = None
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await loop.sock_connect(sock, address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        protocol = protocol_factory()
        return SocketTransport(loop, sock, protocol), protocol
    raise error or OSError(f"no address for {host}:{port}")


async def open_unix(path: str, protocol_factory: Callable[[], _P]) -> tuple[SocketTransport, _P]:
    """Connect to the unix socket at ``path``."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        await loop.sock_connect(sock, path)
    except BaseException:
        sock.close()
        raise
    protocol = protocol_factory()
    return SocketTransport(loop, sock, protocol), protocol
