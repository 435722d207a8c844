"""Running totals kept by the engines, reported to vLLM as per-interval changes.

Why: vLLM wants per-interval connector stats, while the save tracker, the loader, the store and the lookup
client keep running totals -- the very figures their log lines quote ("... since start"). Reporting the
change of those totals, rather than counting the same events a second time elsewhere, keeps the log lines
and the exported counters equal. Used by the KV and EC connectors alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "HOST_COUNTERS",
    "LOCAL_COUNTERS",
    "Totals",
    "host_mark",
    "host_totals",
    "local_mark",
    "local_totals",
    "store_totals",
]

#: The host tier's counters (``host_cache_bytes``), named alike for KV and EC: reads it served (never
#: reaching the store), reads it passed to the store, bytes it served, values it evicted, values it did not
#: keep (larger than the bound, or no room: the rest read, claimed, being filled or withdrawn).
HOST_COUNTERS = ("host_hits", "host_misses", "host_bytes_hit", "host_evictions", "host_bypassed")

#: The local store's counters (``local_store_url``), named alike for KV and EC: reads it served (never
#: reaching the shared store), reads it passed on, values read from the shared store and written locally,
#: local reads or writes that failed.
LOCAL_COUNTERS = ("local_hits", "local_misses", "local_fills", "local_errors")


class Totals:
    """Running totals kept elsewhere (save tracker, loader, store, lookup client), taken as their change
    since the previous :meth:`take`.

    Why: vLLM wants per-interval stats, while the engines keep totals that their own log lines quote
    ("... since start"); counting both from one source keeps the log and the metrics equal. ``mark`` is a
    cheap fingerprint of the totals (a few ints): while it is unchanged ``take`` builds nothing (vLLM asks
    every step).
    """

    __slots__ = ("_last", "_last_mark", "_mark", "_read")

    def __init__(self, read: Callable[[], dict[str, int]], mark: Callable[[], object]) -> None:
        self._read = read
        self._mark = mark
        self._last: dict[str, int] = {}
        self._last_mark: object = None

    def take(self) -> dict[str, int]:
        """The names whose total changed, with the change (negative for a gauge going down)."""
        mark = self._mark()
        if mark == self._last_mark:
            return {}
        self._last_mark = mark
        last, out = self._last, {}
        for name, value in self._read().items():
            change = value - last.get(name, 0)
            if change:
                out[name] = change
                last[name] = value
        return out


def store_totals(reachability: Any) -> dict[str, int]:
    """``store_outages`` and ``store_unreachable`` (0 or 1) of one store's ``Reachability`` (None: none)."""
    if reachability is None:
        return {}
    return {"store_outages": reachability.outages, "store_unreachable": 0 if reachability.reachable else 1}


def host_totals(tier: Any) -> dict[str, int]:
    """:data:`HOST_COUNTERS` of a store's host tier (None: no tier, nothing)."""
    if tier is None:
        return {}
    stats = tier.stats
    return {
        "host_hits": stats.hits,
        "host_misses": stats.misses,
        "host_bytes_hit": stats.bytes_hit,
        "host_evictions": stats.evictions,
        "host_bypassed": stats.bypassed,
    }


def host_mark(tier: Any) -> object:
    """The fingerprint of :func:`host_totals` for :class:`Totals` (None: no tier)."""
    if tier is None:
        return None
    stats = tier.stats
    return stats.hits, stats.misses, stats.evictions, stats.bypassed


def local_totals(layered: Any) -> dict[str, int]:
    """:data:`LOCAL_COUNTERS` of a store's local store (None: none, nothing)."""
    if layered is None:
        return {}
    stats = layered.stats
    return {
        "local_hits": stats.local_hits,
        "local_misses": stats.local_misses,
        "local_fills": stats.fills,
        "local_errors": stats.local_errors,
    }


def local_mark(layered: Any) -> object:
    """The fingerprint of :func:`local_totals` for :class:`Totals` (None: no local store)."""
    if layered is None:
        return None
    stats = layered.stats
    return (stats.local_hits, stats.local_misses, stats.fills, stats.local_errors)
