"""Expiry of stored values: Redis/Cluster ``ttl`` (a value expires whole), ``file://`` ``max_age``,
``refresh_on_hit`` on both, and ``on_removed`` told which keys the file store's sweep removed.

Redis tests run against a real redis-server and a real 3-master cluster; ages of files are set with
``os.utime`` (what a sweep and a read go by), so no test waits for a clock.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis
import torch
from asyncconn_backends.file import FileBackend, _touch
from asyncconn_backends.redis.layout import main_key

from asyncconn.backend import StorageBackend, open_backend
from asyncconn.exceptions import ConfigError
from asyncconn.store import Fetch, TensorStore
from asyncconn.url import parse_duration
from tests.servers import RedisServer
from tests.servers_distributed import RedisCluster

_HOUR = 3600 * 10**9
_MIN = 60 * 10**9


def _prefix() -> str:
    return f"x{uuid.uuid4().hex[:8]}:"


def _joined(value: Sequence[bytes | bytearray | memoryview] | None) -> bytes | None:
    return None if value is None else b"".join(bytes(c) for c in value)


async def _read_into(backend: StorageBackend, key: str, size: int) -> bytes | None:
    out = bytearray(size)
    got = await backend.get_into(key, [memoryview(out)])
    return bytes(out) if got == size else None


def test_durations_take_hours_and_days() -> None:
    assert parse_duration("1h") == 3600 and parse_duration("30m") == 1800 and parse_duration("1d") == 86400


# -- redis:// and redis+cluster:// ttl ------------------------------------------------------------------
async def _expires_whole(
    backend: StorageBackend, values: dict[str, bytes], ttls: Callable[[], dict[str, tuple[int, int]]]
) -> None:
    """Every value is one key carrying the ttl; until it goes, each read is the whole value; then none is.

    ``ttls()``: every key of the store's prefix -> (PTTL, fields of the hash or 0 for a string).
    """
    await backend.put(list(values.items()))
    found = ttls()
    assert len(found) == len(values)  # one key per value: no chunk under a key of its own
    for pttl, _ in found.values():
        assert 0 < pttl <= 1000
    assert sorted(fields for _, fields in found.values()) == [0, 1 + 4]  # inline; manifest + 4 chunks
    for _ in range(400):  # 20 s at most; a 1 s ttl ends well before
        got = await backend.get(list(values))
        direct = [await _read_into(backend, k, len(v)) for k, v in values.items()]
        for (key, value), whole, landed in zip(values.items(), got, direct, strict=True):
            assert _joined(whole) in (None, value), key  # never part of a value
            assert landed in (None, value), key
        if got == [None, None] and direct == [None, None]:
            break
        await asyncio.sleep(0.05)
    assert await backend.get(list(values)) == [None, None]
    assert await backend.exists(list(values)) == [False, False]
    assert ttls() == {}  # nothing of either value is left behind


@pytest.mark.parametrize("fast_read", ["true", "false"])  # the hand-built MULTI, and redis-py's
async def test_redis_ttl_expires_a_value_and_all_its_chunks_together(
    redis_server: RedisServer, fast_read: str
) -> None:
    prefix = _prefix()
    url = f"redis://127.0.0.1:{redis_server.port}/0?prefix={prefix}&ttl=1s&chunk_size=64KiB&fast_read={fast_read}"
    backend = await open_backend(url)
    sync = redis.Redis(host="127.0.0.1", port=redis_server.port)

    def ttls() -> dict[str, tuple[int, int]]:
        return {
            k.decode(): (sync.pttl(k), sync.hlen(k) if sync.type(k) == b"hash" else 0)
            for k in sync.scan_iter(match=f"{prefix}*")
        }

    try:
        await _expires_whole(backend, {"big": os.urandom(200 << 10), "small": b"s" * 100}, ttls)
    finally:
        sync.close()
        await backend.close()


async def test_cluster_ttl_expires_a_value_and_all_its_chunks_together(redis_cluster: RedisCluster) -> None:
    prefix = _prefix()
    backend = await open_backend(f"{redis_cluster.url}?prefix={prefix}&ttl=1s&chunk_size=64KiB")
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in redis_cluster.ports]

    def ttls() -> dict[str, tuple[int, int]]:
        return {
            k.decode(): (node.pttl(k), node.hlen(k) if node.type(k) == b"hash" else 0)
            for node in nodes
            for k in node.scan_iter(match=f"{prefix}*")
        }

    try:
        await _expires_whole(backend, {"big": os.urandom(200 << 10), "small": b"s" * 100}, ttls)
    finally:
        for node in nodes:
            node.close()
        await backend.close()


async def test_a_redis_read_after_expiry_is_a_miss_for_the_tensor_store(redis_server: RedisServer) -> None:
    store = await TensorStore.open(f"redis://127.0.0.1:{redis_server.port}/0?prefix={_prefix()}&ttl=1s")
    try:
        await store.put([("t", torch.arange(100_000, dtype=torch.float32))])
        out = torch.empty(100_000)
        assert await store.read_into("t", out) is Fetch.HIT and torch.equal(out, torch.arange(100_000.0))
        for _ in range(400):
            if not (await store.exists(["t"]))[0]:
                break
            await asyncio.sleep(0.05)
        out.zero_()
        assert await store.read_into("t", out) is Fetch.MISS
        assert await store.get(["t"]) == [None]
        assert store.stats.corrupt == 0
    finally:
        await store.close()


# -- refresh_on_hit on redis --------------------------------------------------------------------------
async def _rearmed(backend: StorageBackend, raw: aioredis.Redis, prefix: str) -> dict[str, bool]:
    """Cut each value's remaining ttl to 5 s, read it (both read paths): was it re-armed past that?"""
    values = {"big": os.urandom(200 << 10), "small": b"s" * 100}
    await backend.put(list(values.items()))
    out: dict[str, bool] = {}
    for read in ("get", "get_into"):
        for key, value in values.items():
            name = main_key(prefix, key)
            assert await raw.pexpire(name, 5000)
            if read == "get":
                assert _joined((await backend.get([key]))[0]) == value
            else:
                assert await _read_into(backend, key, len(value)) == value
            out[f"{read}:{key}"] = await raw.pttl(name) > 5000
    assert await backend.get(["absent"]) == [None]
    assert await raw.exists(main_key(prefix, "absent")) == 0  # a miss creates nothing
    return out


