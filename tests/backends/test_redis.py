"""The Redis backend against a real redis-server: layout, URL parameters, auth, sockets, TLS.

The cross-backend contract suite covers the generic behaviour; these tests pin what is Redis-specific.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch
from asyncconn_backends.redis.backend import RedisBackend
from asyncconn_backends.redis.layout import (
    MANIFEST_SIZE,
    MAX_CHUNKS,
    Manifest,
    fetch_groups,
    fill,
    main_key,
    split_value,
)
from asyncconn_backends.redis.writer import chunked_write

from asyncconn.backend import open_backend
from asyncconn.exceptions import BackendUnavailable, ConfigError
from asyncconn.runtime import Runtime
from asyncconn.store import Fetch, TensorStore
from tests.servers import RedisServer, wait_port

pytestmark = pytest.mark.redis


async def _open(url: str) -> RedisBackend:
    backend = await open_backend(url)
    assert isinstance(backend, RedisBackend)
    return backend


@pytest.fixture
async def raw(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        yield client
    finally:
        await client.aclose()


def _url(server: RedisServer, query: str, db: int = 0) -> str:
    return f"redis://127.0.0.1:{server.port}/{db}?{query}"


# -- layout ------------------------------------------------------------------------------------------
def test_split_value_follows_parts_and_chunk_size() -> None:
    inline, chunks = split_value([b"h" * 10, b"p" * 20], 30)
    assert inline == b"h" * 10 + b"p" * 20 and chunks is None
    inline, chunks = split_value([b"h" * 10, b"p" * 25], 10)
    assert inline is None and chunks is not None
    assert [bytes(c) for c in chunks] == [b"h" * 10, b"p" * 10, b"p" * 10, b"p" * 5]


def test_manifest_round_trip_and_rejects_tampering() -> None:
    m = Manifest(b"12345678", 3, 999)
    packed = m.pack()
    assert len(packed) == MANIFEST_SIZE and Manifest.parse(packed) == m
    tampered = bytearray(packed)
    tampered[20] ^= 1
    assert Manifest.parse(bytes(tampered)) is None
    assert Manifest.parse(b"ACNF" + packed[4:]) is None
    # a checked manifest that claims more chunks than bytes, or absurdly many, is not followed
    assert Manifest.parse(Manifest(b"12345678", 5, 3).pack()) is None
    assert Manifest.parse(Manifest(b"12345678", MAX_CHUNKS + 1, 1 << 40).pack()) is None


def test_fetch_groups_balance_bytes_not_counts() -> None:
    mib = 1 << 20
    # a 48-byte header chunk and four 1 MiB chunks over four connections: ~1 MiB each, not 48 B and 2 MiB
    assert fetch_groups([48, mib, mib, mib, mib], 4) == [0, 2, 3, 4, 5]
    assert fetch_groups([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert fetch_groups([10], 4) == [0, 1]  # never an empty group
    assert fetch_groups([5, 5], 1) == [0, 2]


def test_fill_scatters_across_destinations() -> None:
    dests = [bytearray(2), bytearray(3)]
    fill([memoryview(d) for d in dests], b"abcde")
    assert dests == [bytearray(b"ab"), bytearray(b"cde")]
    with pytest.raises(ValueError, match="6 bytes into 5"):
        fill([memoryview(d) for d in dests], b"abcdef")


def test_chunked_write_is_resp_around_the_callers_memory() -> None:
    big = memoryview(bytearray(b"x" * 5000))
    small = memoryview(b"hdr")
    job = chunked_write("{k}", b"MANIFEST", ["v:0", "v:1"], [small, big], px=1500)
    expected = (
        b"*1\r\n$5\r\nMULTI\r\n"
        b"*2\r\n$6\r\nUNLINK\r\n$3\r\n{k}\r\n"
        b"*8\r\n$4\r\nHSET\r\n$3\r\n{k}\r\n$1\r\nm\r\n$8\r\nMANIFEST\r\n"
        b"$3\r\nv:0\r\n$3\r\nhdr\r\n$3\r\nv:1\r\n$5000\r\n" + b"x" * 5000 + b"\r\n"
        + b"*3\r\n$7\r\nPEXPIRE\r\n$3\r\n{k}\r\n$4\r\n1500\r\n"
        + b"*1\r\n$4\r\nEXEC\r\n"
    )  # fmt: skip
    assert b"".join(job.payload) == expected
    assert any(part is big for part in job.payload)  # sent from the caller's memory, not copied
    assert len(job.payload) == 3  # small buffers around the one large argument
    assert (job.replies, job.items) == (5, 7)  # OK, 3 x QUEUED, EXEC's array of 3 integers
    plain = chunked_write("{k}", b"M", ["v:0"], [small], px=None)
    assert b"PEXPIRE" not in b"".join(plain.payload) and (plain.replies, plain.items) == (4, 5)


# -- round trips ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 1023, 1024, 1025, 3 * 1024, 10_000])
async def test_round_trip_raw_values(redis_server: RedisServer, raw: aioredis.Redis, size: int) -> None:
    prefix = f"rt{size}:"
    backend = await _open(_url(redis_server, f"chunk_size=1KiB&prefix={prefix}"))
    try:
        value = os.urandom(size)
        await backend.put([("k", value)])
        (got,) = await backend.get(["k"])
        assert got is not None and b"".join(got) == value
        # one key per value: a string up to chunk_size, above it a hash of manifest + ceil(size / 1KiB) chunks
        assert await raw.keys(f"{prefix}*") == [main_key(prefix, "k").encode()]
        head = main_key(prefix, "k")
        if size <= 1024:
            assert await raw.type(head) == b"string"
        else:
            assert await raw.type(head) == b"hash" and await raw.hlen(head) == 1 + -(-size // 1024)
        assert await backend.exists(["k", "absent"]) == [True, False]
        assert await backend.delete(["k", "absent"]) == 1
        assert await raw.keys(f"{prefix}*") == []
    finally:
        await backend.close()


@pytest.mark.parametrize("chunk_size", ["64", "4KiB", "1MiB"])
async def test_tensor_round_trip_through_store(redis_server: RedisServer, chunk_size: str) -> None:
    backend = await _open(_url(redis_server, f"chunk_size={chunk_size}&prefix=ts{chunk_size}:"))
    store = TensorStore(backend)
    try:
        tensors = {f"t{i}": torch.randn(100 + i, 37) for i in range(3)}
        await store.put(tensors.items())
        got = await store.get(list(tensors))
        for (name, want), have in zip(tensors.items(), got, strict=True):
            assert have is not None and torch.equal(have, want), name
        out = torch.empty(101, 37)
        assert await store.get_into("t1", out) and torch.equal(out, tensors["t1"])
        assert store.stats.corrupt == 0 and store.stats.hits == 4
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("writer_chunk", "reader_chunk", "direct"),
    [("64KiB", "64KiB", True), ("1MiB", "1MiB", True), ("64KiB", "1MiB", False), ("1MiB", "64KiB", False)],
)
async def test_get_into_lands_chunks_in_the_destination(
    redis_server: RedisServer, writer_chunk: str, reader_chunk: str, direct: bool
) -> None:
    """Chunks land in the tensor's own memory; a value cut with another chunk size still reads (a copy)."""
    prefix = f"into-{writer_chunk}-{reader_chunk}:"
    writer = TensorStore(await _open(_url(redis_server, f"chunk_size={writer_chunk}&prefix={prefix}")))
    reader_backend = await _open(_url(redis_server, f"chunk_size={reader_chunk}&prefix={prefix}"))
    reader = TensorStore(reader_backend)
    copies = 0
    real_get = reader_backend.get

    async def counting_get(keys: list[str]) -> list[object]:
        nonlocal copies
        copies += 1
        return await real_get(keys)  # type: ignore[return-value]

    reader_backend.get = counting_get  # type: ignore[method-assign,assignment]
    try:
        value = torch.randn(3, 100_000)  # 1.2 MiB: chunked for both chunk sizes
        await writer.put([("k", value)])
        out = torch.full_like(value, float("nan"))
        for _ in range(2):
            assert await reader.read_into("k", out) is Fetch.HIT
            assert torch.equal(out, value)
        assert copies == (0 if direct else 2)
        assert reader.stats.hits == 2 and reader.stats.corrupt == 0
        assert reader_backend.held()["in_use"] == 0
    finally:
        await writer.delete(["k"])
        await writer.close()
        await reader.close()


