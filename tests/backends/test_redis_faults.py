"""The Redis backend when things go wrong: foreign or damaged values, a killed or frozen server, races.

Bad bytes must become misses (counted as corrupt by TensorStore), never a wrong tensor; a dead or hung
server must fail calls within the timeout and the backend must work again once the server is back, with
no connection or task left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
import torch
from asyncconn_backends.redis.backend import RedisBackend
from asyncconn_backends.redis.layout import MANIFEST_FIELD, MANIFEST_MAGIC, Manifest, chunk_fields, main_key
from asyncconn_backends.redis.reader import SKIPPED, ChunkReader, ReplyError
from asyncconn_backends.redis.sockets import open_tcp

from asyncconn.backend import open_backend
from asyncconn.exceptions import BackendError, BackendTimeout, BackendUnavailable
from asyncconn.store import Fetch, TensorStore
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


async def _store(url: str, timeout: float = 5.0) -> TensorStore:
    backend = await open_backend(url)
    assert isinstance(backend, RedisBackend)
    return TensorStore(backend, timeout=timeout)


def _backend(store: TensorStore) -> RedisBackend:
    assert isinstance(store.backend, RedisBackend)
    return store.backend


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        yield client
    finally:
        await client.aclose()


def _tasks() -> int:
    return len(asyncio.all_tasks())


# -- bad bytes -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "foreign",
    [b"hello from redis-cli", b"", b"ACNF" + b"\x00" * 60, MANIFEST_MAGIC + b"\x01" * 32, b"\x00ACM"],
)
async def test_value_written_by_another_tool_is_a_counted_miss(
    redis_server: RedisServer, raw: aioredis.Redis, foreign: bytes
) -> None:
    store = await _store(f"redis://127.0.0.1:{redis_server.port}/0?prefix=foreign:")
    try:
        await raw.set(main_key("foreign:", "k"), foreign)
        assert await store.get(["k"]) == [None]
        assert store.stats.corrupt == 1 and store.stats.misses == 1
        assert not await store.get_into("k", torch.empty(4))
    finally:
        await store.delete(["k"])
        await store.close()


async def test_foreign_types_under_our_key(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    """A hash that is not ours, or a list, under our key: a miss; a put replaces it (inline or chunked)."""
    store = await _store(f"redis://127.0.0.1:{redis_server.port}/0?prefix=wrongtype:&chunk_size=64")
    head = main_key("wrongtype:", "k")
    try:
        for value in (torch.arange(100), torch.arange(2)):  # chunked, then inline
            await raw.delete(head)
            await raw.hset(head, "field", "value")
            assert await store.get(["k"]) == [None] and await store.exists(["k"]) == [True]
            await raw.delete(head)
            await raw.rpush(head, "item")
            assert await store.get(["k"]) == [None]
            assert await store.read_into("k", torch.empty_like(value)) is Fetch.MISS
            await store.put([("k", value)])
            (got,) = await store.get(["k"])
            assert got is not None and torch.equal(got, value)
            assert await raw.keys("wrongtype:*") == [head.encode()]
        assert store.stats.corrupt == 0
        assert await store.delete(["k"]) == 1
        assert await raw.keys("wrongtype:*") == []
    finally:
        await store.close()


async def _chunked(server: RedisServer, prefix: str) -> tuple[TensorStore, str, list[str]]:
    """A store holding one chunked value under "k"; its Redis key and its chunk fields."""
    store = await _store(f"redis://127.0.0.1:{server.port}/0?prefix={prefix}&chunk_size=256")
    await store.put([("k", torch.arange(300, dtype=torch.float32))])
    name = main_key(prefix, "k")
    head = await _backend(store)._client.hget(name, MANIFEST_FIELD)
    assert isinstance(head, bytes)
    manifest = Manifest.parse(head)
    assert manifest is not None and manifest.count > 2
    return store, name, chunk_fields(manifest)


async def test_manifest_pointing_at_missing_chunks_is_a_miss(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    store, name, fields = await _chunked(redis_server, "missing:")
    try:
        await raw.hdel(name, fields[1])
        assert await store.get(["k"]) == [None]
        assert store.stats.misses == 1 and store.stats.corrupt == 0
        assert await store.read_into("k", torch.empty(300)) is Fetch.MISS
        assert store.stats.misses == 2 and store.stats.corrupt == 0
    finally:
        await store.delete(["k"])
        await store.close()
    assert await raw.keys("missing:*") == []


async def test_truncated_chunk_is_a_miss(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    store, name, fields = await _chunked(redis_server, "trunc:")
    try:
        await raw.hset(name, fields[-1], b"\x00")
        assert await _backend(store).get(["k"]) == [None]  # the manifest's length no longer adds up
        assert await store.get(["k"]) == [None]
        assert await store.read_into("k", torch.empty(300)) is Fetch.MISS
    finally:
        await store.delete(["k"])
        await store.close()


async def test_flipped_byte_in_a_chunk_is_a_counted_miss(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    store, name, fields = await _chunked(redis_server, "flip:")
    try:
        stored = await raw.hget(name, fields[2])
        assert isinstance(stored, bytes)
        chunk = bytearray(stored)
        chunk[7] ^= 0x40
        await raw.hset(name, fields[2], bytes(chunk))
        assert await store.get(["k"]) == [None]
        assert store.stats.corrupt == 1
        out = torch.empty(300)
        assert await store.read_into("k", out) is Fetch.CORRUPT  # landed in out, then refused
        assert store.stats.corrupt == 2
    finally:
        await store.delete(["k"])
        await store.close()


# -- a dead or frozen server -----------------------------------------------------------------------------
@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_server_killed_mid_batch_then_restarted(fresh_redis: RedisServer, fast_read: str) -> None:
    tasks_before = _tasks()
    store = await _store(
        f"{fresh_redis.url}?chunk_size=64KiB&parallel=4&max_connections=8&fast_read={fast_read}"
    )
    backend = _backend(store)
    batch = [(f"k{i}", torch.randn(256, 1024)) for i in range(8)]  # 1 MiB each: 17 chunks
    try:
        await store.put(batch[:2])
        fresh_redis.pause()  # the batch below is sent into socket buffers and waits for replies...
        put = asyncio.ensure_future(store.put(batch))
        get = asyncio.ensure_future(store.get(["k0", "k1"]))
        await asyncio.sleep(0.2)
        assert not put.done() and not get.done()
        fresh_redis.kill()  # ...until the server dies under it: reset connections, not a timeout
        for job in (put, get):
            with pytest.raises(BackendUnavailable):
                await job
        with pytest.raises(BackendUnavailable):
            await store.exists(["k0"])
        assert backend.held()["in_use"] == 0

        fresh_redis.start()  # same port, empty: the pool's dead sockets must be replaced
        assert await store.get(["k0"]) == [None]
        await store.put(batch[:3])
        got = await store.get(["k0", "k2"])
        assert got[0] is not None and torch.equal(got[0], batch[0][1])
        assert got[1] is not None and torch.equal(got[1], batch[2][1])
        assert backend.held()["in_use"] == 0
    finally:
        await store.close()
    assert backend.held() == {"connected": 0, "in_use": 0}
    assert _tasks() == tasks_before


@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_paused_server_times_out_then_recovers(fresh_redis: RedisServer, fast_read: str) -> None:
    tasks_before = _tasks()
    store = await _store(
        f"{fresh_redis.url}?chunk_size=64KiB&timeout=500ms&fast_read={fast_read}", timeout=5.0
    )
    backend = _backend(store)
    value = torch.randn(64, 1024)
    try:
        await store.put([("k", value)])
        fresh_redis.pause()
        with pytest.raises(BackendTimeout):
            await store.get(["k"])
        with pytest.raises(BackendTimeout):
            await store.get_into("k", torch.empty_like(value))
        with pytest.raises(BackendTimeout):
            await store.put([("k2", value)])
        with pytest.raises(BackendTimeout):
            await store.delete(["k"])
        assert backend.held()["in_use"] == 0
        fresh_redis.resume()
        (got,) = await store.get(["k"])
        assert got is not None and torch.equal(got, value)
        assert backend.held()["in_use"] == 0
    finally:
        fresh_redis.resume()
        await store.close()
    assert _tasks() == tasks_before


@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_cancelled_get_returns_its_connections(fresh_redis: RedisServer, fast_read: str) -> None:
    store = await _store(f"{fresh_redis.url}?chunk_size=64KiB&fast_read={fast_read}")
    backend = _backend(store)
    try:
        await store.put([("k", torch.randn(256, 1024))])
        fresh_redis.pause()
        job = asyncio.ensure_future(store.get(["k"]))
        await asyncio.sleep(0.1)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert backend.held()["in_use"] == 0
        fresh_redis.resume()
        assert (await store.get(["k"]))[0] is not None
    finally:
        fresh_redis.resume()
        await store.close()


async def test_cancelled_get_into_returns_its_connections(fresh_redis: RedisServer) -> None:
    tasks_before = _tasks()
    store = await _store(f"{fresh_redis.url}?chunk_size=64KiB")
    backend = _backend(store)
    value = torch.randn(256, 1024)
    try:
        await store.put([("k", value)])
        out = torch.empty_like(value)
        fresh_redis.pause()
        job = asyncio.ensure_future(store.get_into("k", out))
        await asyncio.sleep(0.1)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert backend.held()["in_use"] == 0
        fresh_redis.resume()
        assert await store.get_into("k", out) and torch.equal(out, value)
    finally:
        fresh_redis.resume()
        await store.close()
    assert backend.held() == {"connected": 0, "in_use": 0}
    assert _tasks() == tasks_before


async def test_closed_backend_refuses_calls(redis_server: RedisServer) -> None:
    store = await _store(f"{redis_server.url}?prefix=closed:")
    await store.close()
    await store.close()
    with pytest.raises(BackendUnavailable, match="closed"):
        await store.get(["k"])


# -- racing producers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_racing_writers_never_show_a_torn_value(
    redis_server: RedisServer, raw: aioredis.Redis, fast_read: str
) -> None:
    prefix = f"race-{fast_read}:"
    url = (
        f"redis://127.0.0.1:{redis_server.port}/0?prefix={prefix}&chunk_size=4KiB&max_connections=32"
        f"&fast_read={fast_read}"
    )
    writers = [await _store(url) for _ in range(4)]
    reader = await _store(url)
    values = [torch.full((64, 256), float(i)) for i in range(len(writers))]  # 64 KiB: 17 chunks each
    seen: list[int] = []
    seen_direct: list[int] = []
    stop = asyncio.Event()

    async def write(store: TensorStore, value: torch.Tensor) -> None:
        # At least 25 rounds back to back, then on (up to a cap) until both readers have seen a whole
        # value. Past the first 25, each writer leaves a growing gap after its put: on a loaded box four
        # writers back to back can overlap every 17-chunk direct read, and a read that overlaps a write
        # is (rightly) a miss, so the readers need some quiet windows to prove they see whole values.
        rounds = 0
        while rounds < 25 or (not (seen and seen_direct) and rounds < 2000):
            await store.put([("k", value)])
            rounds += 1
            if rounds > 25:
                await asyncio.sleep(min(0.05, 0.001 * (rounds - 25)))

    async def read() -> None:
        while not stop.is_set():
            (got,) = await reader.get(["k"])
            if got is not None:
                matches = [i for i, v in enumerate(values) if torch.equal(got, v)]
                assert len(matches) == 1, "a read returned a value no writer wrote"
                seen.append(matches[0])

    async def read_into() -> None:  # the direct path: chunks land in the tensor as they arrive
        out = torch.empty(64, 256)
        while not stop.is_set():
            status = await reader.read_into("k", out)
            assert status is not Fetch.CORRUPT
            if status is Fetch.HIT:
                matches = [i for i, v in enumerate(values) if torch.equal(out, v)]
                assert len(matches) == 1, "a direct read landed a value no writer wrote"
                seen_direct.append(matches[0])

    try:
        readers = [asyncio.ensure_future(read()), asyncio.ensure_future(read_into())]
        await asyncio.gather(*(write(s, v) for s, v in zip(writers, values, strict=True)))
        stop.set()
        await asyncio.gather(*readers)
        assert seen and seen_direct, "readers never saw a value"
        assert reader.stats.corrupt == 0
        head = await raw.hget(main_key(prefix, "k"), MANIFEST_FIELD)
        assert isinstance(head, bytes)
        manifest = Manifest.parse(head)
        assert manifest is not None
        # one key, holding the last version's chunks and nothing else
        assert await raw.keys(f"{prefix}*") == [main_key(prefix, "k").encode()]
        assert sorted(await raw.hkeys(main_key(prefix, "k"))) == sorted(
            f.encode() for f in [MANIFEST_FIELD, *chunk_fields(manifest)]
        )
        assert await reader.delete(["k"]) == 1
        assert await raw.keys(f"{prefix}*") == []
    finally:
        for store in [*writers, reader]:
            await store.close()


async def test_chunk_loss_is_retried_from_the_new_manifest(redis_server: RedisServer) -> None:
    """A reader whose chunks vanish (replaced by a newer write) follows the new manifest once."""
    prefix = "retry:"
    store = await _store(f"redis://127.0.0.1:{redis_server.port}/0?prefix={prefix}&chunk_size=128")
    backend = _backend(store)
    old, new = torch.zeros(200), torch.ones(200)
    real_heads = backend._heads
    calls = 0

    async def heads_then_replace(names: list[str]) -> list[bytes | Manifest | None]:
        nonlocal calls
        calls += 1
        result = await real_heads(names)
        if calls == 1:  # after the reader has read the old manifest, a producer replaces the value
            await store.put([("k", new)])
        return result

    try:
        await store.put([("k", old)])
        backend._heads = heads_then_replace  # type: ignore[method-assign]
        (got,) = await store.get(["k"])
        assert got is not None and torch.equal(got, new)
        # the direct read follows the new manifest the same way
        await store.put([("k", old)])
        calls = 0
        out = torch.empty(200)
        assert await store.read_into("k", out) is Fetch.HIT and torch.equal(out, new)
        assert calls == 2
    finally:
        await store.delete(["k"])
        await store.close()


async def test_chunks_lost_twice_is_a_miss(redis_server: RedisServer) -> None:
    """A direct read whose chunks vanish on both attempts reports a miss, never a partial value."""
    prefix = "lost-twice:"
    store = await _store(f"redis://127.0.0.1:{redis_server.port}/0?prefix={prefix}&chunk_size=128")
    backend = _backend(store)
    real_heads = backend._heads

    async def heads_then_replace(names: list[str]) -> list[bytes | Manifest | None]:
        result = await real_heads(names)
        await store.put([("k", torch.rand(200))])  # every manifest read is stale at once
        return result

    try:
        await store.put([("k", torch.zeros(200))])
        backend._heads = heads_then_replace  # type: ignore[method-assign]
        assert await store.read_into("k", torch.empty(200)) is Fetch.MISS
        assert store.stats.corrupt == 0 and backend.held()["in_use"] == 0
    finally:
        backend._heads = real_heads  # type: ignore[method-assign]
        await store.delete(["k"])
        await store.close()


# -- the raw chunk reader against a misbehaving server ----------------------------------------------------
async def _serve(reply: bytes) -> asyncio.Server:
    """A server that answers every request with ``reply`` (then keeps the connection open)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await reader.read(65536):
                writer.write(reply)
        finally:
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@contextlib.asynccontextmanager
async def _served(reply: bytes) -> AsyncIterator[ChunkReader]:
    """A :class:`ChunkReader` connected to :func:`_serve`'s server; both closed on the way out."""
    server = await _serve(reply)
    reader = _reader_for(server)
    try:
        yield reader
    finally:
        await reader.close()
        server.close()
        await server.wait_closed()


