"""``redis+cluster://`` on a real 3-master Redis Cluster (loopback ports, started by the fixtures).

The contract suite (tests/backends/test_contract.py) runs on it too; these tests
cover what only a cluster has:
one value's keys on one slot, batches spread over the nodes, and a node killed in the middle of a batch.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import torch
from asyncconn_backends.redis.cluster import RedisClusterBackend
from asyncconn_backends.redis.layout import Manifest, chunk_fields, main_key
from redis.crc import key_slot

from asyncconn.backend import open_backend
from asyncconn.exceptions import BackendError, BackendTimeout, BackendUnavailable, ConfigError
from asyncconn.store import TensorStore
from tests.servers_distributed import RedisCluster, free_cluster_port


def _prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"


@pytest.fixture
async def cluster_backend(redis_cluster: RedisCluster) -> AsyncIterator[RedisClusterBackend]:
    backend = await open_backend(f"{redis_cluster.url}?prefix={_prefix()}&chunk_size=64KiB&timeout=5s")
    assert isinstance(backend, RedisClusterBackend)
    try:
        yield backend
    finally:
        await backend.close()


@pytest.fixture
def private_cluster() -> Iterator[RedisCluster]:
    """A cluster of our own, for tests that kill a node (noticed within a second)."""
    cluster = RedisCluster(node_timeout_ms=1000).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _node_keys(cluster: RedisCluster, pattern: str) -> dict[int, list[bytes]]:
    """Keys matching ``pattern`` on each master, by port (read with plain per-node clients)."""
    found: dict[int, list[bytes]] = {}
    for port in cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port) as r:
            found[port] = list(r.scan_iter(match=pattern, count=1000))
    return found


async def test_one_values_keys_share_a_slot_and_a_node(
    redis_cluster: RedisCluster, cluster_backend: RedisClusterBackend
) -> None:
    values = {f"v{i}": bytes([i]) * (300 << 10) for i in range(12)}  # 5 chunks of 64 KiB each
    await cluster_backend.put(list(values.items()))
    placed = _node_keys(redis_cluster, f"{cluster_backend.prefix}*")
    for key in values:
        head = main_key(cluster_backend.prefix, key).encode()
        homes = {port for port, names in placed.items() for name in names if name.startswith(head)}
        names = [name for names in placed.values() for name in names if name.startswith(head)]
        assert len(homes) == 1, key  # one key per value: manifest and chunks are fields of one hash
        assert names == [head], names
    # And the batch as a whole was split over the nodes: with 12 keys every master holds some.
    assert all(placed[port] for port in redis_cluster.ports)
    got = await cluster_backend.get(list(values))
    assert [b"".join(bytes(c) for c in g or ()) for g in got] == list(values.values())


async def test_batches_spanning_every_node(cluster_backend: RedisClusterBackend) -> None:
    items = [(f"k{i}", f"v{i}".encode() * (i % 7 + 1)) for i in range(200)]
    await cluster_backend.put(items)
    assert await cluster_backend.exists([k for k, _ in items] + ["nope"]) == [True] * 200 + [False]
    got = await cluster_backend.get([k for k, _ in items])
    assert [bytes(g[0]) if g else None for g in got] == [v for _, v in items]
    assert await cluster_backend.delete([k for k, _ in items[:100]] + ["nope"]) == 100
    assert await cluster_backend.exists([k for k, _ in items[98:102]]) == [False, False, True, True]
    assert cluster_backend.held()["in_use"] == 0


async def test_tensor_store_on_the_cluster(cluster_backend: RedisClusterBackend) -> None:
    store = TensorStore(cluster_backend, timeout=10)
    tensors = {f"t{i}": torch.randn(50_000 + i) for i in range(6)}
    await store.put(tensors.items())
    got = await store.get(list(tensors))
    assert all(g is not None and torch.equal(g, t) for g, t in zip(got, tensors.values(), strict=True))
    out = torch.empty(50_003)
    assert await store.get_into("t3", out) and torch.equal(out, tensors["t3"])


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis+cluster://", "names no node"),
        ("redis+cluster://127.0.0.1:7000/3", "database 0"),
        ("redis+cluster://127.0.0.1:7000?tls_ca=/ca.pem", "unknown parameter 'tls_ca'"),
        ("redis+cluster://127.0.0.1:7000?retries=0", "'retries'"),
    ],
)
async def test_bad_urls_name_the_problem(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        await open_backend(url)


async def test_no_reachable_node_fails_at_open() -> None:
    port = free_cluster_port(set())
    with pytest.raises(BackendUnavailable, match="connect"):
        await open_backend(f"redis+cluster://127.0.0.1:{port}?timeout=2s")


async def test_node_killed_mid_batch_then_restarted(private_cluster: RedisCluster) -> None:
    backend = await open_backend(f"{private_cluster.url}?chunk_size=64KiB&timeout=1500ms")
    assert isinstance(backend, RedisClusterBackend)
    store = TensorStore(backend, timeout=3)
    try:
        tensors = {f"x{i}": torch.full((40_000,), float(i)) for i in range(24)}  # chunked (160 KB each)
        await store.put(tensors.items())
        victim = private_cluster.owner_of(main_key("", "x0"))
        on_victim = {k for k in tensors if private_cluster.owner_of(main_key("", k)) is victim}
        assert on_victim and len(on_victim) < len(tensors)

        async def reader() -> list[BaseException | None]:
            outcomes: list[BaseException | None] = []
            while sum(o is not None for o in outcomes) < 3 and len(outcomes) < 500:
                try:
                    got = await backend.get(list(tensors))
                    assert all(g is not None for g in got)  # before the kill: everything is there
                    outcomes.append(None)
                except BackendError as exc:
                    outcomes.append(exc)
                await asyncio.sleep(0.005)
            return outcomes

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.02)
        await asyncio.to_thread(private_cluster.kill, victim)
        outcomes = await asyncio.wait_for(task, 120)  # a hang guard, not a timing assertion
        failures = [o for o in outcomes if o is not None]
        assert failures, "no call noticed the dead node"
        assert all(isinstance(f, (BackendUnavailable, BackendTimeout)) for f in failures)
        # Through TensorStore the batch fails with one of our errors, counted (callers treat it as misses).
        with pytest.raises((BackendUnavailable, BackendTimeout)):
            await store.get(sorted(on_victim))
        assert store.stats.errors + store.stats.timeouts >= 1

        await asyncio.to_thread(private_cluster.restart, victim)
        # The client re-reads the slot map after failures: calls are served again. The restarted node
        # kept its slots (nodes.conf) but not its data (no persistence): its values are misses.
        for _ in range(100):
            try:
                after = await store.get(list(tensors))
                break
            except BackendError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("the cluster never served calls again after the node came back")
        for (key, tensor), value in zip(tensors.items(), after, strict=True):
            if key in on_victim:
                assert value is None, key
            else:
                assert value is not None and torch.equal(value, tensor), key
        await store.put([("x0", tensors["x0"])])
        (again,) = await store.get(["x0"])
        assert again is not None and torch.equal(again, tensors["x0"])
        assert backend.held()["in_use"] == 0
    finally:
        await backend.close()
    assert backend.held() == {"connected": 0, "in_use": 0}


async def test_a_stale_slot_map_is_followed_by_writes_and_direct_reads(
    redis_cluster: RedisCluster, cluster_backend: RedisClusterBackend
) -> None:
    """Point the client's slot map for one value at the wrong node (as after a slot migration).

    The MULTI/EXEC of a chunked put meets ``MOVED`` and is re-sent to the right node; a raw chunk read meets
    ``MOVED`` and is redone through redis-py, which follows the redirection. Both return the value.
    """
    value = bytes(range(256)) * 1024  # 256 KiB: chunked at 64 KiB
    client = cluster_backend._cluster
    await client.initialize()
    head = main_key(cluster_backend.prefix, "moved")
    slot = key_slot(head.encode())
    manager = client.nodes_manager
    right = manager.slots_cache[slot][0]
    wrong = next(n for n in client.get_primaries() if n.name != right.name)
    manager.slots_cache[slot] = [wrong]
    await cluster_backend.put([("moved", value)])
    assert client.nodes_manager.slots_cache[slot][0].name == right.name  # re-read after MOVED

    # The raw per-node reader asked with a stale map: the node answers MOVED, the read goes through redis-py.
    reader = cluster_backend._reader
    assert reader is not None
    (parsed,) = await cluster_backend._heads([head])
    assert isinstance(parsed, Manifest) and parsed.count == 4
    manager.slots_cache[slot] = [wrong]
    chunks = await reader.hmget(head, chunk_fields(parsed), len(value))
    assert b"".join(bytes(c or b"") for c in chunks) == value
    # And through the backend's own read paths, with the map stale again.
    manager.slots_cache[slot] = [wrong]
    dest = bytearray(len(value))
    assert await cluster_backend.get_into("moved", [memoryview(dest)]) == len(value)
    assert dest == value
    assert cluster_backend.held()["in_use"] == 0
