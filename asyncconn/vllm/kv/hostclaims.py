"""Hits served by the host tier, counted as vLLM's ``host`` source: the scheduler claims the values it plans
to load from a worker's tier in its own process.

vLLM asks where a request's external tokens come from (``get_external_cache_hit_sources``) on the scheduler
thread, right after ``update_state_after_alloc`` planned the load and before any load starts, and records the
answer then. The host tier (``host_cache_bytes``) lives in the worker. So the answer can only be exact if
the scheduler can both see the tier and make it keep what it saw until the load has read it:

- where the engine has one worker and it runs in the scheduler's process (one rank and vLLM's uniprocess
  executor: ``vllm serve`` and ``LLM`` on one GPU; on CPU only without engine multiprocessing, since vLLM's
  CPU platform otherwise runs even one worker in a process of its own), the worker registers its tier
  here under its engine's id and key namespace, and the scheduler finds it;
- the scheduler *claims* the values of a load it plans (:meth:`HostTier.lru.claim`: pinned, never evicted
  nor replaced in memory) and counts the tokens of the values whose every part it claimed as ``host``; the
  claims are released when the load has ended (``finished_recving``), the request is preempted or
  finishes, or the scheduler closes;
- several ranks (each has its own tier, in its own process), a worker in a process of its own, or KV
  events on (the tiers' events need their reports), use :mod:`asyncconn.vllm.kv.tiernews` instead; no
  tier, or a value not in the tier: counted under the store's own source.

A claimed value can still leave the tier for one reason: a delete (a damaged value found by a load). The
load then reads the store, and those tokens were counted as ``host``; the load fails its frame check anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from asyncconn.hosttier import HostTier
from asyncconn.vllm.kv.metadata import ValueRef
from asyncconn.vllm.kv.parts import ValueParts

__all__ = [
    "HostClaims",
    "HostHits",
    "PlannedTokens",
    "register_tier",
    "registered_tier",
    "unregister_tier",
    "whole_tokens",
]


def whole_tokens(values: Sequence[ValueRef], held: Sequence[bool], block_size: int) -> int:
    """The tokens of the values whose every part is ``held`` (``held[i]``: ``values[i]``'s part); a value of
    several parts has the same positions in each, so it counts once."""
    missing = {ref.value_hash for ref, ok in zip(values, held, strict=True) if not ok}
    counted: set[bytes] = set()
    tokens = 0
    for ref in values:
        if ref.value_hash not in missing and ref.value_hash not in counted:
            counted.add(ref.value_hash)
            tokens += len(ref.positions) * block_size
    return tokens


class PlannedTokens:
    """Per request, the tokens of its planned load that the host tiers serve: counted when the load is
    planned, asked for once right after (vLLM's ``get_external_cache_hit_sources``)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._tokens: dict[str, int] = {}

    def count(self, rid: str, values: Sequence[ValueRef], held: Sequence[bool]) -> int:
        """Record and return the tokens of the values of ``rid``'s load whose every part is ``held``."""
        tokens = whole_tokens(values, held, self.block_size)
        if tokens:
            self._tokens[rid] = tokens
        else:
            self._tokens.pop(rid, None)
        return tokens

    def take(self, rid: str) -> int:
        return self._tokens.pop(rid, 0)

    def drop(self, rid: str) -> None:
        self._tokens.pop(rid, None)

    def __len__(self) -> int:
        return len(self._tokens)

    def clear(self) -> None:
        self._tokens.clear()


class HostHits(Protocol):
    """How the scheduler learns which tokens of a load it plans the host tier will serve: chosen once, by
    the engine's shape (one rank: :class:`HostClaims`; several: ``tiernews.TierMirror``)."""

    def claim(self, rid: str, values: Sequence[ValueRef]) -> int: ...
    def take_tokens(self, rid: str) -> int: ...
    def release(self, rid: str) -> None: ...
    def update(self, news: Mapping[int, Any]) -> None: ...
    def acks(self) -> dict[int, int]: ...
    def held(self) -> dict[str, int]: ...
    def close(self) -> None: ...


# engine key -> the tiers registered under it (weakly: a worker that never shut down keeps nothing alive)
_TIERS: dict[str, list[weakref.ref[HostTier]]] = {}
_LOCK = threading.Lock()


def register_tier(engine: str, tier: HostTier) -> None:
    """A worker's tier, for a scheduler in this process (``engine``: the engine id and key namespace)."""
    with _LOCK:
        _TIERS.setdefault(engine, []).append(weakref.ref(tier))


def unregister_tier(engine: str, tier: HostTier) -> None:
    with _LOCK:
        refs = [ref for ref in _TIERS.get(engine, ()) if ref() is not None and ref() is not tier]
        if refs:
            _TIERS[engine] = refs
        else:
            _TIERS.pop(engine, None)


def registered_tier(engine: str) -> HostTier | None:
    """The one tier registered under ``engine``; None when there is none or more than one (several workers
    in one process: the scheduler cannot know which rank's tier a load reads)."""
    with _LOCK:
        tiers = [tier for ref in _TIERS.get(engine, ()) if (tier := ref()) is not None]
    return tiers[0] if len(tiers) == 1 else None


class HostClaims:
    """The scheduler's claims on the host tier of the one worker in its process (see the module docstring).

    ``engine``: the key the worker registered its tier under. The tier is looked up at each claim, so a
    worker made after the scheduler, or gone, is followed. Runs on vLLM's scheduler thread.
    """

    def __init__(self, engine: str, parts: ValueParts, block_size: int) -> None:
        self.engine = engine
        self.parts = parts
        self._claimed: dict[str, HostTier] = {}  # request id -> the tier it holds claims on
        self._tokens = PlannedTokens(block_size)  # request id -> tokens its planned load reads from the tier

    def claim(self, rid: str, values: Sequence[ValueRef]) -> int:
        """Claim the values of ``rid``'s planned load that the tier holds; the tokens of those whose every
        part was claimed (what :meth:`take_tokens` answers next)."""
        self.release(rid)  # a new plan (after a preemption) replaces the old one's claims
        tier = registered_tier(self.engine)
        if tier is None or not values:
            return 0
        keys = [self.parts.keys[ref.part].store_key(ref.value_hash, 0) for ref in values]
        held = tier.lru.claim(rid, keys)
        if any(held):
            self._claimed[rid] = tier
        return self._tokens.count(rid, values, held)

    def take_tokens(self, rid: str) -> int:
        """The tokens ``rid``'s last claim found in the tier (asked once, right after the claim)."""
        return self._tokens.take(rid)

    def release(self, rid: str) -> None:
        self._tokens.drop(rid)
        tier = self._claimed.pop(rid, None)
        if tier is not None:
            tier.lru.unclaim(rid)

    def update(self, news: Mapping[int, Any]) -> None:
        """(Reports from workers' tiers: none in one rank, the tier is claimed directly.)"""

    def acks(self) -> dict[int, int]:
        return {}

    def held(self) -> dict[str, int]:
        return {"host_claims": len(self._claimed), "host_tokens": len(self._tokens)}

    def close(self) -> None:
        for rid in list(self._claimed):
            self.release(rid)
        self._tokens.clear()
