"""Host-tier hits counted as ``host`` on an engine of several ranks: each worker's tier tells the scheduler
what it holds, and keeps what it told until the scheduler has seen it go.

With several ranks each worker's tier lives in its own process, out of the scheduler's reach -- as does one
rank's where vLLM runs its worker apart (its CPU platform under ``vllm serve``) -- (one rank in the
scheduler's process: :mod:`asyncconn.vllm.kv.hostclaims`, unless KV events are on: the tiers' events,
:mod:`asyncconn.vllm.kv.tierevents`, are built from these reports, at any number of ranks). vLLM asks
where a request's external tokens come from on the scheduler thread when it admits the request, and
records the answer then; so the scheduler must know at that moment which values every rank's tier will
serve. The protocol, over vLLM's own channels:

- each worker's tier runs in announced mode (:meth:`HostLRU.announce`): every step the worker reports
  (``build_connector_worker_meta``, merged across workers by vLLM) the keys its tier indexed and the
  announced keys that left it, under a report number per rank;
- the scheduler keeps each rank's set of held keys (:class:`TierMirror`) and counts a planned load's value
  as ``host`` when every rank's tier holds every part of it; it tells every worker, in the next metadata,
  the last report number it applied per rank (``AsyncConnKVMetadata.tier_acks``). Under pipeline
  parallelism a worker is named by its slot (``stage * tp_size + rank``), and a later stage's keys are
  learnt from its reports (:mod:`asyncconn.vllm.kv.stages`);
- a tier that evicts an announced value *withdraws* it: out of its index but still readable, its memory
  kept until the scheduler acknowledges the report that said so. A worker claims (pins) the values of
  each load it is given before it applies that metadata's acknowledgements, until the load has ended. So
  every value the scheduler counted -- from a report it had applied when it planned the load -- is still
  readable when that load reads it.

What it costs: an evicted value's room comes back one step later (the tier bypasses a value that would
need it meanwhile), and each step's report carries the keys that changed. Counted as ``host`` is never
more than the tiers served; a value a tier indexed after its last report is served from it but counted
under the store's source. A claimed value deleted as damaged is read from the store and fails its check.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from asyncconn.hosttier import HostLRU
from asyncconn.vllm.kv.hostclaims import PlannedTokens
from asyncconn.vllm.kv.metadata import ValueRef
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.stages import StageSpaces

__all__ = ["TierMirror", "TierNews", "WorkerTierNews"]

#: One rank's report: (report number, keys indexed, keys gone).
TierNews = tuple[int, list[str], list[str]]


class WorkerTierNews:
    """A worker's side: its tier in announced mode, its reports, the claims of its loads, and the
    scheduler's acknowledgements. Called on vLLM's worker thread (the tier's index takes its own lock)."""

    def __init__(self, lru: HostLRU) -> None:
        self.lru = lru
        lru.announce()
        self._claimed: set[str] = set()  # request ids holding claims

    def claim(self, rid: str, keys: Sequence[str]) -> None:
        """Pin the values of ``rid``'s load the tier holds (withdrawn ones included) until :meth:`release`."""
        if any(self.lru.claim(_owner(rid), keys)):
            self._claimed.add(rid)

    def release(self, rid: str) -> None:
        if rid in self._claimed:
            self._claimed.discard(rid)
            self.lru.unclaim(_owner(rid))

    def acknowledge(self, seq: int | None) -> None:
        if seq is not None:
            self.lru.acknowledge(seq)

    def take(self) -> TierNews | None:
        return self.lru.take_news()

    def held(self) -> int:
        return len(self._claimed)

    def close(self) -> None:
        for rid in list(self._claimed):
            self.release(rid)


def _owner(rid: str) -> str:
    return f"load:{rid}"


class TierMirror:
    """The scheduler's side: what each worker's tier holds, as reported; the tokens of a planned load that
    every worker's tier holds; the acknowledgements to send. Runs on vLLM's scheduler thread.

    A worker is named by its slot, ``stage * tp_size + rank`` (its rank alone without pipeline
    parallelism); a later stage's keys are in that stage's key space (:mod:`asyncconn.vllm.kv.stages`).
    """

    def __init__(
        self, parts: ValueParts, tp_size: int, block_size: int, spaces: StageSpaces | None = None
    ) -> None:
        self.parts = parts
        self.spaces = spaces if spaces is not None else StageSpaces(parts.keys[0])
        self._tp = tp_size
        self._held: dict[int, set[str]] = {}
        self._acks: dict[int, int] = {}
        self._tokens = PlannedTokens(block_size)

    def update(self, news: Mapping[int, TierNews]) -> None:
        """Apply the workers' reports of a step (what left first: a key can leave and come back in one)."""
        for slot, (seq, admitted, gone) in news.items():
            if not 0 <= slot < self._tp * self.spaces.stages:
                continue
            held = self._held.setdefault(slot, set())
            held.difference_update(gone)
            held.update(admitted)
            self._acks[slot] = max(self._acks.get(slot, 0), seq)

    def acks(self) -> dict[int, int]:
        """Per rank, the last report applied (for the next metadata)."""
        return dict(self._acks)

    def claim(self, rid: str, values: Sequence[ValueRef]) -> int:
        """The tokens of ``rid``'s planned load whose every part every rank's tier holds (what
        :meth:`take_tokens` answers next). Nothing is pinned here: each worker claims its load's values."""
        held = [self.everywhere(ref.part, ref.value_hash) for ref in values]
        return self._tokens.count(rid, values, held)

    def take_tokens(self, rid: str) -> int:
        return self._tokens.take(rid)

    def everywhere(self, part: int, value_hash: bytes) -> bool:
        """Whether every worker's tier holds its key of part ``part`` of the value ``value_hash`` (every
        stage's: False while a stage's key space is not known yet)."""
        spaces = self.spaces.every_stage(self.parts.keys[part])
        if spaces is None:
            return False
        held, tp = self._held, self._tp
        for stage, space in enumerate(spaces):
            for rank in range(tp):
                keys = held.get(stage * tp + rank)
                if keys is None or space.store_key(value_hash, rank) not in keys:
                    return False
        return True

    def keys_of(self, value_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """(key, value hash) of every worker's key of ``value_hashes`` (their first parts)."""
        return self.spaces.keys_of(value_hashes)

    def release(self, rid: str) -> None:
        self._tokens.drop(rid)

    def held(self) -> dict[str, int]:
        return {"host_claims": 0, "host_tokens": len(self._tokens)}

    def close(self) -> None:
        self._tokens.clear()
        self._held.clear()