def _reader_for(server: asyncio.Server) -> ChunkReader:
    """Connected as the backends connect (:func:`open_tcp`: the multi-buffer socket transport)."""
    port = server.sockets[0].getsockname()[1]
    return ChunkReader(
        lambda factory: open_tcp("127.0.0.1", port, factory),
        username=None, password=None, db=0, max_connections=2,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "error"),
    [
        (b"*1\r\n$999999999\r\n", "over the"),  # a declared length beyond the value asked for
        (b"*2\r\n$3\r\nabcXY$1\r\nz\r\n", "CRLF"),
        (b"?what\r\n", "unknown reply type"),
        (b"*x\r\n", "bad reply"),
        (b"-ERR no such thing\r\n", "no such thing"),
        (b"$" + b"9" * 70_000, "longer than"),
    ],
)
async def test_chunk_reader_rejects_bad_replies(reply: bytes, error: str) -> None:
    async with _served(reply) as reader:
        with pytest.raises(BackendError, match=error):
            await reader.mget(["a", "b"], 1000)
        assert reader.held() == {"connected": 0, "in_use": 0}


async def test_chunk_reader_parses_split_and_nil_replies() -> None:
    body = os.urandom(200_000)
    async with _served(b"*3\r\n$-1\r\n$%d\r\n%s\r\n$0\r\n\r\n" % (len(body), body)) as reader:
        for _ in range(2):  # the second call reuses the pooled connection
            assert await reader.mget(["a", "b", "c"], len(body)) == [None, body, b""]
        assert reader.held() == {"connected": 1, "in_use": 0}
    assert reader.held() == {"connected": 0, "in_use": 0}


