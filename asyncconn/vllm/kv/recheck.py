"""Asking the store again about values announced stored, so removals it never reports reach the routers.

A router learns that a value left the store from a ``BlockRemoved`` (:mod:`asyncconn.vllm.kv.events`). Some
removals are reported as they happen (``file://`` eviction and expiry, a redis-server's keyspace
notifications with ``removals``); others are not: Mooncake's evictions, a redis-server without
notifications, a value another engine's ``file://`` store evicted from a shared directory, one deleted
behind the store's back. Without a report a router hears of such a removal only when this engine next looks
the prompt up or loads it -- until then it keeps sending that prompt here for a hit that is gone.

:class:`ResidencyRecheck` closes that gap on a timer: every ``interval`` it asks the store (one ``EXISTS``
lookup through the lookup client, on the runtime loop: the scheduler thread only submits and polls) whether
the :data:`RECHECK_VALUES` values announced longest ago still have every key, and announces the ones that do
not as removed. The values are taken in turn (``KVEvents.oldest``), so every remembered value is asked
about within ``MAX_VALUES / RECHECK_VALUES`` intervals (their keys are named over a few steps,
:data:`KEYS_PER_STEP` values a step, so that no step is held for long). Only an answer the store gave
counts: a recheck that timed out or failed announces nothing, and a value announced again while it was
asked about keeps its residency (the answer may predate the new save).

The same recheck follows the local store's residency (``local_store_url``,
:class:`asyncconn.vllm.kv.localevents.LocalTierEvents`): its workers hear only their own engine's changes of
the directory, so another engine's sweep of a shared directory is heard this way, and so is another
engine's write of a value this engine follows. What
is asked and what an answer changes is the :class:`Residency`'s: the store's is :class:`StoreResidency`.

It runs from :meth:`KVSchedulerSide.build_connector_meta`, i.e. on engine steps: vLLM publishes events only
after a step, so an idle engine's removals are found and published when it next steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from asyncconn.lookup.client import LookupClient
from asyncconn.vllm.kv.events import KVEvents
from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["KEYS_PER_STEP", "RECHECK_VALUES", "Residency", "ResidencyRecheck", "StoreResidency"]

#: Values asked about per recheck at most: one ``EXISTS`` of this many values' keys (a pipeline of a few
#: thousand ``EXISTS`` on Redis, one batch query on Mooncake), small beside a prompt's own lookup traffic.
RECHECK_VALUES = 1024
#: Values whose keys one step names at most while a recheck is prepared. Why: a key is a hash per rank, and
#: naming 1,024 values' keys at once held vLLM's scheduler thread for milliseconds in one step with eight
#: ranks (``scripts/kv_events_cost.py``: docs/benchmarks.md); spread over steps, no step pays more than an
#: eighth of it.
KEYS_PER_STEP = 128

_IDS = itertools.count()


class Residency(Protocol):
    """What a recheck asks about and what the answer changes. Every method runs on vLLM's scheduler thread."""

    def oldest(self, n: int) -> list[tuple[bytes, object]]:
        """The next ``n`` values in turn (value hash, a mark the answer is judged against)."""
        ...

    def question(self, value_hashes: Sequence[bytes]) -> list[bytes] | None:
        """The keys to ask about, value by value (the same number for each); None: not askable now."""
        ...

    def answered(
        self, asked: Sequence[tuple[bytes, object]], keys: Sequence[bytes], held: Sequence[bool]
    ) -> int:
        """The store's answer (``held[i]``: whether it holds ``keys[i]``): publish what changed; returns
        how many values were announced removed."""
        ...


class StoreResidency:
    """The store's residency (:class:`KVEvents`): the values announced stored, asked in the key space a
    lookup asks (a split hybrid model's whole parts); a value missing any key is announced removed unless it
    was announced again since it was handed out (``KVEvents.removed_unless_renewed``)."""

    def __init__(self, events: KVEvents, space: KeySpace) -> None:
        self.events = events
        self.space = space

    def oldest(self, n: int) -> list[tuple[bytes, object]]:
        return self.events.oldest(n)

    def question(self, value_hashes: Sequence[bytes]) -> list[bytes]:
        return self.space.lookup_keys(value_hashes)

    def answered(
        self, asked: Sequence[tuple[bytes, object]], keys: Sequence[bytes], held: Sequence[bool]
    ) -> int:
        per_value = self.space.keys_per_value
        gone = [
            (value_hash, mark)
            for i, (value_hash, mark) in enumerate(asked)
            if not all(held[i * per_value : (i + 1) * per_value])
        ]
        return self.events.removed_unless_renewed(gone)