@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_get_into_inline_absent_and_wrong_size(redis_server: RedisServer, fast_read: str) -> None:
    backend = await _open(
        _url(redis_server, f"chunk_size=4KiB&prefix=into-misc-{fast_read}:&fast_read={fast_read}")
    )
    store = TensorStore(backend)
    try:
        small, big = torch.arange(10, dtype=torch.float32), torch.randn(50, 100)
        await store.put([("small", small), ("big", big)])
        out = torch.empty_like(small)
        assert await store.read_into("small", out) is Fetch.HIT and torch.equal(out, small)
        assert await store.read_into("absent", out) is Fetch.MISS
        # a destination of another size is never written (the backend reports the stored length)
        for key, wrong in (("small", torch.zeros(11)), ("big", torch.zeros(50, 99))):
            assert await store.read_into(key, wrong) is Fetch.CORRUPT
            assert not wrong.any()
        out = torch.empty_like(big)
        assert await store.read_into("big", out) is Fetch.HIT and torch.equal(out, big)
        assert store.stats.corrupt == 2 and backend.held()["in_use"] == 0
    finally:
        await store.delete(["small", "big"])
        await store.close()


async def test_overwrite_probe_reads_both_paths(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    """The benchmark probe behind the docs' overwrite figures runs both read paths and cleans up."""
    from asyncconn_tools.bench.redis import probe_overwrites

    result = await probe_overwrites(
        _url(redis_server, "chunk_size=16KiB"), 64 << 10, phases=2, puts=3, gets=2
    )
    assert set(result) == {"direct", "copy"}
    assert all(len(side["p50_ms"]) == 2 and side["faults_per_get"] >= 0 for side in result.values())
    assert await raw.keys("*asyncconn-probe-*") == []


async def test_overwrites_leave_no_orphan_chunks(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    backend = await _open(_url(redis_server, "chunk_size=100&prefix=ow:"))
    head = main_key("ow:", "k")
    try:
        await backend.put([("k", os.urandom(1000))])
        await backend.put([("k", os.urandom(450))])
        assert await raw.keys("ow:*") == [head.encode()] and await raw.hlen(head) == 1 + 5
        await backend.put([("k", b"small")])
        assert await raw.keys("ow:*") == [head.encode()] and await raw.type(head) == b"string"
        (got,) = await backend.get(["k"])
        assert got is not None and b"".join(got) == b"small"
        # one batch: inline values replacing chunked ones, and a chunked one replacing an inline one
        await backend.put([("a", os.urandom(300)), ("b", os.urandom(300))])
        assert len(await raw.keys("ow:*")) == 3
        await backend.put([("a", b"1"), ("b", b"2"), ("k", os.urandom(250)), ("a", b"3")])
        assert len(await raw.keys("ow:*")) == 3 and await raw.hlen(head) == 1 + 3
        got_a, got_b = await backend.get(["a", "b"])
        assert got_a is not None and got_b is not None
        assert b"".join(got_a) == b"3" and b"".join(got_b) == b"2"  # one pipeline: in order
    finally:
        await backend.close()


async def test_ttl_applies_to_manifest_and_chunks(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    backend = await _open(_url(redis_server, "chunk_size=100&prefix=ttl:&ttl=30s"))
    try:
        await backend.put([("k", os.urandom(350)), ("small", b"x")])
        keys = await raw.keys("ttl:*")
        assert len(keys) == 2 and await raw.hlen(main_key("ttl:", "k")) == 1 + 4
        for key in keys:
            assert 0 < await raw.pttl(key) <= 30_000
    finally:
        await backend.close()


async def test_prefixes_isolate_stores(redis_server: RedisServer, raw: aioredis.Redis) -> None:
    a = await _open(_url(redis_server, "prefix=iso-a:"))
    b = await _open(_url(redis_server, "prefix=iso-b:"))
    try:
        await a.put([("k", b"from a")])
        assert await b.get(["k"]) == [None]
        await b.put([("k", b"from b")])
        assert [bytes(c) for c in (await a.get(["k"]))[0] or ()] == [b"from a"]
        assert sorted(await raw.keys("iso-*")) == [b"iso-a:{k}", b"iso-b:{k}"]
    finally:
        await a.close()
        await b.close()


async def test_database_selection(redis_server: RedisServer) -> None:
    one = await _open(_url(redis_server, "prefix=dbsel:&chunk_size=1KiB", db=1))
    two = await _open(f"redis://127.0.0.1:{redis_server.port}?db=2&prefix=dbsel:&chunk_size=1KiB")
    raw1 = aioredis.Redis(host="127.0.0.1", port=redis_server.port, db=1)
    try:
        await one.put([("k", b"in db 1"), ("big", os.urandom(3000))])  # inline, and chunked (raw writer)
        assert await two.get(["k", "big"]) == [None, None]
        assert await raw1.get("dbsel:{k}") == b"in db 1"
        assert await raw1.keys("dbsel:{big}*") == [b"dbsel:{big}"] and await raw1.hlen("dbsel:{big}") == 1 + 3
    finally:
        await one.delete(["k", "big"])
        await raw1.aclose()
        await one.close()
        await two.close()


# -- auth, sockets -----------------------------------------------------------------------------------
@pytest.fixture
def password_server() -> Iterator[RedisServer]:
    server = RedisServer(password="s3cret-Pa55").start()
    try:
        yield server
    finally:
        server.stop()


async def test_password_auth(password_server: RedisServer) -> None:
    backend = await _open(password_server.url + "?prefix=auth:&chunk_size=1KiB")
    try:
        await backend.put([("k", b"v"), ("big", os.urandom(3000))])  # the raw writer authenticates too
        assert await backend.exists(["k", "big"]) == [True, True]
    finally:
        await backend.close()


@pytest.mark.parametrize("userinfo", [":wrong-Pa55w0rd@", "default:wrong-Pa55w0rd@", ""])
async def test_wrong_or_missing_password_fails_clearly(password_server: RedisServer, userinfo: str) -> None:
    url = f"redis://{userinfo}127.0.0.1:{password_server.port}/0"
    with pytest.raises(BackendUnavailable, match=r"(?i)auth") as info:
        await open_backend(url)
    text = str(info.value)
    assert "wrong-Pa55w0rd" not in text and "s3cret" not in text


async def test_unix_socket() -> None:
    sock_dir = tempfile.mkdtemp(prefix="asyncconn-sock-")
    path = os.path.join(sock_dir, "redis.sock")
    server = RedisServer(extra_args=("--unixsocket", path, "--unixsocketperm", "700")).start()
    try:
        backend = await _open(f"unix://{path}?db=3&prefix=ux:&chunk_size=1KiB")
        try:
            await backend.put([("k", os.urandom(5000))])
            (got,) = await backend.get(["k"])
            assert got is not None and sum(map(len, got)) == 5000
        finally:
            await backend.close()
        raw3 = aioredis.Redis(host="127.0.0.1", port=server.port, db=3)
        assert await raw3.exists("ux:{k}") == 1
        await raw3.aclose()
    finally:
        server.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.parametrize(
    ("query", "named"),
    [
        ("chunk_size=lots", "chunk_size"),
        ("chunk_size=0", "chunk_size"),
        ("ttl=forever", "ttl"),
        ("max_connections=0", "max_connections"),
        ("timeout=-1", "timeout"),
        ("db=-2", "db"),
        ("nonsense=1", "nonsense"),
        ("tls_ca=/x.pem", "tls_ca"),
    ],
)
async def test_bad_url_parameters_are_named(redis_server: RedisServer, query: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        await open_backend(_url(redis_server, query))


async def test_bad_database_path_and_conflicts(redis_server: RedisServer) -> None:
    with pytest.raises(ConfigError, match="database"):
        await open_backend(f"redis://127.0.0.1:{redis_server.port}/zero")
    with pytest.raises(ConfigError, match="database"):
        await open_backend(f"redis://127.0.0.1:{redis_server.port}/1?db=2")
    with pytest.raises(ConfigError, match="socket path"):
        await open_backend("unix://")


async def test_nothing_listening_is_unavailable() -> None:
    from tests.servers import free_port

    with pytest.raises(BackendUnavailable) as info:
        await open_backend(f"redis://:pw-Secret9@127.0.0.1:{free_port()}/0?timeout=1")
    assert "pw-Secret9" not in str(info.value)


# -- TLS -----------------------------------------------------------------------------------------------
def _make_certs(root: Path) -> None:
    def ossl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=root, check=True, capture_output=True)

    ossl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=asyncconn-test-ca",
         "-keyout", "ca.key", "-out", "ca.pem")  # fmt: skip
    ossl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
         "-out", "server.csr")  # fmt: skip
    (root / "ext.cnf").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    ossl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-days", "1", "-extfile", "ext.cnf", "-out", "server.pem")  # fmt: skip


async def test_tls_round_trip() -> None:
    root = Path(tempfile.mkdtemp(prefix="asyncconn-tls-"))
    try:
        try:
            _make_certs(root)
        except (OSError, subprocess.CalledProcessError) as exc:
            pytest.fail(f"openssl could not make test certificates: {exc}")
        from tests.servers import free_port

        tls_port = free_port()
        tls_args = ["--tls-port", str(tls_port), "--tls-cert-file", str(root / "server.pem"),
                    "--tls-key-file", str(root / "server.key"), "--tls-ca-cert-file", str(root / "ca.pem"),
                    "--tls-auth-clients", "no"]  # fmt: skip
        server = RedisServer(extra_args=tuple(tls_args))
        try:
            server.start()
            wait_port(tls_port)
        except RuntimeError as exc:
            server.stop()
            pytest.fail(f"redis-server without TLS support: {exc}")
        try:
            base = f"rediss://localhost:{tls_port}/0?tls_ca={root / 'ca.pem'}&chunk_size=1KiB&prefix=tls:"
            backend = await _open(base)
            try:
                await backend.put([("k", os.urandom(3000))])
                (got,) = await backend.get(["k"])
                assert got is not None and sum(map(len, got)) == 3000
            finally:
                await backend.close()
            # a CA that did not sign the server certificate is refused
            with pytest.raises(BackendUnavailable):
                await open_backend(f"rediss://localhost:{tls_port}/0?timeout=2")
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)


