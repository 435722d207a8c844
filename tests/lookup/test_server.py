"""The ZMQ lookup server over real sockets: raw Mooncake REQ/REP, malformed frames, the pipelined client
against hung, dead and restarted servers."""

from __future__ import annotations

import struct
import time
from collections.abc import Iterator

import pytest
import zmq

from asyncconn.lookup import EXISTS, PREFIX, LookupClient, LookupServer, ZmqTransport, store_key
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.lookup.fakes import wait_until
from tests.servers import free_port

HASHES = [bytes([i]) * 32 for i in range(8)]  # vLLM-like 32-byte block hashes
PRESENT = 5  # the first five blocks are in the store


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-server-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


async def _open_store(name: str) -> TensorStore:
    store = await TensorStore.open(f"memory://{name}")
    await store.backend.put([(store_key("kv/", h), b"v") for h in HASHES[:PRESENT]])
    await store.backend.put([("kv/mm-a", b"v")])
    return store


def start_server(rt: Runtime, bind: str = "tcp://127.0.0.1:*", **kw) -> LookupServer:
    async def go() -> LookupServer:
        server = LookupServer(await _open_store("lookup-srv"), bind, key_prefix="kv/", **kw)
        await server.start()
        return server

    return rt.run(go())


@pytest.fixture
def server(rt: Runtime) -> Iterator[LookupServer]:
    srv = start_server(rt, max_keys=1024)
    try:
        yield srv
    finally:
        rt.run(srv.close())