class ResidencyRecheck:
    """See the module docstring. Every method runs on vLLM's scheduler thread and returns at once."""

    def __init__(
        self,
        residency: Residency,
        client: LookupClient[tuple[bool, ...]],
        *,
        interval: float,
        values: int = RECHECK_VALUES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.residency = residency
        self.client = client
        self.interval = interval
        self.values = values
        self._clock = clock
        self._next = clock() + interval
        self._naming: list[tuple[bytes, object]] | None = None  # the next recheck's values, keys being named
        self._named = 0  # how many of them have their keys named, ``KEYS_PER_STEP`` values a step
        self._keys: list[bytes] = []  # those keys
        self._asking: tuple[str, list[tuple[bytes, object]], list[bytes]] | None = None  # (id, values, keys)
        # An answer being taken in, ``KEYS_PER_STEP`` values a step: (values, keys, answer), how many taken.
        self._taking: tuple[list[tuple[bytes, object]], list[bytes], tuple[bool, ...]] | None = None
        self._taken = 0
        self.rechecked = 0  # values the store answered about
        self.removed = 0  # of those, values found gone and announced removed

    def step(self) -> None:
        """Take in an answer, collect one, or prepare the next recheck when its time has come: a step
        names at most ``KEYS_PER_STEP`` values' keys (the step that names the last ones asks the store) or
        takes in the answer about as many."""
        if self._taking is not None:
            self._take_some()
            return
        if self._asking is not None:
            self._collect(*self._asking)
            return
        if self._naming is None:
            now = self._clock()
            if now < self._next:
                return
            self._next = now + self.interval
            self._naming = self.residency.oldest(self.values)
            self._named, self._keys = 0, []
        asked = self._naming
        chunk = asked[self._named : self._named + KEYS_PER_STEP]
        keys = self.residency.question([value_hash for value_hash, _ in chunk])
        if keys is None:  # not askable now (the local store before every pipeline stage is known)
            self._naming, self._keys = None, []
            return
        self._keys += keys
        self._named += len(chunk)
        if self._named < len(asked):
            return
        self._naming = None
        keys, self._keys = self._keys, []
        if not asked:
            return
        rid = f"asyncconn-recheck-{next(_IDS)}"
        self.client.submit(rid, keys)
        self._asking = (rid, asked, keys)

    def _collect(self, rid: str, asked: list[tuple[bytes, object]], keys: list[bytes]) -> None:
        got = self.client.poll_answer(rid)
        if got is None:
            return  # still out (the client resolves it as a miss at its timeout at the latest)
        self._asking = None
        answer, by_store = got
        if not by_store:
            return  # a timeout, an error or a refusal: says nothing about the values
        self.rechecked += len(asked)
        self._taking, self._taken = (asked, keys, answer), 0
        self._take_some()

    def _take_some(self) -> None:
        """The answer about the next ``KEYS_PER_STEP`` values, handed to the residency. Why a few at a
        time: the local store's residency settles every key of the answer in its mirror, which with eight
        ranks took vLLM's scheduler thread about 5 ms for 1,024 values in one step
        (``scripts/kv_events_cost.py``)."""
        assert self._taking is not None
        asked, keys, answer = self._taking
        per_value = len(keys) // len(asked)
        start = self._taken
        end = self._taken = min(start + KEYS_PER_STEP, len(asked))
        span = slice(start * per_value, end * per_value)
        self.removed += self.residency.answered(asked[start:end], keys[span], answer[span])
        if end == len(asked):
            self._taking = None

    @property
    def asking(self) -> bool:
        """Whether a recheck is prepared, out or being taken in (one at most: bounded, not per request;
        dropped by :meth:`close`)."""
        return self._asking is not None or self._naming is not None or self._taking is not None

    def close(self) -> None:
        self._asking = self._naming = self._taking = None
        self._keys = []
        self.client.close()
