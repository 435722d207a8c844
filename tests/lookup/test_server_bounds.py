"""The lookup server under hostile load: bounded by bytes and keys held, fair between clients, and a reply
to every request it reads (an error reply when it cannot serve one)."""

from __future__ import annotations

import logging
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from asyncconn.lookup import LookupServer, store_key
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.lookup.fakes import wait_until
from tests.servers import RedisServer

HASHES = [bytes([i]) * 32 for i in range(8)]
PRESENT = 5
BIG = 65_536  # keys in one flood request: the default max_keys
#: What the flood may add to the server process's peak RSS with the default bounds (docs/lookup.md:
#: 64 MiB of request bytes + 131,072 keys in flight, about 1 KiB each while their store call runs).
FLOOD_RSS_BOUND = 400 * 1024 * 1024


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-bounds-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


def _socket(ctx: zmq.Context, kind: int, endpoint: str, timeout_ms: int = 5000) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)  # a server that never answers fails the test, never hangs it
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def _big_lookup(seed: int) -> list[bytes]:
    blob = (seed + 0x10000).to_bytes(4, "big") * (BIG * 8)  # 65,536 32-byte hashes, none stored
    return [b"lookup", _u32(BIG * 16), struct.pack(">H", 32), blob]


def _rss(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for {pid}")


# -- a real server process on a real redis-server ---------------------------------------------------
@pytest.mark.redis
def test_a_flood_of_large_lookups_stays_bounded_and_other_clients_are_answered_in_time(
    redis_server: RedisServer, rt: Runtime
) -> None:
    """One client sends 30 lookups of 65,536 keys (2 MiB each) as fast as it can; a second client's
    small lookups are answered correctly within their 3 s timeout meanwhile, every flood request gets a
    reply, and the server's peak RSS grows by less than the documented bound."""

    async def seed() -> None:
        store = await TensorStore.open(redis_server.url)
        try:
            await store.backend.put([(store_key("flood/", h), b"v") for h in HASHES[:PRESENT]])
        finally:
            await store.close()

    rt.run(seed())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            redis_server.url,
            "--key-prefix",
            "flood/",
            "--bind",
            "tcp://127.0.0.1:*",
            "--timeout",
            "30s",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().split()[-1]
        small = _socket(ctx, zmq.REQ, endpoint, timeout_ms=3000)
        small.send_multipart(encode_mooncake_lookup(8 * 16, HASHES))
        assert small.recv() == _u32(PRESENT * 16)
        baseline = _rss(proc.pid, "VmRSS")

        flood = _socket(ctx, zmq.DEALER, endpoint, timeout_ms=60_000)
        flood.setsockopt(zmq.SNDHWM, 0)
        sent = 30
        replies: list[bytes] = []

        def flooder() -> None:
            for i in range(sent):
                flood.send_multipart([b"", *_big_lookup(i)])

        thread = threading.Thread(target=flooder)
        started = time.monotonic()
        thread.start()
        latencies = []
        answered_during_flood = 0
        while thread.is_alive() or len(replies) < sent:
            t0 = time.monotonic()
            small.send_multipart(encode_mooncake_lookup(8 * 16, HASHES))
            assert small.recv() == _u32(PRESENT * 16)  # raises zmq.Again past the 3 s timeout
            latencies.append(time.monotonic() - t0)
            answered_during_flood += 1
            while flood.poll(0):
                replies.append(flood.recv_multipart()[-1])
            if time.monotonic() - started > 60:
                break
            time.sleep(0.02)
        thread.join()
        while len(replies) < sent and flood.poll(60_000):
            replies.append(flood.recv_multipart()[-1])
        peak = _rss(proc.pid, "VmHWM")
        assert len(replies) == sent  # every request got exactly one reply
        assert all(r in (_u32(0), b"\x00") for r in replies)  # nothing stored under the flood's hashes
        assert answered_during_flood >= 5 and max(latencies) < 3.0
        assert peak - baseline < FLOOD_RSS_BOUND, (peak - baseline) / 2**20
        print(f"flood: peak RSS +{(peak - baseline) / 2**20:.0f} MiB, small lookup max {max(latencies):.3f}s")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        ctx.destroy(0)


# -- in-process servers: the same code, with small bounds and injected failures ---------------------
def _start(rt: Runtime, url: str, **kw) -> LookupServer:
    async def go() -> LookupServer:
        store = await TensorStore.open(url)
        await store.backend.put([(store_key("kv/", h), b"v") for h in HASHES[:PRESENT]])
        server = LookupServer(store, "tcp://127.0.0.1:*", key_prefix="kv/", **kw)
        await server.start()
        return server

    return rt.run(go())


def _stop(rt: Runtime, server: LookupServer) -> None:
    async def go() -> None:
        await server.close()
        await server.store.close()

    rt.run(go())


@pytest.mark.parametrize("error", [MemoryError, RuntimeError])
def test_a_batch_that_raises_gets_error_replies_not_silence(rt: Runtime, error: type[Exception]) -> None:
    server = _start(rt, "memory://bounds-raise")
    real = server.store.exists

    async def broken(keys):  # what a batch meets when the process is out of memory, or a bug
        raise error("injected")

    ctx = zmq.Context()
    try:
        assert server.endpoint is not None
        req = _socket(ctx, zmq.REQ, server.endpoint)
        server.store.exists = broken  # type: ignore[method-assign]
        req.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
        assert req.recv() == b"\x00"  # an error reply: vLLM's client and ours read it as a failed lookup
        assert server.stats.failed == 1
        server.store.exists = real  # type: ignore[method-assign]
        req.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
        assert req.recv() == _u32(64)
        wait_until(lambda: server.held() == {"bytes": 0, "keys": 0, "clients": 0, "queued": 0, "batches": 0})
    finally:
        ctx.destroy(0)
        _stop(rt, server)


def test_past_max_bytes_the_heaviest_client_is_shed_and_the_light_one_is_served(rt: Runtime) -> None:
    """A slow store (50 ms a call) and 1 MiB of request bytes: a flooding DEALER gets error replies for
    what does not fit, each of its requests exactly one reply; a light REQ client's lookups are answered."""
    server = _start(
        rt,
        "memory://bounds-shed?latency=50ms",
        max_bytes=1 << 20,
        max_message=256 * 1024,
        max_inflight_keys=8192 + 1024,
        batch_keys=1024,
        max_keys=8192,
    )
    ctx = zmq.Context()
    try:
        assert server.endpoint is not None
        flood = _socket(ctx, zmq.DEALER, server.endpoint, timeout_ms=10_000)
        light = _socket(ctx, zmq.REQ, server.endpoint, timeout_ms=3000)
        blob = b"\xee" * (32 * 4096)  # 128 KiB, 4096 keys
        sent = 100
        for _ in range(sent):
            flood.send_multipart([b"", b"lookup", _u32(4096 * 16), struct.pack(">H", 32), blob])
        for _ in range(5):
            light.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
            assert light.recv() == _u32(64)
        replies = [flood.recv_multipart()[-1] for _ in range(sent)]
        assert sorted(set(replies)) == [b"\x00", _u32(0)]  # some served (a miss), some shed
        assert server.stats.shed == replies.count(b"\x00")
        assert server.peak_bytes <= 1 << 20
        assert server.peak_keys <= 8192 + 1024
        assert not flood.poll(100)  # no second reply to anything
        wait_until(lambda: server.held() == {"bytes": 0, "keys": 0, "clients": 0, "queued": 0, "batches": 0})
    finally:
        ctx.destroy(0)
        _stop(rt, server)


def test_past_max_clients_a_new_client_gets_an_error_reply(rt: Runtime) -> None:
    server = _start(rt, "memory://bounds-clients?latency=300ms", max_clients=1)
    ctx = zmq.Context()
    try:
        assert server.endpoint is not None
        first = _socket(ctx, zmq.REQ, server.endpoint)
        second = _socket(ctx, zmq.REQ, server.endpoint)
        first.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
        wait_until(lambda: server.held()["clients"] == 1)
        second.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
        assert second.recv() == b"\x00"  # at once, while the first is still held
        assert first.recv() == _u32(64)
        second.send_multipart(encode_mooncake_lookup(64, HASHES[:4]))
        assert second.recv() == _u32(64)  # the first client's slot is free again
        assert server.stats.shed == 1
    finally:
        ctx.destroy(0)
        _stop(rt, server)


def test_malformed_requests_are_counted_each_and_logged_at_a_bounded_rate(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    server = _start(rt, "memory://bounds-log", log_interval=60.0)
    ctx = zmq.Context()
    try:
        assert server.endpoint is not None
        dealer = _socket(ctx, zmq.DEALER, server.endpoint)
        with caplog.at_level(logging.WARNING, logger="asyncconn.lookup.server"):
            for _ in range(500):
                dealer.send_multipart([b"", b"lookup", b"\x00"])
            replies = [dealer.recv_multipart()[-1] for _ in range(500)]
        assert replies == [b"\x00"] * 500
        assert server.stats.errors == 500
        lines = [r for r in caplog.records if "malformed" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in lines]
    finally:
        ctx.destroy(0)
        _stop(rt, server)


def test_bounds_are_checked_at_start_up(rt: Runtime) -> None:
    from asyncconn.exceptions import ConfigError

    store = rt.run(TensorStore.open("memory://bounds-config"))
    for kw in (
        {"max_bytes": 0},
        {"max_clients": -1},
        {"max_connections": 0},
        {"max_inflight_keys": 1000},  # below max_keys + batch_keys
        {"max_bytes": 1024, "max_message": 4096},
        {"max_batch": True},
    ):
        with pytest.raises(ConfigError):
            LookupServer(store, **kw)
    rt.run(store.close())


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_cli_rejects_a_bound_out_of_range() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            "memory://x",
            "--max-inflight-keys",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "max_inflight_keys" in done.stderr


def test_a_large_lookup_stops_at_the_first_store_call_with_a_miss_and_answers_right(rt: Runtime) -> None:
    server = _start(rt, "memory://bounds-prefix", batch_keys=2, max_keys=8, max_inflight_keys=16)
    calls: list[int] = []
    real = server.store.exists

    async def counted(keys):
        calls.append(len(keys))
        return await real(keys)

    server.store.exists = counted  # type: ignore[method-assign]
    ctx = zmq.Context()
    try:
        assert server.endpoint is not None
        req = _socket(ctx, zmq.REQ, server.endpoint)
        req.send_multipart(encode_mooncake_lookup(8 * 16, HASHES))  # 5 present, then 3 absent
        assert req.recv() == _u32(PRESENT * 16)
        assert calls == [2, 2, 2]  # the third call found the miss; the fourth was never made
        calls.clear()
        req.send_multipart(encode_mooncake_lookup(8 * 16, [HASHES[7], *HASHES[:7]]))
        assert req.recv() == _u32(0)
        assert calls == [2]
        calls.clear()
        req.send_multipart([b"exists", b"x", struct.pack(">H", 32), b"".join(HASHES)])
        assert req.recv() == b"\x01" + bytes([1] * PRESENT + [0] * 3)  # exists asks every key
        assert calls == [2, 2, 2, 2]
    finally:
        ctx.destroy(0)
        _stop(rt, server)
