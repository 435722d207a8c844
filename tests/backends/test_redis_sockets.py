"""The raw chunk reader's socket transport (``sockets.SocketTransport``) over real loopback sockets.

What it must do: fill a value's many pieces several per receive (the reason it exists), byte for byte in
order however the bytes arrive; send writes larger than the socket's buffer whole and in order; close its
socket exactly once on abort, on the peer's end of stream and on a failed connect, and tell the protocol
once.
"""

from __future__ import annotations

import asyncio
import os
import socket

import pytest
from asyncconn_backends.redis.reader import ChunkReader, _RespProtocol
from asyncconn_backends.redis.sockets import SocketTransport, open_tcp

from tests.descriptors import open_descriptors


class _Counting(_RespProtocol):
    """The reader's protocol, counting the receives that reached it: every receive asks for a buffer first
    (one :meth:`get_buffers` call asks :meth:`get_buffer` once; asyncio's transports ask it directly)."""

    receives = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        type(self).receives += 1
        return super().get_buffer(sizehint)


async def test_a_value_in_many_pieces_is_filled_several_pieces_per_receive() -> None:
    pieces = [bytearray(size) for size in [4096 + (i * 37) % 900 for i in range(256)]]
    value = os.urandom(sum(len(p) for p in pieces))
    other = os.urandom(5000)
    reply = b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(value), value, len(other), other)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        for at in range(0, len(reply), 100_003):  # odd-sized writes: pieces and lines split anywhere
            writer.write(reply[at : at + 100_003])
            await writer.drain()
        await reader.read(1)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _Counting.receives = 0
    reader = ChunkReader(
        lambda factory: open_tcp("127.0.0.1", port, _Counting),
        username=None, password=None, db=0, max_connections=1,
    )  # fmt: skip
    slot = tuple(memoryview(p) for p in pieces)
    try:
        got = await reader.mget_into(["a", "b"], [slot, memoryview(bytearray(5000))], len(value))
        assert got[0] is slot and b"".join(pieces) == value
        assert bytes(got[1] or b"") == other
        # One receive per piece is what asyncio's buffered protocol did; here several land per receive.
        assert _Counting.receives < len(pieces) // 4, _Counting.receives
    finally:
        await reader.close()
        server.close()
        await server.wait_closed()


async def test_a_write_larger_than_the_socket_buffer_is_sent_whole_and_in_order() -> None:
    parts = [os.urandom(3 << 20), memoryview(os.urandom(5 << 20)), b"", os.urandom(1 << 20)]
    sent = b"".join(bytes(p) for p in parts)
    received = bytearray()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(0.2)  # the client's socket buffer fills: the rest waits for writability
        while len(received) < len(sent):
            chunk = await reader.read(1 << 20)
            if not chunk:
                break
            received.extend(chunk)
        writer.write(b"+OK\r\n")
        await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader = ChunkReader(
        lambda factory: open_tcp("127.0.0.1", port, factory),
        username=None, password=None, db=0, max_connections=1,
    )  # fmt: skip
    try:
        assert await reader.execute(parts, 1, 0) == [b"OK"]
        assert received == sent
    finally:
        await reader.close()
        server.close()
        await server.wait_closed()


class _Recorder:
    def __init__(self) -> None:
        self.lost: list[Exception | None] = []
        self.eof = 0
        self.data = bytearray()
        self.buf = bytearray(1024)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)

    def eof_received(self) -> bool:
        self.eof += 1
        return False

    def get_buffers(self, limit: int) -> list[memoryview]:
        return [memoryview(self.buf)]

    def buffers_updated(self, nbytes: int) -> None:
        self.data += self.buf[:nbytes]


async def test_the_peers_end_of_stream_closes_the_socket_once() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    proto = _Recorder()
    transport = SocketTransport(loop, ours, proto)
    theirs.sendall(b"hello")
    theirs.close()
    for _ in range(100):
        if proto.lost:
            break
        await asyncio.sleep(0.01)
    assert proto.data == b"hello" and proto.eof == 1 and proto.lost == [None]
    assert ours.fileno() == -1 and transport.is_closing()
    transport.abort()
    transport.write(b"ignored")
    await asyncio.sleep(0.01)
    assert proto.lost == [None]


async def test_abort_closes_the_socket_once_and_tells_the_protocol_soon() -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    proto = _Recorder()
    before = open_descriptors()
    transport = SocketTransport(loop, ours, proto)
    transport.abort()
    transport.close()
    assert proto.lost == []  # never from inside the caller's call
    await asyncio.sleep(0)
    assert proto.lost == [None] and open_descriptors() == before - 1
    assert theirs.recv(10) == b""  # the peer sees the end of the stream
    theirs.close()


async def test_a_refused_connect_leaves_no_socket_open() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    before = open_descriptors()
    with pytest.raises(OSError):
        await open_tcp("127.0.0.1", port, _RespProtocol)
    assert open_descriptors() == before
