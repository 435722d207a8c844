"""The lookup server's bound on connections (``max_connections``), on real sockets.

Each client socket carries a monitor, so a test sees the server's verdict on its handshake itself --
admitted, or refused (libzmq's ``HANDSHAKE_FAILED_AUTH`` with ZAP status 400) -- instead of inferring a
refusal from a reply that never came.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import parse_monitor_message

from asyncconn.lookup import LookupServer, store_key
from asyncconn.lookup.curve import CurveClientKeys, CurveServerKeys, load_key
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.descriptors import HAVE_PROC_FDS, open_descriptors
from tests.lookup.fakes import wait_until

HASHES = [bytes([i]) * 32 for i in range(4)]
HIT = struct.pack(">I", 64)  # all four blocks stored, 16 tokens each
_OUTCOMES = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)
ADMITTED = (zmq.EVENT_HANDSHAKE_SUCCEEDED, 0)
REFUSED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400)


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-connections-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


def _start(rt: Runtime, **kw) -> LookupServer:
    async def go() -> LookupServer:
        store = await TensorStore.open("memory://connections")
        await store.backend.put([(store_key("kv/", h), b"v") for h in HASHES])
        server = LookupServer(store, "tcp://127.0.0.1:*", key_prefix="kv/", **kw)
        await server.start()
        return server

    return rt.run(go())


def _stop(rt: Runtime, server: LookupServer, timeout: float | None = None) -> None:
    async def go() -> None:
        await server.close()
        await server.store.close()

    rt.run(go(), timeout=timeout)


class _Clients:
    """Client sockets of one context, each with a monitor; ``close`` stops every monitor before its socket
    (an event sent to a closed monitor would block libzmq's I/O thread and hang ``term``)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.peers: list[_Peer] = []

    def open(self, endpoint: str, kind: int = zmq.REQ, curve: CurveClientKeys | None = None) -> _Peer:
        peer = _Peer(self.ctx, kind, endpoint, curve)
        self.peers.append(peer)
        return peer

    def close(self) -> None:
        for peer in self.peers:
            peer.close()
        self.ctx.term()


class _Peer:
    def __init__(self, ctx: zmq.Context, kind: int, endpoint: str, curve: CurveClientKeys | None) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 5000)  # a reply that never comes fails the test, never hangs it
        if curve is not None:
            self.sock.curve_serverkey = curve.server_public
            public, secret = (curve.public, curve.secret) if curve.public else zmq.curve_keypair()
            self.sock.curve_publickey, self.sock.curve_secretkey = public, secret
        self.monitor = self.sock.get_monitor_socket(_OUTCOMES)
        self.monitor.setsockopt(zmq.RCVTIMEO, 5000)
        self.sock.connect(endpoint)
        self.closed = False

    def handshake(self) -> tuple[int, int]:
        """The server's verdict on this socket's first handshake: (event, value)."""
        event = parse_monitor_message(self.monitor.recv_multipart())
        return int(event["event"]), int(event["value"])

    def ask(self) -> bytes:
        if self.sock.type == zmq.DEALER:
            self.sock.send_multipart([b"", *encode_mooncake_lookup(64, HASHES)])
            return bytes(self.sock.recv_multipart()[-1])
        self.sock.send_multipart(encode_mooncake_lookup(64, HASHES))
        return bytes(self.sock.recv())

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)


@pytest.fixture
def clients() -> Iterator[_Clients]:
    made = _Clients()
    try:
        yield made
    finally:
        made.close()


def _admit(clients: _Clients, endpoint: str, n: int, kind: int = zmq.REQ) -> list[_Peer]:
    """``n`` clients, one after the other, each admitted and answered."""
    peers = []
    for _ in range(n):
        peer = clients.open(endpoint, kind)
        assert peer.handshake() == ADMITTED
        assert peer.ask() == HIT
        peers.append(peer)
    return peers


def _unanswered(peers: list[_Peer], wait_ms: int = 100) -> bool:
    """No reply to any of ``peers`` (their connections are already closed: this only double-checks)."""
    poller = zmq.Poller()
    for peer in peers:
        poller.register(peer.sock, zmq.POLLIN)
    return not poller.poll(wait_ms)


