"""The direct transport: the client asks the storage backend itself (memory fake and a real redis-server)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from asyncconn.lookup import EXISTS, PREFIX, DirectTransport, LookupConfig, open_lookup_client, store_key
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.lookup.fakes import wait_until
from tests.servers import RedisServer

HASHES = [bytes([i]) * 32 for i in range(6)]


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-direct-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


def seed(rt: Runtime, url: str, keys: list[str]) -> None:
    async def go() -> None:
        store = await TensorStore.open(url)
        await store.backend.put([(k, b"v") for k in keys])
        await store.close()

    rt.run(go())


def test_memory_backend_prefix_and_exists(rt: Runtime) -> None:
    name = f"memory://direct-{uuid.uuid4().hex}"
    seed(rt, name, [store_key("p:", h) for h in HASHES[:3]] + ["p:img-1"])
    cfg = LookupConfig(backend_url=f"{name}?latency=2ms", key_prefix="p:")
    kv = open_lookup_client(cfg, PREFIX, runtime=rt)
    ec = open_lookup_client(cfg, EXISTS, runtime=rt)
    try:
        for i in range(50):
            kv.submit(f"r{i}", HASHES[: i % 6])
        assert kv.lookup_sync("s", HASHES) == 3
        wait_until(lambda: kv.metrics.completed == 51)
        assert [kv.poll(f"r{i}") for i in range(6)] == [0, 1, 2, 3, 3, 3]
        assert ec.lookup_sync("e", ["img-1", "img-2"]) == (True, False)
    finally:
        kv.close()
        ec.close()
    assert kv.held()["transport"] == 0


def test_store_failure_is_an_error_miss(rt: Runtime) -> None:
    async def closed_store() -> TensorStore:
        store = await TensorStore.open("memory://")
        await store.close()  # every call now raises BackendUnavailable
        return store

    from asyncconn.lookup import LookupClient

    client = LookupClient(DirectTransport(rt.run(closed_store())), PREFIX, runtime=rt, timeout=2.0)
    try:
        assert client.lookup_sync("r", HASHES) == 0
        assert client.metrics.errors == 1 and client.metrics.timeouts == 0
    finally:
        client.close()


def test_batches_are_split(rt: Runtime) -> None:
    from asyncconn.lookup import LookupClient

    name = f"memory://split-{uuid.uuid4().hex}"
    seed(rt, name, [store_key("", h) for h in HASHES])
    transport = DirectTransport(name, max_batch_keys=10)
    client = LookupClient(transport, PREFIX, runtime=rt)
    try:
        for i in range(40):
            client.submit(f"r{i}", HASHES)
        wait_until(lambda: client.metrics.completed == 40)
        assert {client.poll(f"r{i}") for i in range(40)} == {6}
    finally:
        client.close()


@pytest.mark.redis
def test_real_redis_pipelined_exists(rt: Runtime, redis_server: RedisServer) -> None:
    prefix = f"lk-{uuid.uuid4().hex[:8]}:"
    seed(rt, redis_server.url, [store_key(prefix, h) for h in HASHES[:4]] + [prefix + "mm-x"])
    cfg = LookupConfig(backend_url=redis_server.url, key_prefix=prefix, lookup_timeout=5.0)
    kv = open_lookup_client(cfg, PREFIX, runtime=rt)
    ec = open_lookup_client(cfg, EXISTS, runtime=rt)
    try:
        for i in range(300):
            kv.submit(f"r{i}", HASHES[: i % 7])
        wait_until(lambda: kv.metrics.completed == 300)
        assert all(kv.poll(f"r{i}") == min(i % 7, 4) for i in range(300))
        assert ec.lookup_sync("e", ["mm-x", "mm-y"]) == (True, False)
        assert kv.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    finally:
        kv.close()
        ec.close()


@pytest.mark.redis
def test_paused_redis_times_out_to_misses_then_recovers(rt: Runtime, fresh_redis: RedisServer) -> None:
    seed(rt, fresh_redis.url, [store_key("", h) for h in HASHES[:2]])
    kv = open_lookup_client(LookupConfig(backend_url=fresh_redis.url, lookup_timeout=0.5), PREFIX, runtime=rt)
    try:
        assert kv.lookup_sync("warm", HASHES) == 2
        fresh_redis.pause()
        try:
            kv.submit("r", HASHES)
            assert kv.poll("r") is None  # the scheduler is answered at once, the store is frozen
            wait_until(lambda: kv.metrics.timeouts == 1)
            assert kv.poll("r") == 0
        finally:
            fresh_redis.resume()
        wait_until(lambda: kv.lookup_sync(f"again-{uuid.uuid4().hex}", HASHES) == 2)
        wait_until(lambda: kv.held()["transport"] == 0)
    finally:
        kv.close()
