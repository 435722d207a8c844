"""KV events for the local store (``local_store_url``): ``BlockStored`` once this host's directory holds a
value (every rank's key of it), ``BlockRemoved`` once it lets one go, under the local store's own name.

A router that knows a prompt's KV sits on this host's disk can send the prompt here and have it loaded
without touching the shared store -- the same reason the host tiers publish theirs
(:mod:`asyncconn.vllm.kv.tierevents`). The local store is named as vLLM names an offloading tier's residency:
``STORAGE``, ``LOCAL``, ``asyncconn:local`` (:data:`LOCAL_TIER`); the shared store's events keep its name, so
a value the local sweep drops stays in the store's residency.

What the directory holds is heard in the workers, where the local store runs
(:attr:`asyncconn.layered.LayeredBackend.on_local`, on the loop thread): keys it took in or served, keys it
let go (a delete, its own ``max_bytes`` / ``max_age`` sweep). Each worker buffers them (:class:`LocalNews`,
bounded) and reports them in order with its step's report; the scheduler keeps, for the values it has
snapshotted a payload for (a planned save or load, as for the host tiers), which of their keys the
directory holds (:class:`LocalMirror`), and publishes a value when every rank's key is there.

Any worker may report any rank's key: the directory is shared by the ranks on this host, and the one whose
sweep ran reports what it removed (the scheduler's process, whose own store of the directory may sweep it
too, hears its sweeps itself: :mod:`asyncconn.vllm.kv.ownremovals`). What no process of this engine can
hear -- another engine sharing the directory writing or sweeping it, a file deleted behind the store's
back -- is found by asking the directory again on a timer (``kv_events_recheck``,
:mod:`asyncconn.vllm.kv.recheck`): :class:`LocalTierEvents` is that recheck's :class:`Residency` too. An
answer changes only the keys no report changed since the question was prepared (the mirror counts its
changes): a report may describe a change made after the directory answered. Values left in the directory
by an earlier run are announced when a load reads them or a recheck finds them. The lookup that counts
``disk`` hits asks the directory itself (:mod:`.localstore`), never this.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Sequence

from asyncconn.lookup.protocol import store_key
from asyncconn.vllm.kv.events import MAX_VALUES, KVEvents, Tier
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.stages import StageSpaces
from asyncconn.vllm.kv.tierevents import TierEvents

__all__ = ["LOCAL_TIER", "LocalChange", "LocalMirror", "LocalNews", "LocalTierEvents"]

#: The local store in vLLM's words (its hits are counted as ``disk``).
LOCAL_TIER = Tier("STORAGE", "LOCAL", "asyncconn:local", "disk")

#: A key the local store holds now (True) or let go (False).
LocalChange = tuple[str, bool]


class LocalNews:
    """A worker's buffer of the local store's changes, until its next report.

    :meth:`heard` is the store's ``on_local`` hook (the loop thread); :meth:`take` runs on vLLM's worker
    thread. A lock guards the buffer, never held across I/O. Bounded by ``MAX_VALUES``: what overflows is
    counted in ``dropped`` (its events are lost, never wrong: a later change of the key corrects it).
    """

    def __init__(self) -> None:
        self._changes: list[LocalChange] = []
        self._lock = threading.Lock()
        self.dropped = 0

    def heard(self, keys: Sequence[str], held: bool) -> None:
        with self._lock:
            room = MAX_VALUES - len(self._changes)
            if len(keys) > room:
                self.dropped += len(keys) - max(room, 0)
                keys = keys[: max(room, 0)]
            self._changes.extend((key, held) for key in keys)

    def take(self) -> list[LocalChange]:
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def held(self) -> int:
        return len(self._changes)


class LocalMirror:
    """Which keys of the values the scheduler follows the local store holds (bounded by what it follows:
    keys it has not snapshotted a value for are never kept), and when each last changed (a count of the
    changes applied, :attr:`generation`: a recheck's answer must not undo a change reported after it was
    prepared)."""

    def __init__(self, parts: ValueParts, tp_size: int, spaces: StageSpaces | None = None) -> None:
        self.parts = parts
        self.spaces = spaces if spaces is not None else StageSpaces(parts.keys[0])
        self._tp = tp_size
        self._held: set[str] = set()
        self._changed: dict[str, int] = {}  # key -> the generation of its last reported change
        self.generation = 0

    def keys_of(self, value_hashes: Sequence[bytes]) -> list[tuple[str, bytes]]:
        """(key, value hash) of every worker's key of ``value_hashes``."""
        return self.spaces.keys_of(value_hashes)

    def apply(self, key: str, held: bool) -> None:
        """A worker's report: the directory took ``key`` in or let it go."""
        self.generation += 1
        self._changed[key] = self.generation
        if held:
            self._held.add(key)
        else:
            self._held.discard(key)

    def settle(self, key: str, held: bool, since: int) -> bool:
        """A recheck's answer about ``key``, asked once the mirror was at generation ``since``: taken
        unless a report changed the key after that (the report may postdate the answer). Whether it
        changed what the mirror holds."""
        if self._changed.get(key, 0) > since or (key in self._held) == held:
            return False
        if held:
            self._held.add(key)
        else:
            self._held.discard(key)
        return True

    def forget(self, keys: Iterable[str]) -> None:
        for key in keys:
            self._held.discard(key)
            self._changed.pop(key, None)

    def everywhere(self, part: int, value_hash: bytes) -> bool:
        """Whether the directory holds every rank's key of part ``part`` of ``value_hash`` (of every
        pipeline stage: False while a stage's key space is not known yet)."""
        spaces = self.spaces.every_stage(self.parts.keys[part])
        if spaces is None:
            return False
        held = self._held
        return all(space.store_key(value_hash, rank) in held for space in spaces for rank in range(self._tp))

    def __len__(self) -> int:
        return len(self._held)

    def close(self) -> None:
        self._held.clear()
        self._changed.clear()


