"""The ZMQ lookup server: answers Mooncake-framed and pipelined lookups from one store, on one asyncio loop.

One ROUTER socket serves every client. A plain REQ client written for vLLM's Mooncake store works
unchanged; DEALER clients put an id frame in front and get replies out of order (see ``protocol``).

Bounded by what it holds, not by how many messages it read. The reader never stops reading (ZMQ's
queues stay short, so ZMQ's own buffers stay small); each request read is *held* -- queued for its
client, then answered -- and counted by its bytes. Two budgets bound the server:

- ``max_bytes``: request bytes held at once (queued + being answered). A request that would pass it
  sheds one: the newest queued request of the client holding the most queued bytes (the arriving one
  when that is its own sender), answered ``ERROR`` at once. So a flooding client loses its own
  requests first and a light client keeps its place.
- ``max_inflight_keys``: keys being looked up in the store at once (the Python objects, store keys and
  store commands of a lookup are per key). Queued requests are admitted round-robin, one per client per
  turn, whenever their keys fit. The last ``batch_keys`` keys of it are kept for requests of at most
  ``batch_keys`` keys, so light clients are answered at once while a flood of large lookups is served.

Admitted requests are answered in batches (at most ``max_batch`` requests or ``batch_keys`` keys each,
a larger request alone), each its own task, with store calls of at most ``batch_keys`` keys made one
after the other. ``max_clients`` bounds the clients
with requests held (a new client past it is answered ``ERROR``); ZMQ queues at most ``QUEUE_HWM`` messages per
connection each way.

``max_connections`` bounds the connections themselves (each costs a file descriptor and libzmq's buffers,
and libzmq accepts every one offered). The ROUTER's monitor counts the open connections -- handshaking ones
included -- and a ZAP handler (``lookup.gate``; under CURVE the same handler checks the client allow-list
first) refuses, at its handshake, a connection that finds more than ``max_connections`` open: libzmq sends
the peer ZMTP ``ERROR`` and closes it at once, and a libzmq client does not reconnect that socket. So at
most ``max_connections`` connections are ever past their handshake; one still in it is dropped by libzmq
after ``ZMQ_HANDSHAKE_IVL`` (30 s). ``ServerStats.connections`` is the open count now,
``connections_refused`` the refusals (logged like the other kinds below).

Every request read gets exactly one reply -- REQ clients (vLLM's) wait for it forever otherwise: the
answer, or ``ERROR`` when it is malformed, shed, or its batch failed in any way (the store, a
``MemoryError``, a bug). Malformed requests, sheds and failed batches are counted in
:class:`ServerStats` and logged at most once per ``log_interval`` per kind, with the count since.

Mooncake ``lookup`` semantics: vLLM's client sends the block-aligned token count and the prompt's block
hashes in order, so the hit length is the number of leading present blocks times ``block_size`` (tokens
per block hash, a server option that must match the engine), capped at the token count -- the cap matters
when hashes are finer than the scheduler's block (hybrid models), where they can cover a few tokens past
the aligned count. No (group, boundary) entries are appended (one KV cache group).

Metrics: with ``metrics_port`` the server also serves its counters in Prometheus text format at
``http://metrics_host:metrics_port/metrics`` (``lookup.exporter``: series ``asyncconn_lookup_*``, on the
server's loop, closed with it); off by default.

``reset`` asks for a wipe of the store (vLLM uses it between RL weight updates). A storage backend has no
"delete everything" operation and one store may be shared, so by default the server answers ``ERROR``
(not applied) -- never a false "ok" that would let stale KV be served. ``on_reset`` may implement it.

Safety: every message is parsed by ``protocol.parse_body`` with size caps. ``MAXMSGSIZE`` drops
(disconnects) a peer that sends a frame larger than ``max_message`` before it is buffered. Binds loopback
/ ipc by default; an ipc socket file is made ``0600``; a non-loopback TCP bind needs CURVE keys
(``curve``, see ``lookup.curve``) and is refused without them unless ``insecure=True`` (then it is
logged as a warning).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from asyncconn._deprecated import renamed_method
from asyncconn.exceptions import AsyncConnError, ConfigError, LookupProtocolError
from asyncconn.lookup import curve as curve_keys
from asyncconn.lookup import protocol
from asyncconn.lookup.gate import ZAP_DOMAIN, ConnectionGate
from asyncconn.lookup.metrics import LatencyHistogram
from asyncconn.lookup.protocol import Kind, Query
from asyncconn.lookup.transports import leading, send_nowait
from asyncconn.store import TensorStore

if TYPE_CHECKING:
    from asyncconn.lookup.exporter import MetricsEndpoint

__all__ = ["DEFAULT_BIND", "LookupServer", "ServerStats"]

log = logging.getLogger(__name__)

DEFAULT_BIND = "tcp://127.0.0.1:5570"
#: Request bytes held at once (queued + being answered).
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: Keys looked up in the store at once: the largest request plus the small-request reserve, twice over.
DEFAULT_MAX_INFLIGHT_KEYS = 2 * protocol.DEFAULT_MAX_KEYS
DEFAULT_MAX_CLIENTS = 1024
#: Connections open at once (every vLLM engine holds one; the rest is headroom).
DEFAULT_MAX_CONNECTIONS = 1024
#: The largest frame: 65,536 32-byte block hashes are 2 MiB.
DEFAULT_MAX_MESSAGE = 4 * 1024 * 1024
#: Where the opt-in /metrics endpoint listens (loopback: the counters are for the host's Prometheus agent).
DEFAULT_METRICS_HOST = "127.0.0.1"
#: Messages ZMQ queues per connection, each way. The reader drains its side continuously, so it holds a
#: few at most; it bounds what a client that stops reading its replies can park in the server.
QUEUE_HWM = 1000


@dataclass
class ServerStats:
    """Counters since start (plain ints, loop thread writes, any thread reads).

    ``errors``: malformed or oversized requests; ``store_errors``: batches whose store call failed;
    ``shed``: requests answered ``ERROR`` because a bound was reached; ``failed``: requests answered
    ``ERROR`` because their batch raised something unexpected (``MemoryError`` included);
    ``connections``: not a counter -- connections open now (handshaking ones included);
    ``connections_refused``: connections refused at their handshake because ``max_connections`` were open.
    """

    requests: int = 0
    lookups: int = 0
    resets: int = 0
    errors: int = 0
    store_errors: int = 0
    batches: int = 0
    dropped_replies: int = 0
    shed: int = 0
    failed: int = 0
    connections: int = 0
    connections_refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class _Request:
    """One request read and not yet answered; ``body`` is dropped once parsed."""

    __slots__ = ("body", "client", "id_frame", "keys", "nbytes", "replied", "route", "t0")

    def __init__(
        self,
        client: _Client,
        route: list[bytes],
        id_frame: bytes | None,
        body: list[bytes],
        nbytes: int,
        max_keys: int,
    ) -> None:
        self.client = client
        self.route = route
        self.id_frame = id_frame
        self.body: Sequence[bytes] = body
        self.nbytes = nbytes
        # what it may cost in the store; over max_keys it is rejected before any store call
        self.keys = min(_key_bound(body), max_keys)
        self.replied = False
        self.t0 = time.monotonic()  # read: its answer's latency runs from here


class _Client:
    """What one peer (one ROUTER identity) holds: its queue and its share of the budgets."""

    __slots__ = ("identity", "inflight", "queue", "queued_bytes")

    def __init__(self, identity: bytes) -> None:
        self.identity = identity
        self.queue: deque[_Request] = deque()
        self.queued_bytes = 0
        self.inflight = 0  # requests of this client being answered


class _Throttled:
    """Log one line per kind per ``interval`` at most, with how many happened since the last line.

    Why: a hostile or broken client can send thousands of bad requests a second; one log line each
    would turn it into a disk-filling attack on the operator.
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self._count: dict[str, int] = {}
        self._last: dict[str, float] = {}

    def note(self, kind: str, detail: object) -> None:
        self._count[kind] = self._count.get(kind, 0) + 1
        now = time.monotonic()
        if now - self._last.get(kind, -1e18) >= self.interval:
            log.warning(
                "lookup server: %d %s since the last report; latest: %s", self._count[kind], kind, detail
            )
            self._count[kind] = 0
            self._last[kind] = now