@pytest.mark.parametrize("refresh", [True, False])
async def test_redis_refresh_on_hit_rearms_the_ttl_of_a_value_read(
    redis_server: RedisServer, refresh: bool
) -> None:
    prefix = _prefix()
    query = f"prefix={prefix}&ttl=1h&chunk_size=64KiB" + ("&refresh_on_hit=1" if refresh else "")
    backend = await open_backend(f"redis://127.0.0.1:{redis_server.port}/0?{query}")
    raw = aioredis.Redis(host="127.0.0.1", port=redis_server.port)
    try:
        rearmed = await _rearmed(backend, raw, prefix)
        assert set(rearmed.values()) == {refresh}, rearmed
    finally:
        await raw.aclose()
        await backend.close()


async def _calls(raw: aioredis.Redis, *names: str) -> dict[str, int]:
    stats = await raw.info("commandstats")
    return {name: int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in names}


@pytest.mark.parametrize("getex", [True, False], ids=["getex", "server-without-getex"])
async def test_an_inline_read_rearms_the_ttl_in_its_one_command_or_falls_back_to_pexpire(
    getex: bool,
) -> None:
    """With ``refresh_on_hit`` a value stored inline is read and re-armed by one ``GETEX``, not a ``GET``
    and a ``PEXPIRE`` round trip; a server without ``GETEX`` (before Redis 6.2) gets the two."""
    server = RedisServer(extra_args=() if getex else ("--rename-command", "GETEX", "")).start()
    prefix = _prefix()
    backend = await open_backend(f"{server.url}?prefix={prefix}&ttl=1h&chunk_size=64KiB&refresh_on_hit=1")
    raw = aioredis.Redis(host="127.0.0.1", port=server.port)
    try:
        value = b"v" * 1000
        await backend.put([("k", value)])
        name = main_key(prefix, "k")
        for _ in range(2):  # the second read: after a fallback, no GETEX is tried again
            assert await raw.pexpire(name, 5000)
            before = await _calls(raw, "getex", "pexpire", "get", "mget")
            assert await _read_into(backend, "k", len(value)) == value
            assert await raw.pttl(name) > 5000
            after = await _calls(raw, "getex", "pexpire", "get", "mget")
            change = {k: after[k] - before[k] for k in after}
            if getex:
                assert change == {"getex": 1, "pexpire": 0, "get": 0, "mget": 0}, change
            else:
                assert change["getex"] == 0 and change["pexpire"] == 1 and change["mget"] == 1, change
    finally:
        await raw.aclose()
        await backend.close()
        server.stop()