async def test_chunk_reader_lands_replies_in_their_slots() -> None:
    body = os.urandom(200_000)
    server = await _serve(b"*3\r\n$-1\r\n$%d\r\n%s\r\n$5\r\nabcde\r\n" % (len(body), body))
    reader = _reader_for(server)
    slots = [bytearray(10), bytearray(len(body)), bytearray(3)]
    views = [memoryview(s) for s in slots]
    try:
        replies = await reader.mget_into(["a", "b", "c"], views, len(body))
        assert replies[0] is None
        assert replies[1] is views[1] and slots[1] == body  # received in place
        assert bytes(replies[2] or b"") == b"abcde" and slots[2] == bytearray(3)  # wrong length: own buffer
        with pytest.raises(ValueError, match="one slot per name"):
            await reader.mget_into(["a"], views, len(body))
        assert reader.held() == {"connected": 1, "in_use": 0}
    finally:
        await reader.close()
        server.close()
        await server.wait_closed()


async def test_chunk_reader_cancelled_mid_reply_closes_the_connection() -> None:
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"*1\r\n$100\r\n" + b"x" * 40)  # part of the value, then nothing
        await writer.drain()
        await release.wait()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    reader = _reader_for(server)
    slot = bytearray(100)
    try:
        job = asyncio.ensure_future(reader.mget_into(["a"], [memoryview(slot)], 100))
        await asyncio.sleep(0.1)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        # a half-read reply cannot be resumed: the connection is gone
        assert reader.held() == {"connected": 0, "in_use": 0}
        assert slot == b"x" * 40 + bytes(60)
    finally:
        release.set()
        await reader.close()
        server.close()
        await server.wait_closed()


