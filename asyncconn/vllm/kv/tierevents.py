"""KV events for the workers' host tiers (``host_cache_bytes``): ``BlockStored`` once every rank's tier holds
a value, ``BlockRemoved`` once one of them has let it go, under the host tier's own name.

A router that knows a prompt's KV sits in this engine's host memory can send the prompt here and have it
loaded without touching the shared store; vLLM's OffloadingConnector publishes its CPU tier the same way.
The tier is named as vLLM names an offloading tier's residency, by ``medium`` and ``ownership``:
``CPU``, ``LOCAL``, ``asyncconn:host`` (:data:`HOST_TIER`); the store's own events keep the store's name
(:func:`asyncconn.vllm.kv.events.tier_of`), so the two residencies never mix.

What the scheduler knows of the tiers comes from the workers' reports (:mod:`asyncconn.vllm.kv.tiernews`:
each rank's keys indexed and gone, applied to a :class:`TierMirror`); this module turns their changes into
events, with the payload vLLM's own prefix-cache events carry (only the scheduler holds a request's
tokens). It snapshots that payload whenever the scheduler plans a save or a load of a value -- the two ways a
tier takes one in -- and keeps it (bounded) while the value may come back, so a value evicted and loaded
again is announced again. Like the store's events, a value is named by its first part (on a split hybrid
model, the part every value has); a value is published when every rank's tier holds that part.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from asyncconn.vllm.kv.events import MAX_VALUES, KVEvents, Tier
from asyncconn.vllm.kv.tiernews import TierNews

__all__ = ["HOST_TIER", "Holdings", "TierEvents"]

#: The workers' host tiers in vLLM's words (hits from them are counted as ``host`` too).
HOST_TIER = Tier("CPU", "LOCAL", "asyncconn:host", "host")


class Holdings(Protocol):
    """What the scheduler knows a tier holds: the host tiers' :class:`~asyncconn.vllm.kv.tiernews.TierMirror`,
    the local store's :class:`~asyncconn.vllm.kv.localevents.LocalMirror`."""

    def keys_of(self, value_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]: ...

    def everywhere(self, part: int, value_hash: bytes) -> bool: ...


@dataclass(slots=True)
class _Known:
    event: Any  # its BlockStored in the host tier
    published: bool = False  # the last event about it said it is in the tiers


class TierEvents:
    """The scheduler side's host-tier events. Runs on vLLM's scheduler thread; events go out through the
    store's :class:`KVEvents` buffer (one ``take_events`` for both)."""

    def __init__(self, events: KVEvents, mirror: Holdings, tier: Tier = HOST_TIER) -> None:
        self.events = events
        self.mirror = mirror
        self.tier = tier
        self._known: collections.OrderedDict[bytes, _Known] = collections.OrderedDict()
        self._key_to_value: dict[str, bytes] = {}

    def planned(self, request: Any, values: Sequence[tuple[int, bytes]]) -> None:
        """``request`` saves or loads ``values`` (value index, value hash): a tier may take them in."""
        new: list[bytes] = []
        for index, value_hash in values:
            known = self._known.get(value_hash)
            if known is not None:
                self._known.move_to_end(value_hash)
                continue
            event = self.events.snapshot(request, index, self.tier)
            if event is None:
                break  # events are off
            self._known[value_hash] = _Known(event)
            new.append(value_hash)
        self._key_to_value.update(self.mirror.keys_of(new))
        while len(self._known) > MAX_VALUES:
            self._forget_oldest()

    def update(self, news: Mapping[int, TierNews]) -> None:
        """The ranks' reports, already applied to the mirror: publish what changed for the tiers together."""
        changed: dict[bytes, None] = {}  # in report order
        for _seq, admitted, gone in news.values():
            for key in (*gone, *admitted):
                value_hash = self._key_to_value.get(key)
                if value_hash is not None:
                    changed[value_hash] = None
        self._publish(changed)

    def _publish(self, changed: Iterable[bytes]) -> int:
        """Events for the values whose keys changed, where the tier's holding of them did; how many values
        were announced removed."""
        removed: list[Any] = []
        values_removed = 0
        for value_hash in changed:
            known = self._known.get(value_hash)
            if known is None:  # forgotten past the bound (its keys went with it; this is for safety)
                continue
            held = self.mirror.everywhere(0, value_hash)
            if held and not known.published:
                known.published = True
                self.events.emit(known.event)
            elif known.published and not held:
                known.published = False
                removed.extend(known.event.block_hashes)
                values_removed += 1
        if removed:
            self.events.emit(self.events.removed_event(removed, self.tier))
        return values_removed

    def published(self) -> dict[bytes, list[Any]]:
        """Value hash -> block hashes of the values whose last event said every rank's tier holds them."""
        return {h: known.event.block_hashes for h, known in self._known.items() if known.published}

    def remap(self) -> None:
        """A later pipeline stage's key space became known: name the values followed by its keys too."""
        self._key_to_value = dict(self.mirror.keys_of(list(self._known)))

    def close(self) -> None:
        self._known.clear()
        self._key_to_value.clear()

    def _forget_oldest(self) -> None:
        """The least recently planned value leaves the map (a router may keep a published one: it then
        finds the value in the store, or misses)."""
        value_hash, _ = self._known.popitem(last=False)
        for key, _ in self.mirror.keys_of((value_hash,)):
            self._key_to_value.pop(key, None)
