"""The backend contract, one suite parametrized over every backend (aiocache style).

redis runs against a real redis-server started by the session fixture on a free loopback port;
redis+cluster against a real 3-master Redis Cluster, mooncake against a real mooncake_master (both session
fixtures in conftest.py, on loopback ports).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
import torch

from asyncconn import codec
from asyncconn.backend import NOT_CACHED, StorageBackend, open_backend
from asyncconn.exceptions import BackendError, InvalidInput
from asyncconn.scattered import Scattered
from asyncconn.store import Fetch, TensorStore
from tests.servers import RedisServer
from tests.servers_distributed import MooncakeMaster, RedisCluster, mooncake_contract_url

BACKENDS = [
    "memory",
    "file",
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis+cluster", marks=pytest.mark.redis),
    pytest.param("mooncake", marks=pytest.mark.mooncake),
]


@pytest.fixture(params=BACKENDS)
def backend_url(request: pytest.FixtureRequest, tmp_path: object) -> str:
    kind = request.param
    if kind == "memory":
        return f"memory://contract-{uuid.uuid4().hex}"
    if kind == "file":
        return f"file://{tmp_path}/store"
    if kind == "redis+cluster":
        cluster: RedisCluster = request.getfixturevalue("redis_cluster")
        return f"{cluster.url}/?prefix=contract-{uuid.uuid4().hex[:8]}:&chunk_size=1MiB"
    if kind == "mooncake":
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        return mooncake_contract_url(master)
    server: RedisServer = request.getfixturevalue("redis_server")
    return f"redis://127.0.0.1:{server.port}/0?prefix=contract-{uuid.uuid4().hex[:8]}:&chunk_size=1MiB"


@pytest.fixture
async def backend(backend_url: str) -> AsyncIterator[StorageBackend]:
    b = await open_backend(backend_url)
    try:
        yield b
    finally:
        await b.close()


def _val(n: int, seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _join(chunks: object) -> bytes:
    assert chunks is not None
    return b"".join(bytes(c) for c in chunks)  # type: ignore[attr-defined]


async def test_put_get_exists_delete(backend: StorageBackend) -> None:
    await backend.put([("a", b"alpha"), ("b", _val(1000))])
    got = await backend.get(["a", "missing", "b"])
    assert _join(got[0]) == b"alpha" and got[1] is None and _join(got[2]) == _val(1000)
    assert await backend.exists(["b", "missing", "a"]) == [True, False, True]
    assert await backend.delete(["a", "missing"]) == 1
    assert await backend.exists(["a", "b"]) == [False, True]
    assert await backend.get(["a"]) == [None]


async def test_empty_batches(backend: StorageBackend) -> None:
    await backend.put([])
    assert await backend.get([]) == []
    assert await backend.exists([]) == []
    assert await backend.delete([]) == 0


async def test_overwrite_replaces_whole_value(backend: StorageBackend) -> None:
    await backend.put([("k", _val(3 << 20, 1))])
    await backend.put([("k", b"short")])
    assert _join((await backend.get(["k"]))[0]) == b"short"
    await backend.put([("k", _val(3 << 20, 2))])
    assert _join((await backend.get(["k"]))[0]) == _val(3 << 20, 2)


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 5 << 20])
async def test_sizes_including_chunk_boundaries(backend: StorageBackend, size: int) -> None:
    value = _val(size, size)
    await backend.put([("sized", value)])
    assert _join((await backend.get(["sized"]))[0]) == value


async def test_value_given_as_parts_is_stored_whole(backend: StorageBackend) -> None:
    parts = [b"head", memoryview(_val(2 << 20, 3)), bytearray(b"tail")]
    await backend.put([("parts", parts)])
    assert _join((await backend.get(["parts"]))[0]) == b"head" + _val(2 << 20, 3) + b"tail"


@pytest.mark.parametrize(
    "key",
    ["with space", "sla/sh", "../../etc/passwd", "ünïcödé", "{brace}:colon", ".", "x" * 600, "nul\x00byte"],
)
async def test_awkward_keys(backend: StorageBackend, key: str) -> None:
    await backend.put([(key, b"v")])
    assert await backend.exists([key]) == [True]
    assert _join((await backend.get([key]))[0]) == b"v"
    assert await backend.delete([key]) == 1


async def test_get_into_fills_buffers_or_reports_length(backend: StorageBackend) -> None:
    value = _val(3 << 20, 9)
    await backend.put([("gi", value)])
    head, body = bytearray(100), bytearray(len(value) - 100)
    seen: list[bytes] = []
    n = await backend.get_into("gi", [memoryview(head), memoryview(body)], lambda v: seen.append(bytes(v)))
    assert n == len(value) and bytes(head) + bytes(body) == value and b"".join(seen) == value
    small = bytearray(10)
    assert await backend.get_into("gi", [memoryview(small)]) == len(value)
    assert bytes(small) == b"\0" * 10  # untouched on a size mismatch
    assert await backend.get_into("absent", [memoryview(small)]) is None


async def test_get_into_many_is_get_into_per_value_in_order(backend: StorageBackend) -> None:
    values = {"m0": _val(3 << 20, 1), "m1": _val(1000, 2), "m2": _val(1 << 20, 3)}
    await backend.put(list(values.items()))
    bufs = {k: bytearray(len(v)) for k, v in values.items()}
    seen: dict[str, list[bytes]] = {k: [] for k in values}
    small = bytearray(10)
    reads = [
        (k, [memoryview(bufs[k])], lambda v, k=k: seen[k].append(bytes(v)))  # type: ignore[misc]
        for k in values
    ]
    reads.insert(1, ("absent", [memoryview(bytearray(4))], None))
    reads.append(("m1", [memoryview(small)], None))  # size mismatch: the length, nothing written
    got = await backend.get_into_many(reads)
    assert got == [len(values["m0"]), None, len(values["m1"]), len(values["m2"]), len(values["m1"])]
    for key, value in values.items():
        assert bytes(bufs[key]) == value and b"".join(seen[key]) == value, key
    assert bytes(small) == b"\0" * 10
    assert await backend.get_into_many([]) == []


async def test_read_into_many_tells_each_value_apart(backend: StorageBackend) -> None:
    """One bad value in a batch is CORRUPT for itself only; hits land byte for byte, misses are misses."""
    store = TensorStore(backend, timeout=10)
    good = {f"g{i}": torch.randn(64, 1024) for i in range(5)}
    await store.put(good.items())
    await backend.put([("bad", b"ACNF" + b"\x01" * 60)])
    outs = {k: torch.empty(64, 1024) for k in [*good, "bad", "none"]}
    outs["short"] = torch.empty(64, 512)  # g0's frame has twice these bytes
    keys = ["g0", "bad", "g1", "none", "g2", "g3", "g4"]
    got = await store.read_into_many([(k, outs[k]) for k in keys] + [("g0", outs["short"])])
    assert got == [
        Fetch.HIT,
        Fetch.CORRUPT,
        Fetch.HIT,
        Fetch.MISS,
        Fetch.HIT,
        Fetch.HIT,
        Fetch.HIT,
        Fetch.CORRUPT,
    ]
    for key, value in good.items():
        assert torch.equal(outs[key], value), key
    assert store.stats.hits == 5 and store.stats.misses == 3 and store.stats.corrupt == 2
    assert await store.read_into_many([]) == []


async def test_cached_only_reads_serve_memory_or_say_not_cached(backend: StorageBackend) -> None:
    """``cached_only``: a backend that can tell (``cached_reads``: file://, its page cache) serves a value it
    just wrote; one that cannot reports NOT_CACHED for every value and writes nothing. A miss is a miss."""
    value = _val(1 << 20, 5)
    await backend.put([("c0", value)])
    buf = bytearray(len(value))
    got = await backend.get_into_many(
        [("c0", [memoryview(buf)], None), ("absent", [memoryview(bytearray(8))], None)], cached_only=True
    )
    if type(backend).cached_reads:
        assert got == [len(value), None] and bytes(buf) == value
    else:
        assert got == [NOT_CACHED, NOT_CACHED] and bytes(buf) == b"\0" * len(value)


async def test_read_into_many_scattered_lands_in_pieces(backend: StorageBackend) -> None:
    """A Scattered destination receives the value's bytes across its pieces in order; a bad or short value is
    CORRUPT, a missing one a MISS (reads one by one where the backend does not batch)."""
    store = TensorStore(backend, timeout=10)
    value = torch.randn(4, 2, 1024)
    await store.put([("s0", value), ("s1", torch.randn(4, 2, 512))])
    await backend.put([("bad", b"ACNF" + b"\x02" * 60)])
    rows = [torch.empty(2, 1024) for _ in range(4)]
    if not type(backend).reads_into:  # memory:// hands out its own buffers: nothing to read pieces into
        with pytest.raises(InvalidInput):
            await store.read_into_many([("s0", _pieces(rows, value))])
        assert await store.read_into_many([("s0", _pieces(rows, value))], cached_only=True) == [
            Fetch.NOT_CACHED
        ]
        return
    got = await store.read_into_many(
        [
            ("s0", _pieces(rows, value)),
            ("s1", _pieces([torch.empty(2, 1024) for _ in range(4)], value)),
            ("bad", _pieces([torch.empty(2, 1024) for _ in range(4)], value)),
            ("none", _pieces([torch.empty(2, 1024) for _ in range(4)], value)),
        ]
    )
    assert got == [Fetch.HIT, Fetch.CORRUPT, Fetch.CORRUPT, Fetch.MISS]
    assert torch.equal(torch.stack(rows), value)
    cached = await store.read_into_many([("s0", _pieces(rows, value))], cached_only=True)
    assert cached == [Fetch.HIT if store.cached_reads else Fetch.NOT_CACHED]
    with pytest.raises(InvalidInput):
        Scattered(torch.float32, (4, 2, 1024), (codec.tensor_bytes(rows[0]),))  # too few bytes


def _pieces(rows: list[torch.Tensor], like: torch.Tensor) -> Scattered:
    return Scattered(like.dtype, tuple(like.shape), tuple(codec.tensor_bytes(r) for r in rows))


async def test_many_keys_in_one_batch(backend: StorageBackend) -> None:
    items = [(f"k{i}", f"v{i}".encode()) for i in range(300)]
    await backend.put(items)
    got = await backend.get([k for k, _ in items])
    assert [_join(g) for g in got] == [v for _, v in items]
    assert all(await backend.exists([k for k, _ in items]))
    assert await backend.delete([k for k, _ in items]) == 300


async def test_use_after_close_is_a_backend_error(backend_url: str) -> None:
    b = await open_backend(backend_url)
    await b.close()
    await b.close()  # idempotent
    with pytest.raises(BackendError):
        await b.get(["x"])


async def test_concurrent_writers_never_leave_a_torn_value(backend: StorageBackend) -> None:
    values = [_val(2 << 20, seed) for seed in range(4)]  # chunked on redis (1 MiB chunks)
    seen: list[bytes] = []

    async def writer(v: bytes) -> None:
        for _ in range(5):
            await backend.put([("contested", v)])

    async def reader() -> None:
        for _ in range(15):
            (got,) = await backend.get(["contested"])
            if got is not None:
                seen.append(_join(got))
            await asyncio.sleep(0)

    await asyncio.gather(*(writer(v) for v in values), reader(), reader())
    final = _join((await backend.get(["contested"]))[0])
    assert final in values
    assert all(s in values for s in seen)


async def test_tensor_store_roundtrip_and_bad_values_are_misses(backend: StorageBackend) -> None:
    store = TensorStore(backend, timeout=10)
    tensors = {
        "t1": torch.randn(3, 4),
        "t2": torch.arange(10, dtype=torch.int64),
        "big": torch.randn(700_000).to(torch.bfloat16),
    }
    await store.put(tensors.items())
    got = await store.get([*list(tensors), "nothing"])
    for (name, t), g in zip(tensors.items(), got, strict=False):
        assert g is not None and g.dtype == t.dtype and torch.equal(g, t), name
    assert got[-1] is None
    out = torch.empty(700_000, dtype=torch.bfloat16)
    assert await store.get_into("big", out) and torch.equal(out, tensors["big"])
    # A value written by another tool under our key, and a corrupted frame: misses, never a tensor.
    await backend.put([("foreign", b"written by someone else"), ("t1", b"ACNF" + b"\x01" * 60)])
    assert await store.get(["foreign", "t1"]) == [None, None]
    assert not await store.get_into("t1", torch.empty(3, 4))
    assert store.stats.corrupt == 3
    # Wrong destination shape/dtype: a miss (counted), the destination is never handed on.
    assert not await store.get_into("t2", torch.empty(10, dtype=torch.float32))


async def test_a_value_copied_to_another_key_is_a_miss_there(backend: StorageBackend) -> None:
    """Frames are bound to their key: a stored value copied or renamed under another key is never served."""
    store = TensorStore(backend, timeout=10)
    a, b = torch.randn(4, 8), torch.randn(4, 8)
    await store.put([("img-a", a), ("img-b", b)])
    (raw_a,) = await backend.get(["img-a"])
    assert raw_a is not None
    await backend.put([("img-b", b"".join(bytes(c) for c in raw_a))])  # a's bytes, same shape, under b
    got = await store.get(["img-a", "img-b"])
    assert got[0] is not None and torch.equal(got[0], a) and got[1] is None
    out = torch.empty(4, 8)
    assert not await store.get_into("img-b", out)
    assert store.stats.corrupt >= 2


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 4096), (3, 0, 5)])
async def test_empty_tensors_on_every_read_path(backend: StorageBackend, shape: tuple[int, ...]) -> None:
    """Zero-element tensors round-trip through get, the direct read and the copying read alike."""
    store = TensorStore(backend, timeout=10)
    tensor = torch.empty(shape, dtype=torch.float16)
    await store.put([("empty", tensor)])
    (got,) = await store.get(["empty"])
    assert got is not None and got.shape == tensor.shape and got.dtype == tensor.dtype
    assert await store.read_into("empty", torch.empty(shape, dtype=torch.float16)) is Fetch.HIT
    # The copying read every backend inherits (the one a backend without direct reads takes).
    header = bytearray(codec.header_size(len(shape)))
    dests = [memoryview(header), memoryview(bytearray())]
    assert await StorageBackend.get_into(backend, "empty", dests) == len(header)
    # A zero-byte value read into no destination at all, directly and through the base path.
    await backend.put([("zero", b"")])
    assert await backend.get_into("zero", []) == 0
    assert await StorageBackend.get_into(backend, "zero", []) == 0
    assert await store.read_into("absent", torch.empty(shape)) is Fetch.MISS


_STORE_MISUSE = {
    "put a non-tensor": lambda s: s.put([("k", [1.0, 2.0])]),
    "put a sparse tensor": lambda s: s.put([("k", torch.eye(3).to_sparse())]),
    "put a meta tensor": lambda s: s.put([("k", torch.empty(3, device="meta"))]),
    "put a complex tensor": lambda s: s.put([("k", torch.zeros(2, dtype=torch.complex64))]),
    "put under an int key": lambda s: s.put([(3, torch.ones(2))]),
    "put under an empty key": lambda s: s.put([("", torch.ones(2))]),
    "get an int key": lambda s: s.get([3]),
    "get bytes keys": lambda s: s.get([b"k"]),
    "get a str as the key list": lambda s: s.get("k"),
    "exists an int key": lambda s: s.exists([None]),
    "delete an int key": lambda s: s.delete([1.5]),
    "read into a meta tensor": lambda s: s.get_into("k", torch.empty(3, device="meta")),
    "read into a sparse tensor": lambda s: s.get_into("k", torch.eye(3).to_sparse()),
    "read into a bytearray": lambda s: s.get_into("k", bytearray(12)),
    "read an int key": lambda s: s.get_into(7, torch.empty(3)),
}
_BACKEND_MISUSE = {
    "put an int value": lambda b: b.put([("k", 5)]),
    "put a str value": lambda b: b.put([("k", "text")]),
    "put a part that is not bytes": lambda b: b.put([("k", [b"head", 7])]),
    "put a non-pair": lambda b: b.put([("k", b"v", b"extra")]),
    "put under an int key": lambda b: b.put([(3, b"v")]),
    "get an int key": lambda b: b.get(["ok", 3]),
    "exists bytes keys": lambda b: b.exists([b"k"]),
    "delete an int key": lambda b: b.delete([3]),
    "get_into an int key": lambda b: b.get_into(3, [memoryview(bytearray(4))]),
    "get_into a read-only destination": lambda b: b.get_into("k", [memoryview(b"1234")]),
    "get_into a bytearray destination": lambda b: b.get_into("k", [bytearray(4)]),
}


@pytest.mark.parametrize("misuse", list(_STORE_MISUSE))
async def test_invalid_store_input_is_invalid_input(backend: StorageBackend, misuse: str) -> None:
    store = TensorStore(backend, timeout=10)
    await store.put([("k", torch.ones(3))])
    with pytest.raises(InvalidInput):
        await _STORE_MISUSE[misuse](store)
    (still,) = await store.get(["k"])  # nothing was written or broken by the refused call
    assert still is not None and torch.equal(still, torch.ones(3))


@pytest.mark.parametrize("misuse", list(_BACKEND_MISUSE))
async def test_invalid_backend_input_is_invalid_input(backend: StorageBackend, misuse: str) -> None:
    await backend.put([("k", b"1234")])
    with pytest.raises(InvalidInput):
        await _BACKEND_MISUSE[misuse](backend)
    assert _join((await backend.get(["k"]))[0]) == b"1234"
