"""The lookup server's counters in Prometheus text format, at ``GET /metrics``, served on the server's loop.

Opt-in (``LookupServer(metrics_port=...)``, ``asyncconn lookup-server --metrics-port``). Every series is
named ``asyncconn_lookup_<name>``: each :class:`~asyncconn.lookup.server.ServerStats` counter with
Prometheus' ``_total`` suffix, gauges for what the server holds now (:data:`GAUGES`), and the histogram of
how long requests were held, from read to answered (:data:`LATENCY`). They are read by a
custom collector on a private ``CollectorRegistry`` at each scrape -- nothing is copied on the serving path,
and nothing is added to the process-wide default registry (several servers may run in one process).

Why an asyncio handler and not ``prometheus_client.start_http_server``: that one serves from a daemon
thread (plus a thread per request) that would read the counters from another thread and outlive a closed
server while a slow client holds it. Here a scrape runs on the server's own loop, between batches, and
:meth:`MetricsEndpoint.close` stops the listener and every connection with the server. The handler is
small on purpose: one request per connection (``Connection: close``), a request head of at most 8 KiB read
within ``timeout``, at most ``max_connections`` scrapes at once (a connection past it is closed unanswered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from asyncconn.lookup.metrics import LATENCY_BOUNDS_S, LatencyHistogram

__all__ = ["COUNTERS", "GAUGES", "LATENCY", "PREFIX", "LookupServerCollector", "MetricsEndpoint"]

PREFIX = "asyncconn_lookup_"

#: ServerStats counter -> help text. Exposed as ``asyncconn_lookup_<name>_total``.
COUNTERS: dict[str, str] = {
    "requests": "requests read (every one gets exactly one reply)",
    "lookups": "requests answered from the store (lookup, prefix and exists)",
    "resets": "reset requests (answered with an error unless the server applies them)",
    "errors": "malformed or oversized requests, answered with an error",
    "store_errors": "batches whose store call failed (their requests answered with an error)",
    "batches": "batches of requests answered",
    "dropped_replies": "replies dropped because the client's queue was full or it was gone",
    "shed": "requests answered with an error because a bound (max_bytes, max_clients) was reached",
    "failed": "requests answered with an error because their batch raised unexpectedly",
    "connections_refused": "connections refused at their handshake because max_connections were open",
}
#: Gauge -> (where its value comes from: "stats" or "held", the key there; help text).
GAUGES: dict[str, tuple[str, str, str]] = {
    "connections": ("stats", "connections", "connections open now, handshaking ones included"),
    "held_bytes": ("held", "bytes", "request bytes held now (queued + being answered)"),
    "inflight_keys": ("held", "keys", "keys being looked up in the store now"),
    "clients": ("held", "clients", "clients with requests held now"),
    "queued_requests": ("held", "queued", "requests queued now, not yet admitted"),
    "running_batches": ("held", "batches", "batches being answered now"),
}

#: The histogram's name (``asyncconn_lookup_<name>``) and help text.
LATENCY = ("latency_seconds", "how long requests were held, from read to answered (queueing included)")
#: Its buckets' ``le`` labels: the lookup client's bounds, then ``+Inf``.
_LE = [*(repr(b) for b in LATENCY_BOUNDS_S), "+Inf"]

_HEAD_LIMIT = 8192


class LookupServerCollector:
    """A Prometheus collector reading ``stats()`` (counters), ``held()`` (gauges) and ``latency()`` (the
    histogram, where given) at each scrape."""

    def __init__(
        self,
        stats: Callable[[], Mapping[str, int]],
        held: Callable[[], Mapping[str, int]],
        latency: Callable[[], LatencyHistogram] | None = None,
    ) -> None:
        self._sources = {"stats": stats, "held": held}
        self._latency = latency

    def collect(self) -> Iterable[Metric]:
        stats = self._sources["stats"]()
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=stats[name])
        values = {"stats": stats, "held": self._sources["held"]()}
        for name, (source, key, doc) in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=values[source][key])
        if self._latency is not None:
            latency = self._latency()
            counts, total = list(latency.buckets), latency.sum  # copies: the loop may add meanwhile
            cumulative, buckets = 0, []
            for le, n in zip(_LE, counts, strict=True):
                cumulative += n
                buckets.append((le, cumulative))
            yield HistogramMetricFamily(PREFIX + LATENCY[0], LATENCY[1], buckets=buckets, sum_value=total)

    def describe(self) -> Iterable[Metric]:
        """The series this collector yields (the registry checks them for duplicates once, at register)."""
        for name, doc in COUNTERS.items():
            yield CounterMetricFamily(PREFIX + name, doc)
        for name, (_, _, doc) in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc)
        if self._latency is not None:
            yield HistogramMetricFamily(PREFIX + LATENCY[0], LATENCY[1])


class MetricsEndpoint:
    """``GET /metrics`` of ``registry`` over HTTP on the running loop: ``await start(host, port)``, then
    ``close()``.

    ``max_connections`` scrapes at once; ``timeout`` for reading one request and sending its reply.
    """

    def __init__(
        self, registry: CollectorRegistry, *, max_connections: int = 16, timeout: float = 5.0
    ) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.timeout = timeout
        self.url: str | None = None
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> str:
        """Listen on ``host:port``; return ``http://host:port/metrics``. ``OSError`` when it cannot bind."""
        server = await asyncio.start_server(self._serve, host, port, limit=_HEAD_LIMIT)
        self._server = server
        bound_host, bound_port = server.sockets[0].getsockname()[:2]
        self.url = f"http://{f'[{bound_host}]' if ':' in bound_host else bound_host}:{bound_port}/metrics"
        return self.url

    async def close(self) -> None:
        """Stop listening and end every connection (a scrape in progress is cut off)."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        if handlers:
            await asyncio.gather(*handlers, return_exceptions=True)
        if server is not None:
            await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._handlers) >= self.max_connections or self._server is None:
            writer.transport.abort()
            return
        self._handlers.add(task)
        try:
            async with asyncio.timeout(self.timeout):
                head = await reader.readuntil(b"\r\n\r\n")
                writer.write(self._respond(head))
                writer.close()  # one request per connection: flush the reply, then close
                await writer.wait_closed()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, OSError):
            pass  # a client that went away, sent too much, or too slowly: nothing more to do for it
        finally:
            self._handlers.discard(task)
            writer.transport.abort()  # a no-op once closed; else (an error, close()) drop it at once

    def _respond(self, head: bytes) -> bytes:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return _response(b"400 Bad Request", b"bad request\n")
        method, target = parts[0], parts[1]
        if target.split(b"?", 1)[0] != b"/metrics":
            return _response(b"404 Not Found", b"only /metrics is served here\n")
        if method not in (b"GET", b"HEAD"):
            return _response(b"405 Method Not Allowed", b"GET or HEAD\n", extra=b"Allow: GET, HEAD\r\n")
        body = generate_latest(self.registry)
        return _response(b"200 OK", body, CONTENT_TYPE_PLAIN_0_0_4.encode(), head_only=method == b"HEAD")


def _response(
    status: bytes,
    body: bytes,
    content_type: bytes = b"text/plain; charset=utf-8",
    *,
    extra: bytes = b"",
    head_only: bool = False,
) -> bytes:
    headers = (
        b"HTTP/1.1 "
        + status
        + b"\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\nConnection: close\r\n"
        + extra
        + b"\r\n"
    )
    return headers if head_only else headers + body