class LookupServer:
    """Serve lookups from ``store`` on ``bind``: ``start()`` then ``close()``, or ``serve_forever()``."""

    def __init__(
        self,
        store: TensorStore,
        bind: str = DEFAULT_BIND,
        *,
        block_size: int = 16,
        key_prefix: str = "",
        max_keys: int = protocol.DEFAULT_MAX_KEYS,
        max_message: int = DEFAULT_MAX_MESSAGE,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_inflight_keys: int = DEFAULT_MAX_INFLIGHT_KEYS,
        max_clients: int = DEFAULT_MAX_CLIENTS,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_batch: int = 512,
        batch_keys: int = 8192,
        max_inflight: int = 64,
        log_interval: float = 10.0,
        on_reset: Callable[[], bool] | None = None,
        curve: curve_keys.CurveServerKeys | None = None,
        insecure: bool = False,
        metrics_port: int = 0,
        metrics_host: str = DEFAULT_METRICS_HOST,
    ) -> None:
        for name, value in (
            ("block_size", block_size),
            ("max_keys", max_keys),
            ("max_message", max_message),
            ("max_bytes", max_bytes),
            ("max_inflight_keys", max_inflight_keys),
            ("max_clients", max_clients),
            ("max_connections", max_connections),
            ("max_batch", max_batch),
            ("batch_keys", batch_keys),
            ("max_inflight", max_inflight),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"lookup server: {name} must be an integer > 0, got {value!r}")
        if type(metrics_port) is not int or not 0 <= metrics_port <= 65535:  # bool is not a port
            raise ConfigError(
                f"lookup server: metrics_port must be a port 0-65535 (0: off), got {metrics_port!r}"
            )
        if max_inflight_keys < max_keys + batch_keys:
            raise ConfigError(
                f"lookup server: max_inflight_keys ({max_inflight_keys}) must be >= max_keys + batch_keys "
                f"({max_keys} + {batch_keys}), or the largest request could never be answered"
            )
        if max_bytes < max_message:
            raise ConfigError(
                f"lookup server: max_bytes ({max_bytes}) must be >= max_message ({max_message}), "
                "or the largest request would always be shed"
            )
        self.store = store
        self.bind = bind
        self.block_size = block_size
        self.key_prefix = key_prefix
        self.max_keys = max_keys
        self.max_message = max_message
        self.max_bytes = max_bytes
        self.max_inflight_keys = max_inflight_keys
        self.max_clients = max_clients
        self.max_connections = max_connections
        self.max_batch = max_batch
        self.batch_keys = batch_keys
        self.max_inflight = max_inflight
        self.stats = ServerStats()
        #: How long each request was held (read to answered, queueing included), on the metrics endpoint.
        self.latency = LatencyHistogram()
        self._on_reset = on_reset
        self._curve = curve
        self._insecure = insecure
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        #: ``http://HOST:PORT/metrics`` while the metrics endpoint serves; None when off or closed.
        self.metrics_url: str | None = None
        self._metrics: MetricsEndpoint | None = None
        self._gate: ConnectionGate | None = None
        self._throttle = _Throttled(log_interval)
        self._clients: dict[bytes, _Client] = {}
        self._ready: deque[_Client] = deque()  # clients with a queued request, in round-robin order
        self._held_bytes = 0
        self._inflight_keys = 0
        self.peak_bytes = 0
        self.peak_keys = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self.endpoint: str | None = None

    async def start(self) -> str:
        """Bind and start serving; return the bound endpoint (the real port for ``tcp://host:*``)."""
        if not curve_keys.is_loopback(self.bind) and self._curve is None:
            if not self._insecure:
                raise ConfigError(
                    f"lookup server: {self.bind!r} is reachable beyond this host: give CURVE keys, "
                    "or pass insecure=True (--insecure) to serve it without authentication"
                )
            log.warning(
                "lookup server: binding %s, reachable beyond this host; it has no authentication", self.bind
            )
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            # The ZAP handler must be bound on the context before the socket binds (libzmq consults it
            # from the first handshake on).
            self._gate = ConnectionGate(
                ctx,
                self.max_connections,
                on_change=self._connections_changed,
                on_refused=self._connection_refused,
            )
            self._gate.start()
            if self._curve is not None:
                curve_keys.configure_authenticator(self._gate, self._curve, ZAP_DOMAIN)
                curve_keys.apply_server(sock, self._curve)
            self._gate.watch(sock)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_message)
            sock.setsockopt(zmq.SNDHWM, QUEUE_HWM)
            sock.setsockopt(zmq.RCVHWM, QUEUE_HWM)
            sock.bind(self.bind)
            endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            if endpoint.startswith("ipc://"):
                os.chmod(endpoint[len("ipc://") :], 0o600)
        except (zmq.ZMQError, OSError) as exc:
            self._close_gate()
            sock.close(0)
            ctx.term()
            raise ConfigError(f"lookup server: cannot bind {self.bind!r}: {exc}") from None
        self._ctx, self._sock, self.endpoint = ctx, sock, endpoint
        if self.metrics_port:
            try:
                self.metrics_url = await self._start_metrics()
            except OSError as exc:
                await self.close()
                raise ConfigError(
                    f"lookup server: cannot serve metrics on {self.metrics_host}:{self.metrics_port}: {exc}"
                ) from None
            log.info("lookup server: metrics on %s", self.metrics_url)
        self._reader = asyncio.get_running_loop().create_task(self._read())
        log.info("lookup server: serving %s on %s", self.store.name, endpoint)
        return endpoint

    async def _start_metrics(self) -> str:
        # Imported here: prometheus_client is needed only by a server that exports.
        from prometheus_client import CollectorRegistry

        from asyncconn.lookup.exporter import LookupServerCollector, MetricsEndpoint

        registry = CollectorRegistry()  # private: only this server's series, nothing process-wide
        registry.register(LookupServerCollector(self.stats.as_dict, self.held, lambda: self.latency))
        self._metrics = MetricsEndpoint(registry)
        return await self._metrics.start(self.metrics_host, self.metrics_port)

    def busy(self) -> int:
        """Batches being answered right now (tests count it back to zero)."""
        return len(self._tasks)

    counters = renamed_method("counters", "held")  # the old name, deprecated (docs/transfer.md)

    def held(self) -> dict[str, int]:
        """What the server holds now: request bytes, keys in the store, clients, queued requests."""
        return {
            "bytes": self._held_bytes,
            "keys": self._inflight_keys,
            "clients": len(self._clients),
            "queued": sum(len(c.queue) for c in self._clients.values()),
            "batches": len(self._tasks),
        }

    async def serve_forever(self) -> None:
        if self._reader is None:
            await self.start()
        assert self._reader is not None
        await self._reader

    async def close(self) -> None:
        """Stop reading, cancel batches in flight, close the socket. The store stays open (caller owns it)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        metrics, self._metrics = self._metrics, None
        self.metrics_url = None
        if metrics is not None:
            await metrics.close()
        self._close_gate()  # before the socket: the gate stops the socket's monitor first
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close(0)
        self._clients.clear()
        self._ready.clear()
        self._held_bytes = self._inflight_keys = 0
        ctx, self._ctx = self._ctx, None
        if ctx is not None:
            ctx.term()

    def _close_gate(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate.close()

    # -- connections (the gate calls these on the loop) -----------------------------------------------
    def _connections_changed(self, connections: int) -> None:
        self.stats.connections = connections

    def _connection_refused(self, connections: int) -> None:
        self.stats.connections_refused += 1
        self._throttle.note(
            "connections refused", f"{connections} connections open, max_connections {self.max_connections}"
        )

    # -- reading and admission -----------------------------------------------------------------------
    async def _read(self) -> None:
        sock = self._sock
        assert sock is not None
        shadow: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        while True:
            first = await sock.recv_multipart()
            burst = [first]
            while len(burst) < self.max_batch:
                try:
                    burst.append(shadow.recv_multipart(zmq.NOBLOCK))
                except zmq.ZMQError:
                    break
            for frames in burst:
                self._accept(frames)
            del burst, first
            self._dispatch()
            # A receive that finds a message ready completes without yielding: under a flood the batches
            # would never run. Yield once per burst.
            await asyncio.sleep(0)

    def _accept(self, frames: list[bytes]) -> None:
        """Queue one request for its client, or answer it ``ERROR`` at once (malformed, or a bound)."""
        self.stats.requests += 1
        route, id_frame, body = _split(frames)
        if body is None:  # not even an envelope we can answer properly: answer what we can
            self.stats.errors += 1
            self._throttle.note("malformed requests", "bad envelope")
            self._send(route, None, protocol.ERROR)
            return
        identity = route[0]
        client = self._clients.get(identity)
        if client is None:
            if len(self._clients) >= self.max_clients:
                self._shed_now(route, id_frame, f"{self.max_clients} clients already have requests held")
                return
            client = self._clients[identity] = _Client(identity)
        nbytes = sum(len(f) for f in frames)
        request = _Request(client, route, id_frame, body, nbytes, self.max_keys)
        if not self._make_room(request):
            self._forget_if_idle(client)
            return
        client.queue.append(request)
        client.queued_bytes += nbytes
        self._held_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)
        if len(client.queue) == 1:
            self._ready.append(client)

    def _make_room(self, request: _Request) -> bool:
        """Shed queued requests of the heaviest client until ``request`` fits in ``max_bytes``.

        False when ``request`` itself is the one to shed (its client is the heaviest, or nothing queued
        can be shed because everything held is being answered).
        """
        client = request.client
        while self._held_bytes + request.nbytes > self.max_bytes:
            heaviest = max(self._clients.values(), key=lambda c: c.queued_bytes)
            if heaviest is client or heaviest.queued_bytes <= client.queued_bytes + request.nbytes:
                self._shed_now(request.route, request.id_frame, f"{self.max_bytes} request bytes held")
                return False
            victim = heaviest.queue.pop()
            heaviest.queued_bytes -= victim.nbytes
            self._held_bytes -= victim.nbytes
            if not heaviest.queue:
                self._ready.remove(heaviest)
            self._shed_now(victim.route, victim.id_frame, f"{self.max_bytes} request bytes held")
            self._forget_if_idle(heaviest)
        return True

    def _shed_now(self, route: list[bytes], id_frame: bytes | None, why: str) -> None:
        self.stats.shed += 1
        self._throttle.note("requests shed", why)
        self._send(route, id_frame, protocol.ERROR)

    def _forget_if_idle(self, client: _Client) -> None:
        if not client.queue and not client.inflight:
            self._clients.pop(client.identity, None)

    def _dispatch(self) -> None:
        """Admit queued requests, one per client per turn, while their keys fit; answer them in batches."""
        if self._sock is None:
            return
        batch: list[_Request] = []
        batch_keys = 0
        waiting: list[_Client] = []  # clients whose next request does not fit now: first in line next time
        while self._ready and len(self._tasks) < self.max_inflight:
            client = self._ready.popleft()
            request = client.queue[0]
            # The last batch_keys keys of the budget are kept for small requests: however many large ones
            # wait, a small one is admitted at once.
            room = self.max_inflight_keys - (self.batch_keys if request.keys > self.batch_keys else 0)
            if self._inflight_keys + request.keys > room:
                waiting.append(client)
                continue
            client.queue.popleft()
            client.queued_bytes -= request.nbytes
            client.inflight += 1
            self._inflight_keys += request.keys
            if client.queue:
                self._ready.append(client)
            if batch and (len(batch) >= self.max_batch or batch_keys + request.keys > self.batch_keys):
                self._launch(batch)
                batch, batch_keys = [], 0
            batch.append(request)
            batch_keys += request.keys
        if batch:
            self._launch(batch)
        self._ready.extendleft(reversed(waiting))
        self.peak_keys = max(self.peak_keys, self._inflight_keys)

    def _launch(self, batch: list[_Request]) -> None:
        task = asyncio.get_running_loop().create_task(self._answer(batch))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._finished(t, batch))

    def _finished(self, task: asyncio.Task[None], batch: list[_Request]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # _answer catches everything; defensive
            self._fail(batch, task.exception())
        for request in batch:
            client = request.client
            client.inflight -= 1
            self._held_bytes -= request.nbytes
            self._inflight_keys -= request.keys
            self._forget_if_idle(client)
        if self._sock is not None and not task.cancelled():
            self._dispatch()

    # -- answering -----------------------------------------------------------------------------------
    async def _answer(self, batch: list[_Request]) -> None:
        """Answer every request of ``batch``, each exactly once, whatever happens (cancellation aside)."""
        try:
            await self._answer_batch(batch)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # MemoryError, a bug: every request still gets an ERROR reply
            self._fail(batch, exc)

    def _fail(self, batch: list[_Request], exc: BaseException | None) -> None:
        unanswered = [r for r in batch if not r.replied]
        self.stats.failed += len(unanswered)
        self._throttle.note("requests failed", f"{type(exc).__name__}: {exc}")
        for request in unanswered:
            self._reply(request, protocol.ERROR)

    async def _answer_batch(self, batch: list[_Request]) -> None:
        stats = self.stats
        stats.batches += 1
        parsed: list[tuple[_Request, Query | None]] = []
        for request in batch:
            query: Query | None = None
            try:
                query = protocol.parse_body(request.body, max_keys=self.max_keys)
            except LookupProtocolError as exc:
                stats.errors += 1
                self._throttle.note("malformed requests", exc)
            request.body = ()  # the raw frames are not needed past here
            parsed.append((request, query))
        prefix = self.key_prefix
        flat = [protocol.store_key(prefix, k) for _, q in parsed if q is not None for k in q.keys]
        present: list[bool] | None = []
        # A large request is alone in its batch. Only its leading present keys count for lookup/prefix:
        # stop at the first store call that finds a miss.
        prefix_only = len(parsed) == 1 and parsed[0][1] is not None and parsed[0][1].kind is not Kind.EXISTS
        if flat:
            try:
                present = await self._exists(flat, prefix_only=prefix_only)
            except AsyncConnError as exc:
                stats.store_errors += 1
                self._throttle.note("store failures", f"{len(parsed)} requests answered with errors: {exc}")
                present = None
        del flat
        pos = 0
        for request, query in parsed:
            reply = protocol.ERROR
            if query is not None:
                n = len(query.keys)
                seg = present[pos : pos + n] if present is not None else None
                pos += n
                reply = self._reply_for(query, seg)
            self._reply(request, reply)

    def _reply(self, request: _Request, reply: bytes) -> None:
        if request.replied:
            return
        request.replied = True
        self.latency.observe(time.monotonic() - request.t0)
        self._send(request.route, request.id_frame, reply)

    def _send(self, route: list[bytes], id_frame: bytes | None, reply: bytes) -> None:
        sock = self._sock
        if sock is None:
            return
        frames = [*route, id_frame, reply] if id_frame is not None else [*route, reply]
        if not send_nowait(sock, frames):  # the peer's queue is full or it is gone
            self.stats.dropped_replies += 1

    async def _exists(self, keys: list[str], *, prefix_only: bool = False) -> list[bool]:
        """One store call per ``batch_keys`` keys, one after the other.

        Why not all at once: a store client builds and parses a large call in one go on the loop (redis-py
        packs every command of a pipeline before sending any), and the other batches -- small lookups of
        other clients among them -- wait for the loop meanwhile. Small calls interleave with them.
        With ``prefix_only`` (one lookup/prefix request: only its leading present keys count) the calls
        stop at the first that finds a miss; the keys not asked are reported absent.
        """
        step = self.batch_keys
        if len(keys) <= step:
            return await self.store.exists(keys)
        present: list[bool] = []
        for i in range(0, len(keys), step):
            present += await self.store.exists(keys[i : i + step])
            if prefix_only and not all(present[i:]):
                return present + [False] * (len(keys) - len(present))
        return present

    def _reply_for(self, query: Query, seg: list[bool] | None) -> bytes:
        kind = query.kind
        if kind is Kind.RESET:
            self.stats.resets += 1
            ok = self._on_reset() if self._on_reset is not None else False
            return protocol.OK if ok else protocol.ERROR
        if seg is None:
            return protocol.ERROR
        self.stats.lookups += 1
        if kind is Kind.EXISTS:
            return protocol.OK + bytes(seg)
        hit = leading(seg)
        if kind is Kind.LOOKUP:
            return protocol.encode_u32(min(hit * self.block_size, query.token_count))
        return protocol.encode_u32(hit)


def _key_bound(body: Sequence[bytes]) -> int:
    """The most keys ``body`` can hold, read without parsing it (what it may cost in the store).

    Fixed-size keys: the payload over the key size; variable-size: each key takes at least its 2-byte
    length. A malformed body may claim anything; it is rejected by the parser before any store call.
    """
    if len(body) != 4 or len(body[2]) != 2:
        return 0
    size = int.from_bytes(body[2], "big")
    return len(body[3]) // (size or 2)


def _split(frames: list[bytes]) -> tuple[list[bytes], bytes | None, list[bytes] | None]:
    """(route, id frame, body) of a ROUTER message; body None when the envelope itself is malformed.

    The route is the identity plus the empty delimiter REQ and our DEALER clients send; it is echoed back.
    """
    if len(frames) < 2 or frames[1] != b"":
        return frames[:1], None, None
    route, rest = frames[:2], frames[2:]
    if rest and protocol.parse_id(rest[0]) is not None:
        return route, rest[0], rest[1:]
    return route, None, rest
