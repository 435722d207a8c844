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

It runs from :meth:`KVSchedulerSide.build_connector_meta`, i.e. on engine steps: vLLM publishes events only
after a step, so an idle engine's removals are found and published when it next steps.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from asyncconn.lookup.client import LookupClient
from asyncconn.vllm.kv.events import KVEvents
from asyncconn.vllm.kv.keys import KeySpace

__all__ = ["KEYS_PER_STEP", "RECHECK_VALUES", "ResidencyRecheck"]

#: Values asked about per recheck at most: one ``EXISTS`` of this many values' keys (a pipeline of a few
#: thousand ``EXISTS`` on Redis, one batch query on Mooncake), small beside a prompt's own lookup traffic.
RECHECK_VALUES = 1024
#: Values whose keys one step names at most while a recheck is prepared. Why: a key is a hash per rank, and
#: naming 1,024 values' keys at once held vLLM's scheduler thread for milliseconds in one step with eight
#: ranks (``scripts/kv_events_cost.py``: docs/benchmarks.md); spread over steps, no step pays more than an
#: eighth of it.
KEYS_PER_STEP = 128

_IDS = itertools.count()


class ResidencyRecheck:
    """See the module docstring. Every method runs on vLLM's scheduler thread and returns at once."""

    def __init__(
        self,
        events: KVEvents,
        client: LookupClient[tuple[bool, ...]],
        space: KeySpace,
        *,
        interval: float,
        values: int = RECHECK_VALUES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.events = events
        self.client = client
        self.space = space
        self.interval = interval
        self.values = values
        self._clock = clock
        self._next = clock() + interval
        self._naming: list[tuple[bytes, object]] | None = None  # the next recheck's values, keys being named
        self._keys: list[bytes] = []  # their keys named so far, ``KEYS_PER_STEP`` values a step
        self._asking: tuple[str, list[tuple[bytes, object]]] | None = None  # (lookup id, values asked)
        self.rechecked = 0  # values the store answered about
        self.removed = 0  # of those, values found gone and announced removed

    def step(self) -> None:
        """Collect an answer, or prepare the next recheck when its time has come: a step names at most
        ``KEYS_PER_STEP`` values' keys, and the step that names the last ones asks the store."""
        if self._asking is not None:
            self._collect(*self._asking)
            return
        if self._naming is None:
            now = self._clock()
            if now < self._next:
                return
            self._next = now + self.interval
            self._naming = self.events.oldest(self.values)
            self._keys = []
        asked = self._naming
        named = len(self._keys) // self.space.keys_per_value
        chunk = asked[named : named + KEYS_PER_STEP]
        self._keys += self.space.lookup_keys([value_hash for value_hash, _ in chunk])
        if named + len(chunk) < len(asked):
            return
        self._naming = None
        keys, self._keys = self._keys, []
        if not asked:
            return
        rid = f"asyncconn-recheck-{next(_IDS)}"
        self.client.submit(rid, keys)
        self._asking = (rid, asked)

    def _collect(self, rid: str, asked: list[tuple[bytes, object]]) -> None:
        got = self.client.poll_answer(rid)
        if got is None:
            return  # still out (the client resolves it as a miss at its timeout at the latest)
        self._asking = None
        answer, by_store = got
        if not by_store:
            return  # a timeout, an error or a refusal: says nothing about the values
        per_value = self.space.keys_per_value
        gone = [
            (value_hash, mark)
            for i, (value_hash, mark) in enumerate(asked)
            if not all(answer[i * per_value : (i + 1) * per_value])
        ]
        self.rechecked += len(asked)
        self.removed += self.events.removed_unless_renewed(gone)

    @property
    def asking(self) -> bool:
        """Whether a recheck is prepared or out (one at most: bounded, not per request; dropped by
        :meth:`close`)."""
        return self._asking is not None or self._naming is not None

    def close(self) -> None:
        self._asking = self._naming = None
        self._keys = []
        self.client.close()