class LocalTierEvents(TierEvents):
    """The scheduler side's local-store events: the host tiers' bookkeeping (:class:`TierEvents`: payloads
    snapshotted at planned saves and loads, published when held, removed when let go) over a
    :class:`LocalMirror` fed by the workers' :class:`LocalNews`. Runs on vLLM's scheduler thread."""

    mirror: LocalMirror

    def __init__(self, events: KVEvents, mirror: LocalMirror) -> None:
        super().__init__(events, mirror, LOCAL_TIER)

    def update_local(self, changes: Iterable[LocalChange]) -> None:
        """The workers' changes of a step, in order: applied for the values followed, then published."""
        changed: dict[bytes, None] = {}
        for key, held in changes:
            value_hash = self._key_to_value.get(key)
            if value_hash is not None:
                self.mirror.apply(key, held)
                changed[value_hash] = None
        self._publish(changed)

    # -- asked again (asyncconn.vllm.kv.recheck.Residency) -------------------------------------------------
    def oldest(self, n: int) -> list[tuple[bytes, object]]:
        """The ``n`` values followed longest ago (published or not), moved to the back, each with the
        mirror's generation now: the next call hands out the next ones. (A value just asked about is as
        well known as one planned now, so the turn also decides which are forgotten first.)"""
        known = self._known
        out = list(itertools.islice(known, n))
        for value_hash in out:
            known.move_to_end(value_hash)
        since = self.mirror.generation
        return [(value_hash, since) for value_hash in out]

    def question(self, value_hashes: Sequence[bytes]) -> list[bytes] | None:
        """Every pipeline stage's keys of each value, value by value (None until every stage's key space
        is known: a later stage's copies could not be asked about)."""
        return self.mirror.spaces.value_keys(self.mirror.parts.keys[0], value_hashes)

    def answered(
        self, asked: Sequence[tuple[bytes, object]], keys: Sequence[bytes], held: Sequence[bool]
    ) -> int:
        """What the directory holds of the values still followed, settled in the mirror (a key a worker
        reported since the question was prepared keeps the report's word), then published: a value found
        whole is announced stored, one found missing a key removed. Returns how many were removed."""
        if not asked:
            return 0
        per_value = len(keys) // len(asked)
        prefix = self.mirror.parts.keys[0].key_prefix
        changed: list[bytes] = []
        for i, (value_hash, since) in enumerate(asked):
            if value_hash not in self._known:
                continue  # forgotten since: its keys are no longer mirrored
            assert isinstance(since, int)
            span = range(i * per_value, (i + 1) * per_value)
            settled = [self.mirror.settle(store_key(prefix, keys[j]), held[j], since) for j in span]
            if any(settled):
                changed.append(value_hash)
        return self._publish(changed)

    def _forget_oldest(self) -> None:
        value_hash = next(iter(self._known))
        super()._forget_oldest()
        self.mirror.forget(key for key, _ in self.mirror.keys_of((value_hash,)))

    def close(self) -> None:
        super().close()
        self.mirror.close()