async def test_cluster_refresh_on_hit_rearms_the_ttl_of_a_value_read(redis_cluster: RedisCluster) -> None:
    prefix = _prefix()
    backend = await open_backend(
        f"{redis_cluster.url}?prefix={prefix}&ttl=1h&chunk_size=64KiB&refresh_on_hit=1"
    )
    raw = aioredis.RedisCluster(host="127.0.0.1", port=redis_cluster.ports[0])
    try:
        rearmed = await _rearmed(backend, raw, prefix)  # type: ignore[arg-type]  # same commands used
        assert all(rearmed.values()), rearmed
    finally:
        await raw.aclose()
        await backend.close()


async def test_refresh_on_hit_needs_a_ttl(redis_server: RedisServer, redis_cluster: RedisCluster) -> None:
    with pytest.raises(ConfigError, match=r"refresh_on_hit.*needs a ttl"):
        await open_backend(f"redis://127.0.0.1:{redis_server.port}/0?refresh_on_hit=1")
    with pytest.raises(ConfigError, match=r"refresh_on_hit.*needs a ttl"):
        await open_backend(f"{redis_cluster.url}?refresh_on_hit=1")


# -- file:// max_age, refresh_on_hit, on_removed ------------------------------------------------------
def _age(backend: FileBackend, key: str, *, written: int, used: int | None = None) -> None:
    """Set a value's write time and last use to ``written``/``used`` ns before now."""
    now = time.time_ns()
    os.utime(backend.path_for(key), ns=(now - (written if used is None else used), now - written))


async def test_file_values_past_max_age_are_misses_and_the_sweeper_deletes_them(tmp_path: Path) -> None:
    backend = await open_backend(f"file://{tmp_path}/s?max_age=1h&sweep_interval=50ms")
    assert isinstance(backend, FileBackend)
    removed: list[tuple[list[str], int]] = []
    backend.on_removed = lambda keys: removed.append((list(keys), threading.get_ident()))
    values = {"old": os.urandom(5000), "new": os.urandom(5000)}
    try:
        await backend.put(list(values.items()))
        _age(backend, "old", written=2 * _HOUR, used=0)  # read a moment ago: still written 2 h ago
        _age(backend, "new", written=50 * _MIN)
        old = backend.path_for("old")
        got = await backend.get(["old", "new"])
        assert got[0] is None and _joined(got[1]) == values["new"]
        assert await _read_into(backend, "old", 5000) is None  # the direct read path too
        assert await backend.get_into_many([("old", [memoryview(bytearray(5000))], None)]) == [None]
        assert await backend.exists(["old", "new"]) == [False, True]
        for _ in range(400):  # the sweeper (every 50 ms, on the loop's own schedule) deletes it
            if not old.exists():
                break
            await asyncio.sleep(0.05)
        assert not old.exists() and backend.path_for("new").exists()
        assert removed == [(["old"], threading.get_ident())]  # on the loop thread, this test's
        assert backend.expired == 1 and backend.evicted == 0
        assert await _read_into(backend, "new", 5000) == values["new"]
    finally:
        await backend.close()