async def test_chunk_reader_server_closing_mid_reply_is_unavailable() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)
        writer.write(b"*2\r\n$5\r\nab")  # half a reply, then the server goes away
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    reader = _reader_for(server)
    try:
        with pytest.raises(BackendUnavailable, match="connection lost"):
            await reader.mget(["a", "b"], 10)
        assert reader.held() == {"connected": 0, "in_use": 0}
    finally:
        await reader.close()
        server.close()
        await server.wait_closed()


# -- chunked writes over the raw connections -------------------------------------------------------------
async def test_chunk_reader_execute_reads_past_oversized_replies() -> None:
    big = os.urandom(100_000)
    async with _served(b"+OK\r\n+QUEUED\r\n*2\r\n$%d\r\n%s\r\n:3\r\n" % (len(big), big)) as reader:
        for _ in range(2):  # the connection stays usable: the big reply was read past, not left behind
            replies = await reader.execute([b"anything"], 3, 40)
            assert replies == [b"OK", b"QUEUED", SKIPPED, 3]
        assert reader.held() == {"connected": 1, "in_use": 0}


async def test_chunk_reader_execute_error_reply_closes_the_connection() -> None:
    async with _served(b"+OK\r\n-OOM command not allowed\r\n-EXECABORT discarded\r\n") as reader:
        with pytest.raises(ReplyError, match="OOM"):
            await reader.execute([b"MULTI", memoryview(b"...")], 3, 40)
        assert reader.held() == {"connected": 0, "in_use": 0}


