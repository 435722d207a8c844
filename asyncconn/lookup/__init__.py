"""Store lookups for vLLM's scheduler: a pipelined, time-bounded client, its transports and the ZMQ server.

``LookupClient`` is what the scheduler-side adapters hold: ``lookup(request_id, keys)`` returns ``None``
("ask again next step") until the store has answered, then the answer exactly once; ``discard`` on finish,
abort or preemption. ``open_lookup_client(LookupConfig(...), PREFIX | EXISTS)`` picks the transport from
configuration. ``LookupServer`` answers vLLM's Mooncake lookup framing and our pipelined one.
"""

from __future__ import annotations

from asyncconn.lookup.client import DEFAULT_TIMEOUT, EXISTS, PREFIX, LookupClient, Mode
from asyncconn.lookup.config import LookupConfig, open_lookup_client
from asyncconn.lookup.metrics import LATENCY_BUCKETS_MS, LatencyHistogram, LookupMetrics
from asyncconn.lookup.protocol import Kind, store_key
from asyncconn.lookup.server import DEFAULT_BIND, LookupServer, ServerStats
from asyncconn.lookup.transports import DirectTransport, LookupTransport, ZmqTransport

__all__ = [
    "DEFAULT_BIND",
    "DEFAULT_TIMEOUT",
    "EXISTS",
    "LATENCY_BUCKETS_MS",
    "PREFIX",
    "DirectTransport",
    "Kind",
    "LatencyHistogram",
    "LookupClient",
    "LookupConfig",
    "LookupMetrics",
    "LookupServer",
    "LookupTransport",
    "Mode",
    "ServerStats",
    "ZmqTransport",
    "open_lookup_client",
    "store_key",
]