@pytest.mark.parametrize("refresh", [True, False])
async def test_file_refresh_on_hit_counts_max_age_from_the_last_read(tmp_path: Path, refresh: bool) -> None:
    query = "max_age=1h&sweep_interval=1h" + ("&refresh_on_hit=1" if refresh else "")
    backend = await open_backend(f"file://{tmp_path}/s?{query}")
    assert isinstance(backend, FileBackend)
    value = os.urandom(3000)
    try:
        await backend.put([("k", value)])
        _age(backend, "k", written=50 * _MIN)
        assert await _read_into(backend, "k", 3000) == value  # a hit, 50 min after the write
        st = os.stat(backend.path_for("k"))
        os.utime(backend.path_for("k"), ns=(st.st_atime_ns - 20 * _MIN, st.st_mtime_ns - 20 * _MIN))
        # 20 min later: written 70 min ago, read 20 min ago
        report = await backend.sweep()
        assert report is not None and report.expired == (0 if refresh else 1)
        got = _joined((await backend.get(["k"]))[0])
        assert got == (value if refresh else None)
    finally:
        await backend.close()


async def test_file_on_removed_is_told_the_keys_max_bytes_evicted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Built without from_url: no sweeper task, so the only sweeps are the ones this test runs.
    backend = FileBackend(tmp_path / "s", max_bytes=10 << 10)
    told: list[str] = []
    backend.on_removed = told.extend
    long_key = "L" * 300  # a hashed file name: known to this process, which built its path
    keys = ["a/b c", long_key, "keep1", "keep2", "h-" + "0" * 32]
    try:
        await backend.put([(k, os.urandom(3000)) for k in keys])
        for minutes, key in enumerate(reversed(keys)):  # keys[0] used longest ago
            _age(backend, key, written=(minutes + 1) * _MIN)
        report = await backend.sweep()  # 15000 bytes > 10 KiB: down to 9216, the two oldest go
        assert report is not None and (report.evicted, report.expired) == (2, 0)
        assert told == ["a/b c", long_key] and report.removed == ("a/b c", long_key)
        assert await backend.exists(keys) == [False, False, True, True, True]
        assert backend.evicted == 2

        def broken(keys: Sequence[str]) -> None:
            raise RuntimeError("hook bug")

        backend.on_removed = broken
        await backend.put([("more", os.urandom(3000))])
        with caplog.at_level(logging.ERROR):
            report = await backend.sweep()  # the hook fails; the sweep still counts and returns
        assert report is not None and report.evicted == 1 and backend.evicted == 3
        assert "on_removed hook failed" in caplog.text
    finally:
        await backend.close()


async def test_file_reads_are_recorded_as_uses_without_moving_the_write_time(tmp_path: Path) -> None:
    backend = await open_backend(f"file://{tmp_path}/s")
    assert isinstance(backend, FileBackend)
    try:
        await backend.put([("k", b"v" * 100)])
        _age(backend, "k", written=2 * _HOUR, used=_HOUR)
        before = os.stat(backend.path_for("k"))
        assert _joined((await backend.get(["k"]))[0]) == b"v" * 100
        after = os.stat(backend.path_for("k"))
        assert after.st_mtime_ns == before.st_mtime_ns  # the write time max_age counts from
        assert after.st_atime_ns > before.st_atime_ns + _HOUR - _MIN  # the last use, for max_bytes
        # The kernel may move the access time on a read too (relatime does after a utime); without a read
        # (O_NOATIME, nothing read), only the backend's own record moves it, and never the write time.
        _age(backend, "k", written=2 * _HOUR, used=_HOUR)
        fd = os.open(backend.path_for("k"), os.O_RDONLY | os.O_NOATIME)
        try:
            before = os.fstat(fd)
            _touch(fd, before)
            touched = os.fstat(fd)
        finally:
            os.close(fd)
        assert touched.st_mtime_ns == before.st_mtime_ns
        assert touched.st_atime_ns > before.st_atime_ns + _HOUR - _MIN
    finally:
        await backend.close()


def test_bad_file_max_age() -> None:
    with pytest.raises(ConfigError, match="max_age"):
        FileBackend("/tmp", max_age=-1)
