"""KV events for routers (``BlockStored`` / ``BlockRemoved`` through vLLM's ``--kv-events-config``) and the
tier a cache hit came from (vLLM's ``CacheHitSource``).

A router (llm-d's precise prefix-cache scheduling, Dynamo's KV router) learns where a prompt's KV sits from
vLLM's KV events. Here a value is announced once it is in the store for every rank that saves it, with the
payload vLLM's own prefix-cache events carry for those blocks (block hashes, parent hash, token ids, block
size, LoRA, extra keys), so a router matches it exactly as it matches vLLM's ``GPU`` events; ``medium``,
``locality`` and ``ownership`` name the store's tier (:func:`tier_of`).

How a value gets there, without ever waiting on vLLM's threads:

* The scheduler side snapshots the payload when it plans a value's save (it holds the ``Request``; a worker
  never sees token ids): :meth:`KVEvents.planned`.
* Each worker notes the value hashes its save tracker confirmed (written, or found already there) or failed,
  and the store keys a removal source reported (:meth:`SaveReports.report_removed`, any thread: the worker
  deleting a damaged value a load found, a backend's ``on_removed`` hook where it has one), and hands them
  over through vLLM's worker-to-scheduler channel (``build_connector_worker_meta``): a
  :class:`SavedReport`, merged across workers by vLLM.
* The scheduler side counts the ranks (``update_connector_output``): a value every saving rank confirmed
  becomes a ``BlockStored`` in a bounded buffer that vLLM drains with ``take_events`` after each step; a
  failure drops the snapshot. A removed key becomes a ``BlockRemoved`` of the value's block hashes while the
  value is remembered (a bounded map), since a store key cannot be turned back into a hash.

Buffers are bounded: when nobody takes the events (vLLM always does while events are on) the oldest go,
counted in :attr:`KVEvents.dropped`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ModuleNotFoundError as exc:  # the worker side alone, without vLLM (see asyncconn.vllm._bases)
    if exc.name != "vllm":
        raise
    from asyncconn.vllm._bases import KVConnectorWorkerMetadata  # type: ignore[assignment]

from asyncconn.vllm.kv.stages import StageSpaces

if TYPE_CHECKING:
    from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["MAX_EVENTS", "MAX_VALUES", "KVEvents", "SaveReports", "SavedReport", "Tier", "tier_of"]

log = logging.getLogger(__name__)

#: Events kept for ``take_events`` at most; vLLM takes them after every step.
MAX_EVENTS = 10_000
#: Values remembered at most: snapshots waiting for their saves, and stored values a removal can name.
MAX_VALUES = 65_536


@dataclass(frozen=True)
class Tier:
    """Where a store keeps values, in vLLM's words: the event ``medium`` (vLLM's ``CPU`` for memory,
    ``STORAGE`` for disk, as its offloading tiers say), ``locality`` relative to this engine (``LOCAL`` /
    ``REMOTE``; None: unknown), ``ownership`` naming the tier (``asyncconn:<scheme>``), and the
    ``CacheHitSource`` value its hits are counted under."""

    medium: str
    locality: str | None
    ownership: str
    hit_source: str


_TIERS: dict[str, tuple[str, str | None, str]] = {
    "memory": ("CPU", "LOCAL", "host"),
    "file": ("STORAGE", "LOCAL", "disk"),
    "redis": ("CPU", "REMOTE", "external_unspecified"),
    "rediss": ("CPU", "REMOTE", "external_unspecified"),
    "redis+cluster": ("CPU", "REMOTE", "external_unspecified"),
    "mooncake": ("CPU", "REMOTE", "external_unspecified"),
}


def tier_of(backend_url: str) -> Tier:
    """The tier of the store at ``backend_url`` (a plug-in's scheme: ``STORAGE``, locality unknown)."""
    scheme = backend_url.split("://", 1)[0].lower() if "://" in backend_url else backend_url.lower()
    medium, locality, source = _TIERS.get(scheme, ("STORAGE", None, "external_unspecified"))
    return Tier(medium, locality, f"asyncconn:{scheme}", source)


# -- worker side ---------------------------------------------------------------------------------------
@dataclass
class SavedReport(KVConnectorWorkerMetadata):  # type: ignore[misc]  # vLLM is not followed by mypy
    """One step's news from the workers (vLLM merges every worker's with :meth:`aggregate`).

    ``saved``: value hash -> ranks whose save of it ended in the store; ``failed``: value hashes a rank
    could not save; ``removed``: store keys a removal source saw leave the store; ``tiers``: rank -> its
    host tier's report (:mod:`asyncconn.vllm.kv.tiernews`: report number, keys indexed, keys gone);
    ``local``: the local store's changes, in order (:mod:`asyncconn.vllm.kv.localevents`: key, held);
    ``layers``: a later pipeline stage -> its layers, which its keys derive from
    (:mod:`asyncconn.vllm.kv.stages`). ``tiers`` is keyed by each worker's slot (``stage * tp_size + rank``).
    """

    saved: dict[bytes, int] = field(default_factory=dict)
    failed: set[bytes] = field(default_factory=set)
    removed: list[str] = field(default_factory=list)
    tiers: dict[int, tuple[int, list[str], list[str]]] = field(default_factory=dict)
    local: list[tuple[str, bool]] = field(default_factory=list)
    layers: dict[int, tuple[str, ...]] = field(default_factory=dict)

    def aggregate(self, other: Any) -> SavedReport:
        if isinstance(other, SavedReport):
            for value_hash, ranks in other.saved.items():
                self.saved[value_hash] = self.saved.get(value_hash, 0) + ranks
            self.failed |= other.failed
            self.removed.extend(other.removed)
            self.tiers.update(other.tiers)
            self.local.extend(other.local)
            self.layers.update(other.layers)
        return self


class SaveReports:
    """A worker's side of the events: what its save tracker confirmed, until the next report.

    ``saved``/``failed`` are called by the tracker on vLLM's worker thread; :meth:`report_removed` by a
    removal source on any thread (a lock guards the removed keys, never held across I/O). Each buffer is
    bounded by ``MAX_VALUES``; what overflows is counted in ``dropped``.
    """

    def __init__(self) -> None:
        self._saved: dict[bytes, int] = {}
        self._failed: set[bytes] = set()
        self._removed: list[str] = []
        self._lock = threading.Lock()
        self.dropped = 0

    def saved(self, value_hash: bytes) -> None:
        if len(self._saved) >= MAX_VALUES:
            self.dropped += 1
            return
        self._saved[value_hash] = 1

    def failed(self, value_hash: bytes) -> None:
        self._saved.pop(value_hash, None)
        if len(self._failed) >= MAX_VALUES:
            self.dropped += 1
            return
        self._failed.add(value_hash)

    def report_removed(self, keys: Iterable[str]) -> None:
        """Store keys that left the store (evicted, expired): the one call a removal source makes."""
        with self._lock:
            for key in keys:
                if len(self._removed) >= MAX_VALUES:
                    self.dropped += 1
                    continue
                self._removed.append(key)

    def take(self) -> SavedReport | None:
        """The report for this step (None when there is nothing to say: most steps)."""
        with self._lock:
            removed, self._removed = self._removed, []
        if not (self._saved or self._failed or removed):
            return None
        report = SavedReport(self._saved, self._failed, removed)
        self._saved, self._failed = {}, set()
        return report

    def held(self) -> int:
        return len(self._saved) + len(self._failed) + len(self._removed)


# -- scheduler side ------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Pending:
    event: Any  # the BlockStored to publish
    ranks: int = 0  # saving ranks that confirmed the value so far
    refs: int = 0  # live requests that planned it


class KVEvents:
    """The scheduler side's events: snapshots of planned values, confirmed by the workers' reports.

    ``ranks``: how many workers must confirm a value: every TP rank (one when the KV is replicated, MLA)
    of each of the ``stages`` pipeline stages, which each save their own layers. ``store``: whether the
    store's residency is published (``kv_events``); without it, this only builds and buffers another tier's
    events (:meth:`snapshot`, :meth:`emit`). Call every method from the scheduler thread.
    """

    def __init__(
        self,
        keys: KeySpace,
        tier: Tier,
        *,
        store: bool = True,
        stages: int = 1,
        spaces: StageSpaces | None = None,
    ) -> None:
        from vllm.distributed import kv_events

        self._convert = _hash_converter()
        self.stages = stages
        #: Every stage's key space, as learnt (a removal names a value by any stage's key of it).
        self.spaces = spaces if spaces is not None else StageSpaces(keys, stages)
        self.tier = tier
        self.store = store
        self._stored_cls = kv_events.BlockStored
        self._removed_cls = kv_events.BlockRemoved
        fields = set(getattr(kv_events.BlockStored, "__struct_fields__", ()))
        self._stored_optional = {"locality", "ownership"} & fields
        removed_fields = set(getattr(kv_events.BlockRemoved, "__struct_fields__", ()))
        self._removed_optional = {"locality", "ownership"} & removed_fields
        self._has_extra_keys = "extra_keys" in fields
        self._has_session = "session_id" in fields
        self._pending: collections.OrderedDict[bytes, _Pending] = collections.OrderedDict()
        self._by_request: dict[str, list[bytes]] = {}
        self._stored: collections.OrderedDict[bytes, list[Any]] = collections.OrderedDict()  # -> event hashes
        self._key_to_value: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._events: collections.deque[Any] = collections.deque()
        self.off = False  # set when this vLLM refused our payload (see ``planned``)
        self.dropped = 0  # events (or snapshots) let go because the buffers were full

    @property
    def keys(self) -> KeySpace:
        """The first stage's key space (what a value's payload is built with)."""
        return self.spaces.first

    @keys.setter
    def keys(self, keys: KeySpace) -> None:
        self.spaces.reset(keys)

    @property
    def ranks(self) -> int:
        return self.keys.keys_per_value * self.stages

    # -- the sink -----------------------------------------------------------------------------------------
    def planned(self, request_id: str, request: Any, values: Sequence[tuple[int, bytes]]) -> None:
        """``request`` plans to save ``values`` (value index, value hash): snapshot each one's payload.

        A payload this vLLM refuses (a ``BlockStored`` of another shape than the ones this module knows)
        turns the events off with one warning: never an exception on the scheduler's thread.
        """
        if self.off or not self.store:
            return
        try:
            self._planned(request_id, request, values)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            self.off = True
            self.close()
            log.warning("asyncconn KV events off: this vLLM refused a BlockStored event: %s", exc)

    def _planned(self, request_id: str, request: Any, values: Sequence[tuple[int, bytes]]) -> None:
        mine = self._by_request.setdefault(request_id, [])
        for index, value_hash in values:
            pending = self._pending.get(value_hash)
            if pending is None:
                pending = _Pending(self._stored_event(request, index, self.tier))
                self._pending[value_hash] = pending
                if len(self._pending) > MAX_VALUES:
                    self._pending.popitem(last=False)
                    self.dropped += 1
            pending.refs += 1
            mine.append(value_hash)

    def snapshot(self, request: Any, index: int, tier: Tier) -> Any | None:
        """The ``BlockStored`` of ``request``'s value ``index`` in ``tier`` (another tier of this connector:
        the host tier), to publish later with :meth:`emit`; None when the events are off (as ``planned``)."""
        if self.off:
            return None
        try:
            return self._stored_event(request, index, tier)
        except (TypeError, ValueError, AttributeError, IndexError) as exc:
            self.off = True
            self.close()
            log.warning("asyncconn KV events off: this vLLM refused a BlockStored event: %s", exc)
            return None

    def emit(self, event: Any) -> None:
        """Publish an event built elsewhere (another tier of this connector); nothing when events are off."""
        if not self.off:
            self._emit(event)

    def removed(self, value_hashes: Iterable[bytes]) -> None:
        """Values that left the store: one ``BlockRemoved`` of their block hashes (those still known)."""
        hashes: list[Any] = []
        for value_hash in value_hashes:
            block_hashes = self._stored.pop(value_hash, None)
            if block_hashes is not None:
                hashes.extend(block_hashes)
        if hashes:
            self._emit(self.removed_event(hashes, self.tier))

    def oldest(self, n: int) -> list[tuple[bytes, object]]:
        """The ``n`` values announced (or last handed out here) longest ago, each with a mark of its
        announcement, moved to the back: the next call hands out the next ones
        (:mod:`asyncconn.vllm.kv.recheck` asks the store about them). A value confirmed still there is as
        good as one announced now, so the turn also decides which go first when the map is full."""
        stored = self._stored
        out: list[tuple[bytes, object]] = [(h, stored[h]) for h in itertools.islice(stored, n)]
        for value_hash, _ in out:
            stored.move_to_end(value_hash)
        return out

    def removed_unless_renewed(self, values: Sequence[tuple[bytes, object]]) -> int:
        """:meth:`removed` of ``values`` (hash, the mark :meth:`oldest` gave), less any announced again
        since (its new save may postdate the answer that found it gone); how many were announced removed."""
        current = [h for h, mark in values if self._stored.get(h) is mark]
        self.removed(current)
        return len(current)

    def removed_event(self, block_hashes: list[Any], tier: Tier) -> Any:
        """vLLM's ``BlockRemoved`` of ``block_hashes`` from ``tier``."""
        known = {"locality": tier.locality, "ownership": tier.ownership}
        kwargs = {name: known[name] for name in self._removed_optional}
        return self._removed_cls(block_hashes=block_hashes, medium=tier.medium, **kwargs)

    def removed_keys(self, keys: Iterable[str]) -> None:
        """Store keys that left the store (any rank's key ends its value)."""
        self.removed([v for v in (self._key_to_value.pop(key, None) for key in keys) if v is not None])

    def update(self, report: SavedReport) -> None:
        """The workers' news: confirmed values become ``BlockStored``, failed ones are forgotten."""
        if not self.store:
            return
        for value_hash in report.failed:
            self._pending.pop(value_hash, None)
        for value_hash, ranks in report.saved.items():
            pending = self._pending.get(value_hash)
            if pending is None:
                continue  # not planned by a live request (or already published)
            pending.ranks += ranks
            if pending.ranks >= self.ranks:
                del self._pending[value_hash]
                self._remember(value_hash, pending.event.block_hashes)
                self._emit(pending.event)
        if report.removed:
            self.removed_keys(report.removed)

    def release(self, request_id: str) -> None:
        """``request_id`` is done with its saves: snapshots no live request needs are dropped."""
        for value_hash in self._by_request.pop(request_id, ()):
            pending = self._pending.get(value_hash)
            if pending is not None:
                pending.refs -= 1
                if pending.refs <= 0:
                    del self._pending[value_hash]

    def take(self) -> list[Any]:
        """Every event since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events

    def held(self) -> dict[str, int]:
        """Per-request structures (tests count them back to zero); the stored-value map is a bounded cache."""
        return {"event_requests": len(self._by_request), "event_snapshots": len(self._pending)}

    def close(self) -> None:
        self._pending.clear()
        self._by_request.clear()
        self._stored.clear()
        self._key_to_value.clear()
        self._events.clear()

    # -- internals ----------------------------------------------------------------------------------------
    def _emit(self, event: Any) -> None:
        self._events.append(event)
        if len(self._events) > MAX_EVENTS:
            self._events.popleft()
            self.dropped += 1

    def _remember(self, value_hash: bytes, block_hashes: list[Any]) -> None:
        self._stored[value_hash] = block_hashes
        self._stored.move_to_end(value_hash)
        # Every rank's key of every pipeline stage known (a later stage's: once its workers named their
        # layers, asyncconn.vllm.kv.stages).
        key_to_value = self._key_to_value
        for space in self.spaces.known:
            for rank in range(space.keys_per_value):
                key_to_value[space.store_key(value_hash, rank)] = value_hash
        while len(self._stored) > MAX_VALUES:
            self._stored.popitem(last=False)
        self._bound_keys()

    def remap(self) -> None:
        """A later stage's key space became known: name the values published by its keys too."""
        self._key_to_value.update(self.spaces.keys_of(list(self._stored)))
        self._bound_keys()

    def _bound_keys(self) -> None:
        while len(self._key_to_value) > MAX_VALUES * self.ranks:
            self._key_to_value.popitem(last=False)

    def _stored_event(self, request: Any, index: int, tier: Tier) -> Any:
        """vLLM's ``BlockStored`` for value ``index`` of ``request`` in ``tier``, as its prefix cache builds
        one for those blocks."""
        convert = self._convert
        bpv = self.keys.blocks_per_value
        block_size = self.keys.identity.block_size
        first, end = index * bpv, (index + 1) * bpv
        hashes = request.block_hashes
        lora = getattr(request, "lora_request", None)
        known = {"locality": tier.locality, "ownership": tier.ownership}
        kwargs: dict[str, Any] = {name: known[name] for name in self._stored_optional}
        if self._has_extra_keys:
            kwargs["extra_keys"] = _extra_keys(request, first, end, block_size)
        if self._has_session:
            kwargs["session_id"] = getattr(request, "session_id", None)
        return self._stored_cls(
            block_hashes=[convert(h) for h in hashes[first:end]],
            parent_block_hash=convert(hashes[first - 1]) if first > 0 else None,
            token_ids=list(request.all_token_ids[first * block_size : end * block_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora is not None else None,
            medium=tier.medium,
            lora_name=lora.name if lora is not None else None,
            **kwargs,
        )


def _hash_converter() -> Callable[[bytes], Any]:
    """vLLM's ``maybe_convert_block_hash`` (a block hash as events carry it: bytes, or its low 64 bits as an
    int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), without its per-call environment lookup -- the cost
    that dominated a value's event -- when it behaves as one of those two; else vLLM's own function."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    probe = bytes(range(1, 33))
    converted = maybe_convert_block_hash(probe)  # type: ignore[arg-type]
    if converted == probe:
        return bytes
    mask = (1 << 64) - 1
    if converted == int.from_bytes(probe, "big") & mask:
        return lambda block_hash: int.from_bytes(block_hash, "big") & mask
    return maybe_convert_block_hash  # type: ignore[no-any-return]


def _extra_keys(request: Any, first: int, end: int, block_size: int) -> Any:
    """Per block, the extra keys vLLM hashed (LoRA, multimodal items, cache salt, prompt embeddings), in its
    event format; None where this vLLM has no helper for it."""
    if not (
        getattr(request, "mm_features", None)
        or getattr(request, "lora_request", None)
        or (first == 0 and getattr(request, "cache_salt", None))
        or getattr(request, "prompt_embeds", None) is not None
    ):
        return [None] * (end - first)  # what vLLM's helpers give a plain text request, for a fraction
    from vllm.v1.core import kv_cache_utils

    generate = getattr(kv_cache_utils, "generate_block_hash_extra_keys", None)
    convert = getattr(kv_cache_utils, "to_event_extra_keys", None)
    if generate is None or convert is None:
        return None
    keys: list[Any] = []
    mm_index = 0
    if first > 0 and getattr(request, "mm_features", None):
        try:  # skips the items before the value (vLLM scans from its first item otherwise: the same keys)
            from vllm.multimodal.utils import get_mm_features_in_window
        except ImportError:
            pass
        else:
            mm_index, _ = get_mm_features_in_window(request.mm_features, first * block_size, end * block_size)
    for block in range(first, end):
        extra, mm_index = generate(request, block * block_size, (block + 1) * block_size, mm_index)
        keys.append(extra)
    return convert(keys)