@pytest.fixture
def req(server: LookupServer) -> Iterator[zmq.Socket]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)  # a server that never answers fails the test instead of hanging it
    sock.setsockopt(zmq.LINGER, 0)
    assert server.endpoint is not None
    sock.connect(server.endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def ask(sock: zmq.Socket, frames: list[bytes]) -> bytes:
    sock.send_multipart(frames)
    return bytes(sock.recv())


def u32(n: int) -> bytes:
    return struct.pack(">I", n)


def u16(n: int) -> bytes:
    return struct.pack(">H", n)


# -- the raw Mooncake exchange, exactly as vLLM's MooncakeStoreConnector client frames it ---------------
def test_mooncake_lookup_counts_leading_blocks_in_tokens(req: zmq.Socket) -> None:
    assert ask(req, encode_mooncake_lookup(8 * 16 + 7, HASHES)) == u32(PRESENT * 16)
    assert ask(req, encode_mooncake_lookup(16 * 3, HASHES[:3])) == u32(48)
    assert ask(req, [b"lookup", u32(100), u16(0), b""]) == u32(0)  # no full block: nothing to hit
    # a miss in the middle stops the prefix
    assert ask(req, encode_mooncake_lookup(16 * 3, [HASHES[0], HASHES[7], HASHES[1]])) == u32(16)
    # a huge token count is fine: the hit is still the leading blocks' tokens
    assert ask(req, encode_mooncake_lookup(0xFFFFFFFF, HASHES[:2])) == u32(32)


def test_hit_is_capped_at_the_token_count(req: zmq.Socket) -> None:
    # hashes finer than the scheduler's block: 3 hashes of 16 tokens, block-aligned count 32 (block 32)
    assert ask(req, [b"lookup", u32(32), u16(32), b"".join(HASHES[:3])]) == u32(32)


def test_reset_is_refused_unless_the_server_can_wipe(req: zmq.Socket, rt: Runtime) -> None:
    assert ask(req, [b"reset"]) == b"\x00"  # never a false "wiped"
    wiped: list[bool] = []
    srv = start_server(rt, on_reset=lambda: wiped.append(True) or True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert srv.endpoint is not None
        sock.connect(srv.endpoint)
        assert ask(sock, [b"reset"]) == b"\x01"
        assert wiped == [True]
    finally:
        sock.close(0)
        ctx.term()
        rt.run(srv.close())


def test_unknown_tag(req: zmq.Socket) -> None:
    assert ask(req, [b"frobnicate", b"x"]) == b"\x00"
    assert ask(req, [b""]) == b"\x00"


MALFORMED = {
    "wrong tag": [b"lookupX", u32(64), u16(32), b"".join(HASHES[:4])],
    "tag only": [b"lookup"],
    "three frames": [b"lookup", u32(64), u16(32)],
    "five frames": [b"lookup", u32(64), u16(32), HASHES[0], b"extra"],
    "short token count": [b"lookup", b"\x00\x00\x40", u16(32), HASHES[0]],
    "long hash size": [b"lookup", u32(64), b"\x00\x00\x20", HASHES[0]],
    "hash size not dividing payload": [b"lookup", u32(64), u16(5), b"x" * 12],
    "hash size 0 with payload": [b"lookup", u32(64), u16(0), b"x" * 12],
    "more hashes than the cap": [b"lookup", u32(0xFFFFFFFF), u16(1), b"x" * 5000],
    "reset with a field": [b"reset", b"now"],
    "prefix with bad encoding": [b"prefix", b"?", u16(1), b"ab"],
    "exists with bad utf-8": [b"exists", b"t", u16(2), b"\xff\xfe"],
    "variable keys truncated": [b"exists", b"x", u16(0), u16(10) + b"abc"],
}


@pytest.mark.parametrize("frames", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_gets_error_reply_and_server_keeps_serving(
    req: zmq.Socket, server: LookupServer, frames: list[bytes]
) -> None:
    errors = server.stats.errors
    assert ask(req, frames) == b"\x00"
    assert server.stats.errors == errors + 1
    assert ask(req, encode_mooncake_lookup(64, HASHES[:4])) == u32(64)


def test_oversized_frame_is_dropped_and_server_keeps_serving(rt: Runtime) -> None:
    srv = start_server(rt, max_message=64 * 1024)
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(srv.endpoint)
        big.send_multipart([b"", b"lookup", u32(1), u16(1), b"x" * (1 << 20)])
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(srv.endpoint)
        assert ask(sock, encode_mooncake_lookup(32, HASHES[:2])) == u32(32)
        assert big.poll(200) == 0  # no reply to the oversized message: its connection was dropped
        big.close(0)
        sock.close(0)
    finally:
        ctx.term()
        rt.run(srv.close())


def test_ipc_socket_file_is_private(rt: Runtime, tmp_path) -> None:
    path = tmp_path / "lookup.sock"
    srv = start_server(rt, bind=f"ipc://{path}")
    try:
        assert path.stat().st_mode & 0o777 == 0o600
    finally:
        rt.run(srv.close())


# -- the pipelined client against our server --------------------------------------------------------
def test_pipelined_client_kv_and_ec(rt: Runtime, server: LookupServer) -> None:
    assert server.endpoint is not None
    kv = LookupClient(ZmqTransport(server.endpoint), PREFIX, runtime=rt, timeout=5.0)
    ec = LookupClient(ZmqTransport(server.endpoint), EXISTS, runtime=rt, timeout=5.0)
    try:
        for i in range(200):
            kv.submit(f"r{i}", HASHES[: i % 8 + 1])
        ec.submit("e", ["mm-a", "mm-b", "mm-a"])
        ec.submit("v", ["mm-a", "mm-long-name"])  # keys of different lengths
        results = {}
        wait_until(lambda: kv.metrics.completed == 200 and ec.metrics.completed == 2)
        for i in range(200):
            results[i] = kv.poll(f"r{i}")
        assert all(results[i] == min(i % 8 + 1, PRESENT) for i in range(200))
        assert ec.poll("e") == (True, False, True)
        assert ec.poll("v") == (True, False)
        assert kv.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
        wait_until(lambda: server.busy() == 0)
    finally:
        kv.close()
        ec.close()


class HungServer:
    """A ROUTER that reads every request and never answers (a wedged lookup server)."""

    def __init__(self, port: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.received: list[list[bytes]] = []

    def pump(self) -> int:
        while self.sock.poll(0):
            self.received.append(self.sock.recv_multipart())
        return len(self.received)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def test_hung_server_polls_not_yet_then_miss(rt: Runtime) -> None:
    port = free_port()
    hung = HungServer(port)
    client = LookupClient(ZmqTransport(f"tcp://127.0.0.1:{port}"), PREFIX, runtime=rt, timeout=0.3)
    try:
        client.submit("r", HASHES[:3])
        wait_until(lambda: hung.pump() == 1)
        assert client.poll("r") is None  # the server has it and is silent
        wait_until(lambda: client.metrics.timeouts == 1)
        assert client.poll("r") == 0
        # a reply that finally comes for the timed-out id is dropped
        identity, empty, id_frame, *_ = hung.received[0]
        hung.sock.send_multipart([identity, empty, id_frame, struct.pack(">I", 3)])
        wait_until(lambda: client.metrics.stale == 1)
        assert client.poll("r") is None
    finally:
        client.close()
        hung.close()


def test_ten_thousand_outstanding_on_a_hung_server_released_after_discard(rt: Runtime) -> None:
    port = free_port()
    hung = HungServer(port)
    client = LookupClient(ZmqTransport(f"tcp://127.0.0.1:{port}"), PREFIX, runtime=rt, timeout=60.0)
    try:
        for i in range(10_000):
            client.submit(f"r{i}", HASHES[:4])
        wait_until(lambda: hung.pump() == 10_000)
        assert client.held()["inflight"] == 10_000
        for i in range(10_000):
            assert client.discard(f"r{i}")
        wait_until(lambda: client.held()["inflight"] == 0)
        assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    finally:
        client.close()
        hung.close()


def test_dead_server_polls_not_yet_then_miss(rt: Runtime) -> None:
    client = LookupClient(ZmqTransport(f"tcp://127.0.0.1:{free_port()}"), PREFIX, runtime=rt, timeout=0.3)
    try:
        client.submit("r", HASHES[:3])
        assert client.poll("r") is None
        wait_until(lambda: client.metrics.timeouts == 1)
        assert client.poll("r") == 0
    finally:
        client.close()


def test_restarted_server_client_reconnects(rt: Runtime) -> None:
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    srv = start_server(rt, bind=endpoint)
    client = LookupClient(ZmqTransport(endpoint), PREFIX, runtime=rt, timeout=0.5)
    try:
        assert client.lookup_sync("a", HASHES) == PRESENT
        rt.run(srv.close())
        client.submit("down", HASHES)
        assert client.poll("down") is None
        wait_until(lambda: client.metrics.timeouts == 1)
        assert client.poll("down") == 0
        srv = start_server(rt, bind=endpoint)
        # the DEALER reconnects by itself; lookups are answered again
        wait_until(lambda: client.lookup_sync(f"b{time.monotonic()}", HASHES) == PRESENT)
        assert client.held()["inflight"] == 0
    finally:
        client.close()
        rt.run(srv.close())


def test_a_burst_larger_than_max_keys_is_split_into_store_calls(rt: Runtime) -> None:
    srv = start_server(rt, max_keys=8)
    assert srv.endpoint is not None
    client = LookupClient(ZmqTransport(srv.endpoint), PREFIX, runtime=rt, timeout=5.0)
    try:
        for i in range(50):
            client.submit(f"r{i}", HASHES)  # 8 keys each: a drained burst is many times max_keys
        wait_until(lambda: client.metrics.completed == 50)
        assert {client.poll(f"r{i}") for i in range(50)} == {PRESENT}
        assert srv.stats.errors == 0
    finally:
        client.close()
        rt.run(srv.close())
