"""Lookup counters and a fixed-bucket latency histogram, readable from any thread without locks.

Each counter has one writer (the caller's thread writes ``submitted``/``discards``/``rejected``; the loop
thread writes the outcome counters and the histogram), so plain ints suffice. Readers may see one counter a
little ahead of another; they never see a torn value. Nothing is ever reset in place -- :meth:`take`
returns the change since the previous ``take`` by keeping its own baseline, which is what vLLM's
per-interval connector stats want and is race-free with the writers.
"""

from __future__ import annotations

import bisect

__all__ = ["LATENCY_BOUNDS_S", "LATENCY_BUCKETS_MS", "LatencyHistogram", "LookupMetrics"]

#: Upper bounds (ms) of the latency buckets; a final bucket catches everything slower.
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    25.0,
    50.0,
    100.0,
    250.0,
    500.0,
    1000.0,
    2500.0,
    5000.0,
)
#: The same bounds in seconds.
LATENCY_BOUNDS_S: tuple[float, ...] = tuple(b / 1000.0 for b in LATENCY_BUCKETS_MS)


class LatencyHistogram:
    """Latencies counted in the buckets of :data:`LATENCY_BOUNDS_S` (``+inf`` last), and their sum; one
    thread writes (the lookup server's loop), any reads."""

    __slots__ = ("buckets", "sum")

    def __init__(self) -> None:
        self.buckets = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1
        self.sum += seconds


_COUNTERS = (
    "submitted",  # lookups accepted by submit() (a no-op re-submit is not counted)
    "rejected",  # submits refused because max_pending lookups were outstanding (resolved as misses)
    "discards",  # unconsumed lookups dropped by discard()
    "completed",  # lookups the store answered (hits + misses among them)
    "hits",  # answered lookups that found at least one key
    "misses",  # answered lookups that found nothing
    "timeouts",  # lookups resolved as misses because their deadline passed
    "errors",  # lookups resolved as misses because the transport or store failed / replied garbage
    "stale",  # replies that arrived for an id already timed out or discarded (dropped)
    "keys_queried",  # keys in answered lookups
    "keys_hit",  # keys found (KV: leading keys; EC: present keys)
)


class LookupMetrics:
    """Counters of one lookup client. ``snapshot()`` for totals, ``take()`` for the change since last take."""

    __slots__ = (*_COUNTERS, "latency_buckets", "_baseline")

    def __init__(self) -> None:
        for name in _COUNTERS:
            setattr(self, name, 0)
        self.latency_buckets = [0] * (len(LATENCY_BOUNDS_S) + 1)
        self._baseline: dict[str, int | list[int]] = {}

    # counters are declared for mypy; set in __init__
    submitted: int
    rejected: int
    discards: int
    completed: int
    hits: int
    misses: int
    timeouts: int
    errors: int
    stale: int
    keys_queried: int
    keys_hit: int

    def observe(self, seconds: float) -> None:
        """Record one lookup latency (loop thread)."""
        self.latency_buckets[bisect.bisect_left(LATENCY_BOUNDS_S, seconds)] += 1

    def snapshot(self) -> dict[str, int | list[int]]:
        """Totals since start; ``latency_buckets[i]`` counts lookups <= ``LATENCY_BUCKETS_MS[i]``."""
        out: dict[str, int | list[int]] = {name: getattr(self, name) for name in _COUNTERS}
        out["latency_buckets"] = list(self.latency_buckets)
        return out

    def take(self) -> dict[str, int | list[int]]:
        """The change since the previous ``take`` (export for per-interval stats). Call from one thread."""
        now = self.snapshot()
        base = self._baseline
        delta: dict[str, int | list[int]] = {}
        for name, value in now.items():
            prev = base.get(name)
            if isinstance(value, list):
                old = prev if isinstance(prev, list) else [0] * len(value)
                delta[name] = [a - b for a, b in zip(value, old, strict=True)]
            else:
                delta[name] = value - (prev if isinstance(prev, int) else 0)
        self._baseline = now
        return delta

    def latency_quantile(self, q: float) -> float | None:
        """Upper bound (ms) of the bucket holding quantile ``q`` of recorded latencies; None if none."""
        buckets = list(self.latency_buckets)
        total = sum(buckets)
        if not total:
            return None
        rank, seen = q * total, 0
        for i, n in enumerate(buckets):
            seen += n
            if seen >= rank and n:
                return LATENCY_BUCKETS_MS[i] if i < len(LATENCY_BUCKETS_MS) else float("inf")
        return float("inf")