async def test_write_to_a_server_dropping_the_connection_is_unavailable() -> None:
    """A connection that dies mid-write is a BackendUnavailable, never a raw OSError, and nothing leaks."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(65536)  # part of the transaction, then the connection is reset
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = await open_backend(f"redis://127.0.0.1:{port}/0?check=false&chunk_size=64KiB")
    assert isinstance(backend, RedisBackend)
    try:
        with pytest.raises(BackendUnavailable, match="put failed"):
            await backend.put([("k", os.urandom(1 << 20))])
        assert backend.held()["in_use"] == 0
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()
    assert backend.held() == {"connected": 0, "in_use": 0}


async def test_write_cut_off_mid_send_leaves_the_old_value(fresh_redis: RedisServer) -> None:
    """A write that times out half sent never reached EXEC: the old value stays whole, no chunk is added."""
    tasks_before = _tasks()
    store = await _store(f"{fresh_redis.url}?prefix=cut:&timeout=500ms", timeout=5.0)
    backend = _backend(store)
    patient = await _store(f"{fresh_redis.url}?prefix=cut:&timeout=30s", timeout=30.0)  # busy machines
    raw = aioredis.Redis(host="127.0.0.1", port=fresh_redis.port)
    old = torch.arange(1 << 19, dtype=torch.int32)  # 2 MiB: chunked
    new = torch.ones(16 << 20, dtype=torch.int32)  # 64 MiB: more than loopback's socket buffers hold
    try:
        await patient.put([("k", old)])
        before = sorted(await raw.keys("cut:*"))
        assert await store.get_into("k", torch.empty_like(old))  # the write below reuses a raw connection
        fresh_redis.pause()
        with pytest.raises(BackendTimeout):
            await store.put([("k", new)])
        assert backend.held()["in_use"] == 0
        fresh_redis.resume()
        out = torch.empty_like(old)
        assert await patient.get_into("k", out) and torch.equal(out, old)
        assert sorted(await raw.keys("cut:*")) == before
        await patient.put([("k", new)])  # and the next write goes through
        (got,) = await patient.get(["k"])
        assert got is not None and torch.equal(got, new)
    finally:
        fresh_redis.resume()
        await raw.aclose()
        await store.close()
        await patient.close()
    assert backend.held() == {"connected": 0, "in_use": 0}
    assert _tasks() == tasks_before


async def test_write_answered_with_a_nil_exec_is_a_backend_error() -> None:
    """A reply that does not fit the transaction sent is an error, not an IndexError or a silent success."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"EXEC\r\n")
        writer.write(b"+OK\r\n" + b"+QUEUED\r\n" * 2 + b"*-1\r\n")  # as if a WATCH had aborted it
        await writer.drain()
        await reader.read()  # until the client goes away
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = await open_backend(f"redis://127.0.0.1:{port}/0?check=false&chunk_size=1KiB")
    assert isinstance(backend, RedisBackend)
    try:
        with pytest.raises(BackendError, match="unexpected reply"):
            await backend.put([("k", os.urandom(3000))])  # UNLINK and one HSET: two queued
        assert backend.held()["in_use"] == 0
    finally:
        await backend.close()
        server.close()
        await server.wait_closed()


