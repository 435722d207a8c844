"""What the KV connector's scheduler side tells its workers each step, and the stats they send back.

The metadata is plain data (vLLM pickles it to the worker processes; nothing in it is read from a store):
which values to load into which blocks, which values to save from which blocks, and which requests were
preempted this step. Values are named by the block hash of their last block; each worker derives its own
rank's store key from it (:class:`asyncconn.vllm.kv.keys.KeySpace`).

Both derive from vLLM's base classes, or -- where vLLM is not installed at all -- from same-shaped stand-ins
(:mod:`asyncconn.vllm._bases`), so the worker side runs without vLLM. The stats object is vLLM's
``KVConnectorStats`` contract: counters add up across workers and intervals,
latency histograms (the lookup client's fixed buckets) add up bucket by bucket.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

from asyncconn.lookup.metrics import LATENCY_BOUNDS_S, LATENCY_BUCKETS_MS
from asyncconn.transfer.failures import Failure
from asyncconn.vllm.totals import (
    HOST_COUNTERS,
    LOCAL_COUNTERS,
    Totals,
    host_mark,
    host_totals,
    local_mark,
    local_totals,
    store_totals,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
except ModuleNotFoundError as exc:  # vLLM not installed (the worker side alone, e.g. on a GPU test machine)
    if exc.name != "vllm":
        raise  # vLLM is there but broken or of another layout: say so, never run on stand-ins
    from asyncconn.vllm._bases import KVConnectorMetadata, KVConnectorStats  # type: ignore[assignment]

__all__ = [
    "CAUSES",
    "COUNTERS",
    "GAUGES",
    "HOST_COUNTERS",
    "LOCAL_COUNTERS",
    "HISTOGRAMS",
    "AsyncConnKVMetadata",
    "AsyncConnKVStats",
    "LoadSpec",
    "SaveSpec",
    "ValueRef",
    "lookup_totals",
    "worker_totals",
]


@dataclass(frozen=True, slots=True)
class ValueRef:
    """One stored value (``blocks_per_value`` consecutive blocks) and the blocks it maps to.

    ``positions`` are the block positions inside the value that take part (all of them for a save; for a
    load, those not already in the local prefix cache); ``block_ids[g][i]`` is the block of KV cache group
    ``g`` that holds position ``positions[i]``. ``part``: which part of the value, on a model whose
    windowed groups are stored apart (:class:`asyncconn.vllm.kv.parts.ValueParts`); 0 otherwise.
    """

    value_hash: bytes
    positions: tuple[int, ...]
    block_ids: tuple[tuple[int, ...], ...]
    part: int = 0


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """Load these values for a request parked in ``WAITING_FOR_REMOTE_KVS``, or -- ``sync`` -- for a
    request this very step computes on top of them (``kv_sync_loads``): the step waits for them."""

    request_id: str
    values: tuple[ValueRef, ...]
    sync: bool = False


@dataclass(frozen=True, slots=True)
class SaveSpec:
    """Save these values, computed by this step, for a running request."""

    request_id: str
    values: tuple[ValueRef, ...]


@dataclass
class AsyncConnKVMetadata(KVConnectorMetadata):  # type: ignore[misc]  # vLLM is not followed by mypy
    """One step's work for every worker.

    ``finished_via_recv``: requests vLLM finished (aborted) while, as far as the scheduler knew, their load
    was still running. vLLM frees those blocks when every worker has reported the id in
    ``finished_recving`` (its rule for a finished request), so each worker reports it there exactly once --
    and never in ``finished_sending``. With several workers, some may have reported the load before the
    abort and some not; only the scheduler knows the merged view, hence this field.
    """

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    preempted: frozenset[str] = frozenset()
    finished_via_recv: frozenset[str] = frozenset()
    #: Tokens vLLM scheduled this step; 0 on a step that only waits (for our loads, say).
    step_tokens: int = -1
    #: Per rank, the last host-tier report the scheduler applied (several ranks with ``host_cache_bytes``:
    #: :mod:`asyncconn.vllm.kv.tiernews`); the tier frees what that report withdrew.
    tier_acks: dict[int, int] = field(default_factory=dict)
    #: Whether the scheduler knows every pipeline stage's key space: a later stage's workers stop naming
    #: their layers (:mod:`asyncconn.vllm.kv.stages`).
    stages_known: bool = True


#: Why a load or a save failed (``load_failures_<cause>``, ``save_failures_<cause>``): the loader's and the
#: save tracker's reasons, less ``not_cached`` (a load retried through staging, not a failure).
CAUSES = tuple(f.value for f in Failure if f is not Failure.NOT_CACHED)

#: The host tier's and the local store's counters (``asyncconn.vllm.totals.HOST_COUNTERS``,
#: ``LOCAL_COUNTERS``) are reported only when not zero (both are off by default, and vLLM logs the whole
#: dict every interval).

#: Counters (summed). ``tokens_*`` count tokens, ``bytes_*`` bytes on this worker. ``saves`` are values the
#: store confirmed written; ``saves_submitted`` those handed to the save tracker; failed ones are counted in
#: ``save_failures`` only. ``store_outages``: times a process's store went from reachable to unreachable.
#: ``events_dropped``: KV events (or their records) let go from a full buffer (``asyncconn.vllm.kv.events``).
#: ``events_rechecked``: values announced stored that the store was asked about again, and
#: ``events_recheck_removed`` those of them found gone and announced removed (``asyncconn.vllm.kv.recheck``).
COUNTERS = (
    "lookups",
    "lookup_hits",
    "lookup_tokens_hit",
    "lookup_timeouts",
    "lookup_errors",
    "loads",
    "load_failures",
    *(f"load_failures_{cause}" for cause in CAUSES),
    "loads_in_place",
    "loads_not_in_memory",
    "tokens_loaded",
    "bytes_loaded",
    "saves",
    "saves_submitted",
    "saves_skipped",
    "save_failures",
    *(f"save_failures_{cause}" for cause in CAUSES),
    "tokens_saved",
    "bytes_saved",
    "store_outages",
    "events_dropped",
    "events_rechecked",
    "events_recheck_removed",
    *HOST_COUNTERS,
    *LOCAL_COUNTERS,
)
#: Gauges, carried as changes (summed like counters): ``store_unreachable`` is the number of processes
#: (scheduler, workers) whose store is unreachable right now.
GAUGES = ("store_unreachable",)
#: Latency histograms over ``LATENCY_BUCKETS_MS`` (+inf last).
HISTOGRAMS = ("lookup_latency", "load_latency", "save_latency")
_NBUCKETS = len(LATENCY_BUCKETS_MS) + 1


def bucket(seconds: float) -> int:
    """The histogram bucket of a latency."""
    return bisect.bisect_left(LATENCY_BOUNDS_S, seconds)


class AsyncConnKVStats(KVConnectorStats):  # type: ignore[misc]
    """Per-interval connector stats; ``data`` holds only ints and lists of ints (serializable)."""

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        super().__init__(data=dict(data) if data else {})
        self.data: dict[str, Any]
        # False until something is recorded: is_empty() is then one test (vLLM asks every step).
        self._touched = bool(self.data)
        if not self.data:
            self.reset()

    def reset(self) -> None:
        data: dict[str, Any] = {name: 0 for name in (*COUNTERS, *GAUGES)}
        self.data = data
        for name in HISTOGRAMS:
            self.data[name] = [0] * _NBUCKETS
        self._touched = False

    def add(self, name: str, value: int = 1) -> None:
        self._touched = True
        self.data[name] = self.data.get(name, 0) + value

    def observe(self, name: str, seconds: float) -> None:
        self._touched = True
        self.data.setdefault(name, [0] * _NBUCKETS)[bucket(seconds)] += 1

    def merge_histogram(self, name: str, counts: list[int]) -> None:
        self._touched = True
        hist = self.data.setdefault(name, [0] * _NBUCKETS)
        for i, n in enumerate(counts[:_NBUCKETS]):
            hist[i] += n

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            if isinstance(value, list):
                self.merge_histogram(name, value)
            elif isinstance(value, int):
                self.add(name, value)
        return self

    def reduce(self) -> dict[str, int | float]:
        # Per-cause failures only when they happened: vLLM logs this dict every interval.
        out: dict[str, int | float] = {
            name: int(self.data.get(name, 0))
            for name in (*COUNTERS, *GAUGES)
            if not ("failures_" in name or name.startswith(("host_", "local_"))) or self.data.get(name)
        }
        for name in HISTOGRAMS:
            counts: list[int] = self.data.get(name) or []
            for q in (0.5, 0.99):
                out[f"{name}_p{int(q * 100)}_ms"] = quantile_ms(counts, q)
        return out

    def is_empty(self) -> bool:
        if not getattr(self, "_touched", True):  # (an instance vLLM rebuilt without __init__ is checked)
            return True
        return not any(self.data.get(name) for name in (*COUNTERS, *GAUGES)) and not any(
            any(self.data.get(name) or ()) for name in HISTOGRAMS
        )


def worker_totals(saver: Any, loader: Any, store: Any, tokens_per_value: int) -> Totals:
    """A KV worker's totals from its save tracker, loader and store (see :data:`COUNTERS`)."""
    reach = getattr(store, "reachability", None)
    tier = getattr(store, "host_tier", None)
    layered = getattr(store, "layered", None)

    def read() -> dict[str, int]:
        totals = {
            "saves": saver.saved,
            "tokens_saved": saver.saved * tokens_per_value,
            "bytes_saved": saver.saved_bytes,
            "save_failures": sum(saver.failures.values()),
        }
        for reason, n in saver.failures.items():
            totals[f"save_failures_{reason.value}"] = n
        for reason, n in loader.failures.items():
            if reason is not Failure.NOT_CACHED:
                totals[f"load_failures_{reason.value}"] = n
        totals.update(store_totals(reach))
        totals.update(host_totals(tier))
        totals.update(local_totals(layered))
        return totals

    def mark() -> object:
        return (
            saver.saved,
            saver.failures.total(),
            loader.failures.total(),
            None if reach is None else (reach.outages, reach.reachable),
            host_mark(tier),
            local_mark(layered),
        )

    return Totals(read, mark)


def lookup_totals(lookup: Any) -> Totals:
    """A scheduler's totals from its lookup client: timeouts, errors, and its store's reachability (when
    it queries the store itself; a lookup server's store is the server's to report)."""
    reach = getattr(lookup, "store_reachability", None)

    def read() -> dict[str, int]:
        if lookup is None:
            return {}
        totals = {"lookup_timeouts": lookup.metrics.timeouts, "lookup_errors": lookup.metrics.errors}
        totals.update(store_totals(reach))
        return totals

    def mark() -> object:
        if lookup is None:
            return None
        metrics = lookup.metrics
        return metrics.timeouts, metrics.errors, None if reach is None else (reach.outages, reach.reachable)

    return Totals(read, mark)


def quantile_ms(counts: list[int], q: float) -> float:
    """Upper bound (ms) of the bucket holding quantile ``q``; 0.0 when nothing was recorded."""
    total = sum(counts)
    if not total:
        return 0.0
    seen = 0
    for i, n in enumerate(counts):
        seen += n
        if n and seen >= q * total:
            return LATENCY_BUCKETS_MS[i] if i < len(LATENCY_BUCKETS_MS) else float("inf")
    return float("inf")