# -- on the library's own loop (uvloop) -----------------------------------------------------------------
@pytest.mark.parametrize("fast_read", ["true", "false"])
def test_round_trip_on_the_runtime_loop(redis_server: RedisServer, runtime: Runtime, fast_read: str) -> None:
    """The backend as the library runs it: opened and used on the Runtime's (uvloop) thread."""
    url = _url(redis_server, f"chunk_size=64KiB&prefix=rt-loop-{fast_read}:&fast_read={fast_read}")
    tensors = [torch.randn(300, 1000), torch.randn(10)]

    async def scenario() -> tuple[list[torch.Tensor | None], dict[str, int]]:
        store = await TensorStore.open(url)
        try:
            await store.put([("big", tensors[0]), ("small", tensors[1])])
            got = await store.get(["big", "small", "absent"])
            await store.delete(["big", "small"])
            backend = store.backend
            assert isinstance(backend, RedisBackend)
            return got, backend.held()
        finally:
            await store.close()

    got, held = runtime.run(scenario(), timeout=30)
    assert got[0] is not None and torch.equal(got[0], tensors[0])
    assert got[1] is not None and torch.equal(got[1], tensors[1])
    assert got[2] is None and held["in_use"] == 0
    assert runtime.uses_uvloop


@pytest.mark.parametrize("fast_read", ["true", "false"])
async def test_writers_taking_turns_leave_one_key(
    redis_server: RedisServer, raw: aioredis.Redis, fast_read: str
) -> None:
    """Two writers replacing each other's chunked values leave one key holding the last value only."""
    query = f"chunk_size=100&prefix=turns-{fast_read}:&fast_read={fast_read}"
    one, two = await _open(_url(redis_server, query)), await _open(_url(redis_server, query))
    try:
        for _ in range(5):
            for backend in (one, two):
                last = os.urandom(1000)
                await backend.put([("k", last)])
        head = main_key(f"turns-{fast_read}:", "k")
        assert await raw.keys(f"turns-{fast_read}:*") == [head.encode()] and await raw.hlen(head) == 1 + 10
        (got,) = await one.get(["k"])
        assert got is not None and b"".join(got) == last
        assert await one.delete(["k"]) == 1 and await raw.keys(f"turns-{fast_read}:*") == []
        assert one.held()["in_use"] == 0
    finally:
        await one.close()
        await two.close()