async def test_the_connect_bound_is_separate_from_the_call_bound() -> None:
    """Connectors open their store while vLLM starts: a longer ``connect_timeout`` than the serving-path
    ``timeout``, each reported by its own value."""
    server = RedisServer().start()
    try:
        server.pause()
        with pytest.raises(BackendTimeout, match=r"could not connect within 0\.3s"):
            await TensorStore.open(server.url, timeout=0.1, connect_timeout=0.3)
        server.resume()
        store = await TensorStore.open(server.url, timeout=0.1, connect_timeout=5)
        assert store.timeout == 0.1
        await store.close()
    finally:
        server.stop()


def test_pause_returns_once_every_server_thread_is_stopped(fresh_redis: RedisServer) -> None:
    """``kill(SIGSTOP)`` only queues the signal; a fault test that sends a request right after ``pause`` must
    find the server frozen (a frozen mooncake_master was seen answering one under load)."""
    assert fresh_redis.proc is not None
    pid = fresh_redis.proc.pid
    for _ in range(20):
        fresh_redis.pause()
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
            states.append(stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3])
        assert states and all(s in (b"T", b"t") for s in states), states
        fresh_redis.resume()


# -- an LRU cache under maxmemory ---------------------------------------------------------------------------
@pytest.mark.parametrize("chunk_size", ["1MiB", "256KiB"])
async def test_chunked_values_are_evicted_whole_under_allkeys_lru(chunk_size: str) -> None:
    """2 MiB values, each re-read four writes later, in 24 MB of ``allkeys-lru``: the cache keeps working.

    With one Redis key per chunk the server evicted chunks one by one, so most values lost a piece while
    their other chunks still held memory: 28% hits at 1 MiB chunks, 4% at 256 KiB (stored whole: 91%).
    Every value left behind is whole: a string, or a hash holding its manifest and all its chunks.
    """
    from asyncconn_tools.bench.redis import eviction_hit_rate

    server = RedisServer(extra_args=("--maxmemory", "24mb", "--maxmemory-policy", "allkeys-lru")).start()
    raw = aioredis.Redis(host="127.0.0.1", port=server.port)
    try:
        url = f"{server.url}?chunk_size={chunk_size}"
        result = await eviction_hit_rate(url, 2 << 20, values=100)
        assert result["evicted_keys"] > 0 and result["corrupt"] == 0
        assert result["hit_rate"] >= 0.75, result
        names = await raw.keys("*")
        assert names
        for name in names:
            if await raw.type(name) == b"hash":
                head = await raw.hget(name, MANIFEST_FIELD)
                manifest = Manifest.parse(head or b"")
                assert manifest is not None and await raw.hlen(name) == 1 + manifest.count
    finally:
        await raw.aclose()
        server.stop()