def test_connections_past_the_bound_are_refused_at_the_handshake_and_the_admitted_are_answered(
    rt: Runtime, clients: _Clients, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's plain REQ clients: three admitted and answered; four more are refused at their handshake
    and closed by the server -- never read, never answered -- while the three keep being answered."""
    server = _start(rt, max_connections=3, log_interval=60.0)
    try:
        assert server.endpoint is not None
        admitted = _admit(clients, server.endpoint, 3)
        requests = server.stats.requests
        with caplog.at_level(logging.WARNING, logger="asyncconn.lookup.server"):
            extra = [clients.open(server.endpoint) for _ in range(4)]
            for peer in extra:
                # Queued on the connection (never read), or refused already: a REQ socket left with no
                # connection would block its send until one came, and none will.
                with contextlib.suppress(zmq.Again):
                    peer.sock.send_multipart(encode_mooncake_lookup(64, HASHES), flags=zmq.NOBLOCK)
            assert [peer.handshake() for peer in extra] == [REFUSED] * 4
            wait_until(lambda: server.stats.connections == 3)  # the refused ones are closed
        assert server.stats.connections_refused == 4
        assert _unanswered(extra)
        assert server.stats.requests == requests  # nothing of theirs was read
        assert [peer.ask() for peer in admitted] == [HIT] * 3
        lines = [r.getMessage() for r in caplog.records if "connections refused" in r.getMessage()]
        assert len(lines) == 1, lines  # logged at a bounded rate, with the count
    finally:
        _stop(rt, server)


def test_closing_connections_lets_new_ones_in_again(rt: Runtime, clients: _Clients) -> None:
    server = _start(rt, max_connections=2)
    try:
        endpoint = server.endpoint
        assert endpoint is not None
        first, second = _admit(clients, endpoint, 2, zmq.DEALER)
        assert clients.open(endpoint).handshake() == REFUSED
        first.close()
        wait_until(lambda: server.stats.connections == 1)  # the count goes back down
        (third,) = _admit(clients, endpoint, 1)
        assert clients.open(endpoint).handshake() == REFUSED
        second.close()
        third.close()
        wait_until(lambda: server.stats.connections == 0)
        _admit(clients, endpoint, 2)
        assert server.stats.connections_refused == 2
    finally:
        _stop(rt, server)


def test_a_flood_of_connections_is_held_to_the_bound(rt: Runtime, clients: _Clients) -> None:
    """100 DEALERs connect at once to a server admitting 8: at most 8 get in (connections still in their
    handshake count, so a burst may get fewer), each of those is answered, every other is refused and
    closed. Without the bound all 100 would be admitted."""
    server = _start(rt, max_connections=8)
    try:
        endpoint = server.endpoint
        assert endpoint is not None
        flood = [clients.open(endpoint, zmq.DEALER) for _ in range(100)]
        verdicts = [peer.handshake() for peer in flood]
        admitted = [peer for peer, verdict in zip(flood, verdicts, strict=True) if verdict == ADMITTED]
        assert verdicts.count(REFUSED) == 100 - len(admitted)
        assert len(admitted) <= 8
        wait_until(lambda: server.stats.connections == len(admitted))
        assert server.stats.connections_refused == 100 - len(admitted)
        assert [peer.ask() for peer in admitted] == [HIT] * len(admitted)
        for peer in flood:
            peer.close()
        wait_until(lambda: server.stats.connections == 0)
        _admit(clients, endpoint, 8)
    finally:
        _stop(rt, server)


def test_raw_tcp_connections_count_before_their_handshake(rt: Runtime, clients: _Clients) -> None:
    """Plain TCP connections that never send a ZMTP greeting hold the server's descriptors too: they count,
    so a ZMTP client arriving meanwhile is refused; once they close it gets in."""
    server = _start(rt, max_connections=3)
    try:
        assert server.endpoint is not None
        host, port = server.endpoint.removeprefix("tcp://").rsplit(":", 1)
        raw = [socket.create_connection((host, int(port)), timeout=5) for _ in range(3)]
        try:
            wait_until(lambda: server.stats.connections == 3)
            assert clients.open(server.endpoint).handshake() == REFUSED
        finally:
            for sock in raw:
                sock.close()
        wait_until(lambda: server.stats.connections == 0)
        _admit(clients, server.endpoint, 3)
    finally:
        _stop(rt, server)


def test_a_curve_server_with_the_bound_still_refuses_clients_it_does_not_know(
    rt: Runtime, clients: _Clients, tmp_path: Path
) -> None:
    allowed_dir, other_dir = tmp_path / "allowed", tmp_path / "other"
    allowed_dir.mkdir()
    other_dir.mkdir()
    _, good_file = zmq.auth.create_certificates(str(allowed_dir), "client")
    _, stranger_file = zmq.auth.create_certificates(str(other_dir), "stranger")
    keys = CurveServerKeys.generate(clients_dir=allowed_dir)
    good = CurveClientKeys(keys.public, load_key(good_file), load_key(good_file, secret=True))
    stranger = CurveClientKeys(keys.public, load_key(stranger_file), load_key(stranger_file, secret=True))
    server = _start(rt, curve=keys, max_connections=2)
    try:
        endpoint = server.endpoint
        assert endpoint is not None
        assert clients.open(endpoint, curve=stranger).handshake() == REFUSED  # by the allow-list
        assert clients.open(endpoint).handshake() != ADMITTED  # plaintext client
        wrong_server = CurveClientKeys(CurveServerKeys.generate().public)
        assert clients.open(endpoint, curve=wrong_server).handshake() != ADMITTED
        assert server.stats.connections_refused == 0  # none of those was refused by the bound
        wait_until(lambda: server.stats.connections == 0)  # and each was closed
        members = [clients.open(endpoint, curve=good) for _ in range(2)]
        assert [peer.handshake() for peer in members] == [ADMITTED] * 2
        assert [peer.ask() for peer in members] == [HIT] * 2
        assert clients.open(endpoint, curve=good).handshake() == REFUSED  # by the bound
        assert server.stats.connections_refused == 1
        members[0].close()
        wait_until(lambda: server.stats.connections == 1)
        assert clients.open(endpoint, curve=stranger).handshake() == REFUSED  # a free slot admits no stranger
        wait_until(lambda: server.stats.connections == 1)
        late = clients.open(endpoint, curve=good)
        assert late.handshake() == ADMITTED
        assert late.ask() == HIT
        assert server.stats.connections_refused == 1
    finally:
        _stop(rt, server)


@pytest.mark.skipif(not HAVE_PROC_FDS, reason="counts descriptors in /proc")
def test_close_releases_the_monitor_and_the_zap_handler(rt: Runtime) -> None:
    """The gate's sockets are the context's: a socket left open would hang ``close`` (the context's term)
    or leave descriptors behind. Start, serve connections, close -- three times -- and count descriptors."""

    def cycle() -> None:
        server = _start(rt, max_connections=1)
        made = _Clients()
        try:
            assert server.endpoint is not None
            _admit(made, server.endpoint, 1)
            assert made.open(server.endpoint).handshake() == REFUSED
        finally:
            made.close()
            _stop(rt, server, timeout=10)  # a socket left open blocks the context's term: fail, not hang
        assert server.stats.connections == 0

    cycle()  # first use creates what lives for the process (the memory store's registry, loggers)
    before = open_descriptors()
    for _ in range(3):
        cycle()
    assert open_descriptors() == before


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_cli_max_connections_reaches_the_server() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            "memory://cli-connections",
            "--bind",
            "tcp://127.0.0.1:*",
            "--max-connections",
            "1",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    made = _Clients()
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().split()[-1]
        first = made.open(endpoint)
        assert first.handshake() == ADMITTED
        first.sock.send_multipart(encode_mooncake_lookup(64, HASHES))
        assert first.sock.recv() == b"\x00\x00\x00\x00"  # an empty store: no hit
        assert made.open(endpoint).handshake() == REFUSED
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        made.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
