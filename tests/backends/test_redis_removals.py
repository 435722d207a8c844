"""``redis://?removals=``: a real redis-server's own expiry and eviction reach ``on_removed`` through keyspace
notifications -- and nothing does with the listener off; it comes back after a restart; close frees it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Sequence

import pytest
import redis.asyncio as aioredis
from asyncconn_backends.redis import removals
from asyncconn_backends.redis.backend import RedisBackend
from asyncconn_backends.redis.removals import key_of, missing_flags

from asyncconn.backend import open_backend
from asyncconn.url import with_param
from tests.servers import RedisServer
from tests.servers_distributed import RedisCluster


def _prefix() -> str:
    return f"r{uuid.uuid4().hex[:8]}:"


class _Heard:
    """An ``on_removed`` hook that records every key it is told."""

    def __init__(self) -> None:
        self.keys: list[str] = []
        self.changed = asyncio.Event()

    def __call__(self, keys: Sequence[str]) -> None:
        self.keys.extend(keys)
        self.changed.set()

    async def wait_for(self, wanted: set[str], within: float = 10.0) -> None:
        async with asyncio.timeout(within):
            while not wanted <= set(self.keys):
                self.changed.clear()
                await self.changed.wait()


async def _open(url: str, **params: str) -> RedisBackend:
    for name, value in params.items():
        url = with_param(url, name, value)
    backend = await open_backend(url)
    assert isinstance(backend, RedisBackend)  # redis+cluster:// too (a subclass)
    return backend


async def _listening(backend: RedisBackend) -> None:
    assert backend._listeners
    async with asyncio.timeout(10):
        for listener in backend._listeners:
            await listener.listening.wait()


async def _config(server: RedisServer, name: str, value: str | None = None) -> str:
    async with aioredis.Redis(port=server.port) as client:
        if value is not None:
            await client.config_set(name, value)
        return str((await client.config_get(name))[name])


def test_redis_key_names_map_back_to_store_keys() -> None:
    assert key_of("p:", b"p:{abc}") == "abc"
    assert key_of("", b"{a{b}}") == "a{b}"
    for name in (b"p:abc", b"q:{abc}", b"p:{}", b"p:{abc", b"\xff{a}", b"other"):
        assert key_of("p:", name) is None
    assert missing_flags("") == "Exe"
    assert missing_flags("Ex") == "e"
    assert missing_flags("AKE") == ""


async def test_ttl_expiry_reaches_on_removed_with_the_keys(fresh_redis: RedisServer) -> None:
    backend = await _open(fresh_redis.url, removals="enable", prefix=_prefix(), ttl="200ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        await _listening(backend)
        assert set(await _config(fresh_redis, "notify-keyspace-events")) >= set("Exe")
        # One inline value and one chunked (a hash): both expire whole, as one key each.
        await backend.put([("small", b"x" * 10), ("big", [b"a" * 300, b"b" * 300])])
        async with aioredis.Redis(port=fresh_redis.port) as client:  # not ours: another prefix, a bare key
            await client.set("someone-else", b"1", px=100)
            await client.set("zz:{small}", b"1", px=100)
        await heard.wait_for({"small", "big"})
        await asyncio.sleep(0.3)  # the foreign keys expired meanwhile: never reported
        assert sorted(heard.keys) == ["big", "small"]
        assert [listener.heard for listener in backend._listeners] == [2]
    finally:
        await backend.close()
    assert backend.held() == {"connected": 0, "in_use": 0, "listener_tasks": 0}


async def test_maxmemory_eviction_is_reported(fresh_redis: RedisServer) -> None:
    await _config(fresh_redis, "maxmemory-policy", "allkeys-lru")
    await _config(fresh_redis, "notify-keyspace-events", "Ee")  # the operator set it: listen is enough
    backend = await _open(fresh_redis.url, removals="listen", prefix=_prefix(), chunk_size="64KiB")
    heard = _Heard()
    backend.on_removed = heard
    try:
        await _listening(backend)
        async with aioredis.Redis(port=fresh_redis.port) as client:
            used = int((await client.info("memory"))["used_memory"])
            await client.config_set("maxmemory", used + 2_000_000)
        keys = [f"k{i}" for i in range(40)]
        for key in keys:  # 40 x 200 KB into a 2 MB budget: most are evicted
            await backend.put([(key, b"v" * 200_000)])
        async with asyncio.timeout(10):
            while not heard.keys:
                await asyncio.sleep(0.05)
        present = await backend.exists(keys)
        await asyncio.sleep(0.2)
        gone = {k for k, here in zip(keys, present, strict=True) if not here}
        assert gone and set(heard.keys) <= set(keys)
        await heard.wait_for(gone)
    finally:
        await backend.close()


async def test_listener_off_reports_nothing(fresh_redis: RedisServer) -> None:
    await _config(fresh_redis, "notify-keyspace-events", "Exe")
    backend = await _open(fresh_redis.url, prefix=_prefix(), ttl="100ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        assert backend._listeners == []
        await backend.put([("a", b"1")])
        await asyncio.sleep(0.5)
        assert await backend.exists(["a"]) == [False]
        assert heard.keys == []
    finally:
        await backend.close()


async def test_listen_without_server_flags_logs_once_and_carries_on(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await _open(fresh_redis.url, removals="listen", prefix=_prefix(), ttl="100ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        with caplog.at_level(logging.WARNING, logger="asyncconn_backends.redis.removals"):
            await _listening(backend)
        assert "without 'Exe'" in caplog.text
        assert await _config(fresh_redis, "notify-keyspace-events") == ""  # listen never changes it
        await backend.put([("a", b"1")])
        assert (await backend.get(["a"]))[0] is not None  # the store works as ever
        await asyncio.sleep(0.4)
        assert heard.keys == []
    finally:
        await backend.close()


async def test_a_server_refusing_config_set_is_logged_not_fatal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    server = RedisServer(extra_args=("--rename-command", "CONFIG", "")).start()
    try:
        with caplog.at_level(logging.WARNING, logger="asyncconn_backends.redis.removals"):
            backend = await _open(server.url, removals="enable", prefix=_prefix())
            try:
                await _listening(backend)
                await backend.put([("a", b"1")])
                assert (await backend.get(["a"]))[0] is not None
            finally:
                await backend.close()
        assert "cannot read notify-keyspace-events" in caplog.text
    finally:
        server.stop()


async def test_the_listener_comes_back_after_a_server_restart(fresh_redis: RedisServer) -> None:
    backend = await _open(fresh_redis.url, removals="enable", prefix=_prefix(), ttl="150ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        await _listening(backend)
        (listener,) = backend._listeners
        await asyncio.to_thread(fresh_redis.restart)  # comes back empty, with its flags forgotten
        async with asyncio.timeout(10):
            while listener.outages == 0 or not listener.listening.is_set():
                await asyncio.sleep(0.02)
        assert set(await _config(fresh_redis, "notify-keyspace-events")) >= set("Exe")  # re-applied
        await backend.put([("after", b"1")])
        await heard.wait_for({"after"})
    finally:
        await backend.close()
    assert backend.held() == {"connected": 0, "in_use": 0, "listener_tasks": 0}


async def test_close_while_the_server_is_down_leaves_nothing(fresh_redis: RedisServer) -> None:
    backend = await _open(fresh_redis.url, removals="listen", prefix=_prefix())
    await _listening(backend)
    fresh_redis.kill()
    (listener,) = backend._listeners
    async with asyncio.timeout(10):
        while listener.outages < 2:  # reconnecting, with backoff
            await asyncio.sleep(0.02)
    await backend.close()
    assert backend.held() == {"connected": 0, "in_use": 0, "listener_tasks": 0}
    tasks = [t for t in asyncio.all_tasks() if t.get_name().startswith("redis removals")]
    assert tasks == []


async def test_bad_removals_value_is_a_config_error(redis_server: RedisServer) -> None:
    from asyncconn.exceptions import ConfigError

    with pytest.raises(ConfigError, match="removals"):
        await open_backend(with_param(redis_server.url, "removals", "yes"))


async def test_cluster_expiry_on_every_master_is_reported(redis_cluster: RedisCluster) -> None:
    """One listener per master: keys expiring on each of the three masters all reach ``on_removed``."""
    backend = await _open(redis_cluster.url, removals="enable", prefix=_prefix(), ttl="300ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        await _listening(backend)
        assert len(backend._listeners) == redis_cluster.masters
        keys = [f"c{i}" for i in range(30)]  # spread over every master's slots
        await backend.put([(key, b"v") for key in keys])
        await heard.wait_for(set(keys))
        assert sorted(heard.keys) == sorted(keys)
        assert all(listener.heard > 0 for listener in backend._listeners)
    finally:
        await backend.close()
    assert backend.held()["listener_tasks"] == 0


async def test_a_hung_server_is_noticed_by_ping_and_the_listener_comes_back(
    fresh_redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frozen server (SIGSTOP) never closes the socket: the listener's PING after a silence finds it."""
    monkeypatch.setattr(removals, "IDLE", 0.2)
    backend = await _open(fresh_redis.url, removals="enable", prefix=_prefix(), ttl="150ms")
    heard = _Heard()
    backend.on_removed = heard
    try:
        await _listening(backend)
        (listener,) = backend._listeners
        await asyncio.sleep(0.5)  # quiet, answered PINGs: still the same session
        assert listener.outages == 0 and listener.listening.is_set()
        await asyncio.to_thread(fresh_redis.pause)
        try:
            async with asyncio.timeout(10):
                while listener.outages == 0:
                    await asyncio.sleep(0.02)
        finally:
            fresh_redis.resume()
        async with asyncio.timeout(10):
            await listener.listening.wait()
        await backend.put([("after", b"1")])
        await heard.wait_for({"after"})
    finally:
        await backend.close()
    assert backend.held() == {"connected": 0, "in_use": 0, "listener_tasks": 0}


async def test_a_hook_that_raises_is_logged_and_the_listener_goes_on(
    fresh_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    backend = await _open(fresh_redis.url, removals="enable", prefix=_prefix(), ttl="100ms")
    heard = _Heard()
    calls = 0

    def flaky(keys: Sequence[str]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the hook")
        heard(keys)

    try:
        await _listening(backend)
        (listener,) = backend._listeners
        assert listener.unheard == 0
        await backend.put([("no-hook", b"1")])  # removed while nobody listens: counted, not kept
        async with asyncio.timeout(10):
            while listener.unheard == 0:
                await asyncio.sleep(0.02)
        backend.on_removed = flaky
        with caplog.at_level(logging.ERROR, logger="asyncconn_backends.redis.removals"):
            await backend.put([("first", b"1")])
            async with asyncio.timeout(10):
                while calls == 0:
                    await asyncio.sleep(0.02)
            await backend.put([("second", b"1")])
            await heard.wait_for({"second"})
        assert "on_removed hook failed" in caplog.text
        assert "no-hook" not in heard.keys and listener.outages == 0
    finally:
        await backend.close()