async def test_chunked_write_over_a_large_foreign_value(
    redis_server: RedisServer, raw: aioredis.Redis
) -> None:
    """A big foreign value under the key is replaced whole; the raw connection is kept for the next write."""
    backend = await _open(_url(redis_server, "chunk_size=1KiB&prefix=big-old:"))
    try:
        await raw.set(main_key("big-old:", "k"), os.urandom(300_000))
        value = os.urandom(5000)
        for _ in range(2):
            await backend.put([("k", value)])
        assert backend._reader is not None  # one connection, kept: not torn down
        assert backend._reader.held() == {"connected": 1, "in_use": 0}
        (got,) = await backend.get(["k"])
        assert got is not None and b"".join(got) == value
    finally:
        await backend.close()


# -- the fast reader: replies received in place ------------------------------------------------------
class _Transport:
    def write(self, data: bytes) -> None:
        pass

    def abort(self) -> None:
        pass


def _feed(proto: object, data: bytes, step: int) -> None:
    """Hand ``data`` to a buffered protocol ``step`` bytes at a time, as the event loop would."""
    pos = 0
    while pos < len(data):
        buf = proto.get_buffer(step)  # type: ignore[attr-defined]
        n = min(step, len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        proto.buffer_updated(n)  # type: ignore[attr-defined]
        pos += n


def _feed_many(proto: object, data: bytes, step: int) -> None:
    """Hand ``data`` over as :class:`SocketTransport` does: at most ``step`` bytes per ``recvmsg_into``,
    spread over the buffers the protocol names, filled in order."""
    pos = 0
    while pos < len(data):
        got = 0
        for buf in proto.get_buffers(4):  # type: ignore[attr-defined]
            n = min(step - got, len(buf), len(data) - pos)
            buf[:n] = data[pos : pos + n]
            pos, got = pos + n, got + n
            if n < len(buf):
                break
        proto.buffers_updated(got)  # type: ignore[attr-defined]


@pytest.mark.parametrize("feed", [_feed, _feed_many])
@pytest.mark.parametrize("step", [1, 7, 4096, 1 << 20])
async def test_a_bulk_reply_lands_across_a_scattered_slot(step: int, feed: Callable[..., None]) -> None:
    """One reply fills several views in order (a frame's header, an empty view, its payload), however the
    bytes arrive, one buffer at a time or several per receive; a reply of another length gets its own
    buffer and leaves the slot untouched."""
    from asyncconn_backends.redis.reader import _RespProtocol

    header, payload = os.urandom(40), os.urandom(100_000)
    other = os.urandom(77)
    dests = (memoryview(bytearray(40)), memoryview(bytearray(0)), memoryview(bytearray(100_000)))
    untouched = (memoryview(bytearray(40)), memoryview(bytearray(100_037)))
    proto = _RespProtocol()
    proto.connection_made(_Transport())  # type: ignore[arg-type]
    fut = proto.request(b"MGET a b c\r\n", 1, 1 << 20, [dests, untouched])
    value = header + payload
    reply = b"*3\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$-1\r\n" % (len(value), value, len(other), other)
    feed(proto, reply, step)
    got = await fut
    assert got[0] is dests
    assert bytes(dests[0]) == header and bytes(dests[2]) == payload
    assert isinstance(got[1], bytearray) and bytes(got[1]) == other
    assert not any(bytes(v).strip(b"\0") for v in untouched)
    assert got[2] is None


async def test_an_inline_value_is_read_in_one_get_straight_into_the_tensor(redis_server: RedisServer) -> None:
    """A value stored inline (below ``chunk_size``) lands in the destination without the manifest probe
    (``_heads``: redis-py and a copy); an absent key and a chunked one still take it."""
    backend = await _open(_url(redis_server, "chunk_size=256KiB&prefix=inline-fast:"))
    store = TensorStore(backend)
    probes = 0
    real_heads = backend._heads

    async def counting_heads(names: list[str]) -> list[object]:
        nonlocal probes
        probes += 1
        return await real_heads(names)  # type: ignore[return-value]

    backend._heads = counting_heads  # type: ignore[method-assign,assignment]
    try:
        values = {f"v{n}": torch.randn(n) for n in (1, 1000, 16_000, 65_000)}  # up to ~254 KiB: inline
        await store.put(list(values.items()))
        for key, value in values.items():
            out = torch.full_like(value, float("nan"))
            assert await store.read_into(key, out) is Fetch.HIT and torch.equal(out, value)
        assert probes == 0
        assert await store.read_into("absent", torch.empty(10)) is Fetch.MISS
        assert probes == 1
        big = torch.randn(100_000)  # chunked
        await store.put([("big", big)])
        out = torch.empty_like(big)
        assert await store.read_into("big", out) is Fetch.HIT and torch.equal(out, big)
        assert probes == 2 and backend.held()["in_use"] == 0 and store.stats.corrupt == 0
    finally:
        await store.delete([*values, "big"])
        await store.close()


async def test_an_inline_value_cut_smaller_by_its_writer_still_reads(redis_server: RedisServer) -> None:
    """A reader whose ``chunk_size`` would store the value inline finds a chunked one (another writer's
    setting): the fast GET sees no string, the manifest path reads it."""
    writer = TensorStore(await _open(_url(redis_server, "chunk_size=8KiB&prefix=inline-cut:")))
    reader = TensorStore(await _open(_url(redis_server, "chunk_size=1MiB&prefix=inline-cut:")))
    try:
        value = torch.randn(20_000)
        await writer.put([("k", value)])
        out = torch.empty_like(value)
        assert await reader.read_into("k", out) is Fetch.HIT and torch.equal(out, value)
    finally:
        await writer.delete(["k"])
        await writer.close()
        await reader.close()
