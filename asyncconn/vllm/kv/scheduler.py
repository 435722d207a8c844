"""The KV connector's scheduler side: asynchronous prefix lookups, load and save planning, delayed frees.

Runs on vLLM's scheduler thread and never waits on I/O there (unless ``sync_lookup`` is set, which exists to
measure what it costs). A request's first ``get_num_new_matched_tokens`` submits one PREFIX lookup of its
values' keys (every TP rank's key for each value, value by value; on MLA the one key all ranks share) and
answers ``(None, False)`` -- "ask me next step" -- until the lookup client has the answer. The answer is
kept until the request's blocks are allocated, so a request the scheduler cannot admit yet does not
re-query the store every step; preemption, finish and abort drop it (a re-admitted request asks the store
anew: its old answer may be stale).

Every step, :meth:`KVSchedulerSide.build_connector_meta` tells the workers which values to load into which
freshly allocated blocks, and which values this step completes and the store does not have yet. A request
that ever had a save planned holds its blocks past ``request_finished`` (returns True) until the workers
report it in ``finished_sending``; one finished while its load runs holds them until every worker reports it
in ``finished_recving`` (vLLM's rule for finished requests), and the next metadata says so
(``finished_via_recv``) because only the scheduler sees the workers' merged reports.

On a hybrid model whose windowed groups are stored apart (:mod:`asyncconn.vllm.kv.parts`) a lookup takes
two kinds of questions, one per step at most: how many leading values' whole parts are there (``n``), then
whether the window parts a hit of ``n`` needs are there, newest first; a missing one at value ``m`` ends
every hit whose window holds it, so the next question is the window at ``m``, until one is complete or
``n`` is 0, or ``MAX_WINDOW_QUESTIONS`` have found no complete window (then the hit is 0). Saves store
every value's whole part and the window parts of the values inside the window at the step's cut.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncconn.lookup.client import LookupClient
from asyncconn.vllm.kv.events import KVEvents, SavedReport
from asyncconn.vllm.kv.groups import has_null, real_blocks
from asyncconn.vllm.kv.hostclaims import HostHits
from asyncconn.vllm.kv.keys import KeySpace
from asyncconn.vllm.kv.localevents import LocalTierEvents
from asyncconn.vllm.kv.localstore import LocalStoreHits
from asyncconn.vllm.kv.metadata import (
    AsyncConnKVMetadata,
    AsyncConnKVStats,
    LoadSpec,
    SaveSpec,
    ValueRef,
    lookup_totals,
)
from asyncconn.vllm.kv.ownremovals import OwnRemovals
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.recheck import ResidencyRecheck
from asyncconn.vllm.kv.stages import StageSpaces
from asyncconn.vllm.kv.tierevents import TierEvents

__all__ = ["IDLE_WAIT_S", "KVSchedulerSide"]

#: Window questions one lookup asks at most on a split hybrid model. Each costs the request a scheduler step
#: (the lookup is asynchronous); a window missing at value after value would otherwise hold it for one step
#: per value, for an ever shorter hit. After these, the hit is 0 and the prompt is computed.
MAX_WINDOW_QUESTIONS = 4

#: Longest wait for outstanding lookups on a step that scheduled no tokens (see ``build_connector_meta``):
#: a request arriving meanwhile is scheduled two milliseconds later at worst.
IDLE_WAIT_S = 0.002


@dataclass
class _Req:
    """What the scheduler side remembers about one live request."""

    request: Any  # vllm.v1.request.Request: its block_hashes grow as tokens are appended
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group
    stored_values: int = 0  # leading values present in the store or already planned for saving
    window_saved: int = 0  # window parts (split hybrid) planned below this value index
    had_saves: bool = False
    loading: dict[int, frozenset[int]] | None = None  # value index -> blocks an async load writes
    load_failed: bool = False  # its load was reported in failed_recving: it computes, never loads again


class KVSchedulerSide:
    """Plain scheduler-side logic; the connector facade delegates to it.

    ``lookup`` is None for a producer-only instance (nothing is ever loaded); ``save`` False for a
    consumer-only one. ``sync_lookup`` blocks in the scheduler until each lookup answers (baseline only).
    ``sync_loads`` makes loads synchronous in vLLM's sense: a request is scheduled on top of its hit at
    once, and the step that schedules it waits (on the workers) for its values before the forward.
    ``events`` (vLLM's KV events on): planned values are snapshotted there and published once the workers
    confirm them (:mod:`asyncconn.vllm.kv.events`). ``parts``: how a value is split (default: one part,
    every layer, under ``keys``). ``host``: how the tokens a planned load reads from the workers' host
    tiers are known, to count them as ``host`` (:mod:`asyncconn.vllm.kv.hostclaims`,
    :mod:`asyncconn.vllm.kv.tiernews`). ``tier_events`` (KV events on, the tiers reporting to ``host``):
    the host tiers' own events, snapshotted at every planned save and load
    (:mod:`asyncconn.vllm.kv.tierevents`). ``local_store`` (a ``local_store_url``, one-part values): the
    local store is asked beside the shared one, to count the tokens it serves as ``disk``
    (:mod:`asyncconn.vllm.kv.localstore`). ``local_events`` (KV events on, a ``local_store_url``): the
    local store's own events, snapshotted like the tiers' and fed by the workers' reports
    (:mod:`asyncconn.vllm.kv.localevents`). ``spaces``: every pipeline stage's key space, as the workers'
    reports name them (:mod:`asyncconn.vllm.kv.stages`; shared with all of the above). ``recheck`` (the
    store's KV events on, ``kv_events_recheck``): values announced stored are asked about again on a timer,
    so a removal the store never reports is announced (:mod:`asyncconn.vllm.kv.recheck`); its attribute
    ``local_recheck`` does the same for ``local_events``.
    """

    def __init__(
        self,
        keys: KeySpace,
        *,
        lookup: LookupClient[int] | None,
        save: bool,
        sync_lookup: bool = False,
        sync_loads: bool = False,
        events: KVEvents | None = None,
        parts: ValueParts | None = None,
        host: HostHits | None = None,
        tier_events: TierEvents | None = None,
        local_store: LocalStoreHits | None = None,
        local_events: LocalTierEvents | None = None,
        spaces: StageSpaces | None = None,
        recheck: ResidencyRecheck | None = None,
    ) -> None:
        self.keys = keys
        self.recheck = recheck
        #: The local store's residency asked again (set with ``local_events``, by the connector).
        self.local_recheck: ResidencyRecheck | None = None
        #: What the stores this process opened for its lookups removed (hooked by the connector, with
        #: KV events on: :mod:`asyncconn.vllm.kv.ownremovals`).
        self.own_removals = OwnRemovals()
        self._rechecked = (0, 0)  # both rechecks' counters at the last stats()
        self.host = host
        self.local_store = local_store
        self.tier_events = tier_events
        self.local_events = local_events
        if spaces is None:
            spaces = events.spaces if events is not None else StageSpaces(keys)
        self.spaces = spaces
        self.parts = parts if parts is not None else ValueParts.single(keys)
        self.events = events
        self._events_dropped = 0  # ``events.dropped`` at the last stats()
        self.lookup = lookup
        self.save = save
        self.sync_lookup = sync_lookup
        self.sync_loads = sync_loads
        self._reqs: dict[str, _Req] = {}
        self._hits: dict[str, int] = {}  # request id -> values present, answered and not yet allocated
        # request id -> (the hit whose window parts are being asked about, window questions answered so far)
        self._probes: dict[str, tuple[int, int]] = {}
        self._by_store = False  # whether the store gave the last answer ``_ask`` returned (see ``_absent``)
        self._local: dict[str, int] = {}  # request id -> values in vLLM's own prefix cache, until allocated
        self._loads: list[LoadSpec] = []  # planned since the last build_connector_meta
        self._via_recv: set[str] = set()  # finished while loading, since the last build_connector_meta
        self._stats = AsyncConnKVStats()
        self._lookups_seen = 0  # lookup latencies recorded at the last stats() (its fast path)
        self._totals = lookup_totals(lookup)  # timeouts, errors, the store's reachability: as changes

    # -- lookups ---------------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """``(None, False)`` while the lookup is in flight; then ``(tokens to load, True)`` or ``(0, False)``
        (``(tokens to load, False)`` with ``sync_loads``).

        Never waits (unless ``sync_lookup``): an outstanding lookup is only polled. The values vLLM's own
        prefix cache covers are remembered as stored: they were saved by the engine that computed them or
        loaded from the store. Without this, a prompt the local cache covers entirely (nothing to ask the
        store) and every turn of a conversation on a producer (which never asks) would save them again: a
        gather and a copy of every such value, which the store then refuses as existing.
        """
        rid = request.request_id
        tpv = self.keys.tokens_per_value
        if num_computed_tokens >= tpv:
            self._local[rid] = num_computed_tokens // tpv
        else:  # the latest call counts: the local hit may have been evicted since an earlier one
            self._local.pop(rid, None)
        if self.lookup is None:
            return 0, False
        state = self._reqs.get(rid)
        if state is not None and state.load_failed:
            return 0, False  # one try: a value the lookup finds but the load cannot read would loop
        hashes = self.keys.value_hashes(request.block_hashes)
        # vLLM must compute at least the last prompt token itself, so a hit never covers it.
        usable = min(len(hashes), max(request.num_tokens - 1, 0) // tpv)
        if usable * tpv <= num_computed_tokens:
            return 0, False  # the local prefix cache already covers everything the store could add
        hit = self._hits.get(rid)
        if hit is None:
            hit = self._search(rid, hashes, usable)
            if hit is None:
                return None, False
            self._hits[rid] = hit
            self._stats.add("lookups")
            if hit:
                self._stats.add("lookup_hits")
                self._stats.add("lookup_tokens_hit", hit * tpv)
        hit_tokens = hit * tpv
        if hit_tokens <= num_computed_tokens:
            return 0, False
        if self.local_store is not None and not self.local_store.answered(rid):
            return None, False  # the local store's answer splits the hit by source: a step at most, bounded
        return hit_tokens - num_computed_tokens, not self.sync_loads

    def _search(self, rid: str, hashes: list[bytes], usable: int) -> int | None:
        """The values a hit covers (None: a question is in flight). One part: the leading values present.
        Split (see the module docstring): the longest ``n`` with every whole part below it and the window
        parts ``n`` needs."""
        parts = self.parts
        if parts.window is None:
            answer = self._ask(rid, self.keys, hashes[:usable])
            if answer is None:
                return None
            present = min(answer // self.keys.keys_per_value, usable)
            if present < usable:
                self._absent(hashes[present])
            return present
        probe = self._probes.get(rid)
        if probe is not None:
            n, asked = probe
        else:
            asked = 0
            if parts.whole is None:
                n = usable
            else:
                whole = parts.keys[parts.whole]
                answer = self._ask(rid, whole, hashes[:usable])
                if answer is None:
                    return None
                n = min(answer // whole.keys_per_value, usable)
        window = parts.keys[parts.window]
        while n > 0:
            if asked >= MAX_WINDOW_QUESTIONS:
                n = 0  # recomputing costs less than another step's wait for a shorter hit
                break
            need = hashes[parts.first_window_value(n) : n][::-1]  # newest first: a miss names the latest
            answer = self._ask(rid, window, need)
            if answer is None:
                self._probes[rid] = (n, asked)
                return None
            asked += 1
            present = answer // window.keys_per_value
            if present >= len(need):
                break
            n -= present + 1  # value n-1-present is missing: no hit above it can use its window
        self._probes.pop(rid, None)
        return n

    def _ask(self, rid: str, space: KeySpace, value_hashes: list[bytes]) -> int | None:
        lookup = self.lookup
        assert lookup is not None
        self._by_store = False
        if lookup.pending(rid):
            return self._answer(lookup, rid)
        keys = space.lookup_keys(value_hashes)
        if self.local_store is not None:  # one-part values only: ``space`` is ``self.keys``
            local = self._local_keys(value_hashes, keys)
            if local is not None:
                self.local_store.ask(rid, local)
        if self.sync_lookup:
            return lookup.lookup_sync(rid, keys)
        lookup.submit(rid, keys)
        return self._answer(lookup, rid)

    def _answer(self, lookup: LookupClient[int], rid: str) -> int | None:
        got = lookup.poll_answer(rid)
        if got is None:
            return None
        answer, self._by_store = got
        return answer

    def _absent(self, value_hash: bytes) -> None:
        """The store answered that ``value_hash`` is missing (the first value past a hit): if this engine
        announced it stored, it has left the store -- how routers hear of removals a store never reports
        (Mooncake's evictions, a value deleted behind the store's back)."""
        if self._by_store and self.events is not None:
            self.events.removed((value_hash,))

    def _local_keys(self, value_hashes: list[bytes], keys: list[bytes]) -> list[bytes] | None:
        """The local store's question: ``keys`` on one stage; under pipeline parallelism every stage's
        keys of each value, value by value, once every stage's key space is known (until then, none: no
        token is counted as ``disk`` that a later stage might read from the shared store)."""
        if self.spaces.stages == 1:
            return keys
        return self.spaces.value_keys(self.keys, value_hashes)

    # -- allocation ------------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Remember the request; plan its load when the scheduler granted external tokens."""
        rid = request.request_id
        state = self._reqs.get(rid)
        if state is None:
            state = self._reqs[rid] = _Req(request)
        hit = self._hits.pop(rid, None)
        if hit is not None:
            state.stored_values = max(state.stored_values, hit)
        local = self._local.pop(rid, None)
        if local is not None:
            state.stored_values = max(state.stored_values, local)
        if num_external_tokens <= 0 or hit is None:
            if self.local_store is not None:  # nothing to split: its question (or answer) goes
                self.local_store.release(rid)
            return
        block_size = self.keys.identity.block_size
        bpv = self.keys.blocks_per_value
        groups = [list(g) for g in blocks.get_block_ids()]
        end_block = hit * bpv
        first_block = end_block - num_external_tokens // block_size
        hashes = self.keys.value_hashes(request.block_hashes)
        parts = self.parts
        window_from = parts.first_window_value(hit)
        values: list[ValueRef] = []
        named: list[tuple[int, bytes]] = []  # (index, hash) of the values whose first part it loads
        loading: dict[int, frozenset[int]] = {}
        tokens: list[tuple[int, int]] = []  # (index, tokens loaded) of each value
        for v in range(first_block // bpv, hit):
            positions = tuple(j for j in range(bpv) if v * bpv + j >= first_block)
            tokens.append((v, len(positions) * block_size))
            ids = tuple(tuple(g[v * bpv + j] for j in positions) for g in groups)
            if parts.whole is not None:
                values.append(ValueRef(hashes[v], positions, ids, parts.whole))
            if parts.window is not None and v >= window_from:
                values.append(ValueRef(hashes[v], positions, ids, parts.window))
            if parts.whole == 0 or (parts.window == 0 and v >= window_from):
                named.append((v, hashes[v]))
            loading[v] = frozenset(real_blocks(ids))
        if not self.sync_loads:  # a sync load ends with its step (``update_connector_output``)
            state.loading = loading
        if self.host is not None:  # (a sync load's claims are held until the request ends)
            self.host.claim(rid, values)
        if self.local_store is not None:
            self.local_store.planned(rid, tokens)
        if self.tier_events is not None:  # the load puts them in the tiers
            self.tier_events.planned(request, named)
        if self.local_events is not None:  # and in the local store
            self.local_events.planned(request, named)
        self._loads.append(LoadSpec(rid, tuple(values), sync=self.sync_loads))

    def _learn_stages(self, layers: Mapping[int, tuple[str, ...]]) -> None:
        """Later pipeline stages named their layers: whoever names values by their keys learns their keys
        (one :class:`~asyncconn.vllm.kv.stages.StageSpaces` shared by all of them)."""
        if not self.spaces.learn(layers):
            return
        for follower in (self.events, self.tier_events, self.local_events):
            if follower is not None:
                follower.remap()

    def host_tokens(self, rid: str) -> int:
        """Tokens of ``rid``'s planned load that the host tier serves (asked once, right after planning)."""
        return self.host.take_tokens(rid) if self.host is not None else 0

    def local_store_tokens(self, rid: str) -> int:
        """Tokens of ``rid``'s planned load that the local store holds (asked once, right after planning;
        the host tier's among them)."""
        return self.local_store.take_tokens(rid) if self.local_store is not None else 0

    # -- every step ------------------------------------------------------------------------------------
    def build_connector_meta(self, so: Any) -> AsyncConnKVMetadata:
        """Loads planned since the last step, saves this step completes, this step's preemptions.

        On a step that scheduled no tokens while lookups are outstanding, waits up to ``IDLE_WAIT_S`` for
        their answers (``LookupClient.wait``, which hands the GIL to the loop thread and returns as soon as
        the last answer is in): otherwise vLLM's back-to-back empty steps starve the loop that answers them,
        and each request waits tens of empty steps before its admission. A step with work never waits.
        """
        self.own_removals.step(self.events, self.local_events)
        for recheck in self._rechecks():
            recheck.step()
        preempted = frozenset(so.preempted_req_ids or ())
        for rid in so.finished_req_ids:
            self._forget(rid)
        for rid in preempted:
            self._hits.pop(rid, None)
            self._probes.pop(rid, None)
            if self.host is not None:
                self.host.release(rid)
            if self.local_store is not None:
                self.local_store.release(rid)
            if self.lookup is not None:
                self.lookup.discard(rid)
        step_tokens = int(getattr(so, "total_num_scheduled_tokens", -1))
        via_recv = frozenset(self._via_recv) if self._via_recv else frozenset()
        meta = AsyncConnKVMetadata(
            loads=self._loads,
            preempted=preempted,
            finished_via_recv=via_recv,
            step_tokens=step_tokens,
            tier_acks=self.host.acks() if self.host is not None else {},
            stages_known=self.spaces.complete,
        )
        if self._loads:
            self._loads = []
        if via_recv:
            self._via_recv.clear()
        if step_tokens == 0 and self.lookup is not None and not self.sync_lookup:
            self.lookup.wait(IDLE_WAIT_S)
            if self.local_store is not None:
                self.local_store.wait(IDLE_WAIT_S)
        if not self.save:
            return meta
        for new in so.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is None:
                continue
            state.block_ids = [list(g) for g in new.block_ids]
            self._plan_saves(
                meta, new.req_id, state, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]
            )
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            state = self._reqs.get(rid)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                state.block_ids = [list(g) for g in new_ids] if new_ids is not None else []
            elif new_ids is not None:
                if not state.block_ids:
                    state.block_ids = [[] for _ in new_ids]
                for group, ids in zip(state.block_ids, new_ids, strict=True):
                    group.extend(ids)
            computed = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
            self._plan_saves(meta, rid, state, computed)
        return meta

    def _plan_saves(self, meta: AsyncConnKVMetadata, rid: str, state: _Req, computed: int) -> None:
        if computed // self.keys.tokens_per_value <= state.stored_values:
            return  # no value completed since the last plan (most decode steps): no hash list built
        bpv = self.keys.blocks_per_value
        hashes = self.keys.value_hashes(state.request.block_hashes)
        full = min(computed // self.keys.tokens_per_value, len(hashes))
        if state.block_ids:
            full = min(full, min(len(g) for g in state.block_ids) // bpv)
        if full <= state.stored_values:
            return
        parts = self.parts
        whole = tuple(range(bpv))
        planned: list[tuple[int, ValueRef]] = []

        def ids(v: int) -> tuple[tuple[int, ...], ...]:
            return tuple(tuple(g[v * bpv : (v + 1) * bpv]) for g in state.block_ids)

        if parts.window is None:
            # One part of every layer: a value with the null block somewhere (a windowed group's, were one
            # ever stored this way) cannot be saved whole, so it is skipped (a later hit stops before it).
            for v in range(state.stored_values, full):
                ref = ValueRef(hashes[v], whole, ids(v))
                if not has_null(ref.block_ids):
                    planned.append((v, ref))
        else:
            if parts.whole is not None:
                planned.extend(
                    (v, ValueRef(hashes[v], whole, ids(v), parts.whole))
                    for v in range(state.stored_values, full)
                )
            # The window parts inside the window at this cut; one holding a null block (freed before this
            # step) is skipped: stored with zeros there, a hit at an earlier cut would read them.
            for v in range(max(parts.first_window_value(full), state.window_saved), full):
                ref = ValueRef(hashes[v], whole, ids(v), parts.window)
                if not has_null(ref.block_ids):
                    planned.append((v, ref))
            state.window_saved = full
        state.stored_values = full
        if not planned:
            return
        state.had_saves = True
        meta.saves.append(SaveSpec(rid, tuple(ref for _, ref in planned)))
        if self.events is not None:  # a value is announced by its first part (its hash is its ident)
            named = [(v, ref.value_hash) for v, ref in planned if ref.part == 0]
            self.events.planned(rid, state.request, named)
            if self.tier_events is not None:  # the save puts them in the tiers too
                self.tier_events.planned(state.request, named)
            if self.local_events is not None:  # and in the local store
                self.local_events.planned(state.request, named)

    def update_connector_output(self, output: Any) -> None:
        """A received request's blocks are the scheduler's again; failed values are saved anew later.

        A request in ``failed_recving`` (a model with several KV cache groups) failed as a whole: vLLM
        computes it from its local prefix-cache hit, every value it was loading is saved anew (the store
        skips those it holds already), and it is never offered a store hit again.

        A sync load ends with the step that planned it (the workers waited for it), so nothing is kept for
        it. Its failed blocks may be shared, through vLLM's prefix cache, by requests that computed on top
        of them in that step; vLLM recomputes those too, and the workers saved nothing that step, so every
        request holding an invalid block -- the one that loaded it included -- saves again from the value
        that holds it.
        """
        events = self.events
        report = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(report, SavedReport) and report.layers:
            self._learn_stages(report.layers)
        if self.host is not None and isinstance(report, SavedReport) and report.tiers:
            self.host.update(report.tiers)
            if self.tier_events is not None:
                self.tier_events.update(report.tiers)
        if self.local_events is not None and isinstance(report, SavedReport) and report.local:
            self.local_events.update_local(report.local)
        if events is not None:  # the workers' confirmations first: a finished request's come with it
            if isinstance(report, SavedReport):
                events.update(report)
            for rid in output.finished_sending or ():
                events.release(rid)
        invalid = set(output.invalid_block_ids or ())
        failed = set(getattr(output, "failed_recving", None) or ())
        for rid in output.finished_recving or ():
            if self.host is not None:  # its load has read the tier
                self.host.release(rid)
            state = self._reqs.get(rid)
            if state is None or state.loading is None:
                continue
            if rid in failed:  # reported per request (several KV cache groups): vLLM recomputes it all
                state.load_failed = True
                bad = list(state.loading)
            else:
                bad = [v for v, blocks in state.loading.items() if blocks & invalid]
            if bad:  # the store lacks (or has a bad copy of) these values: let this request save them
                state.stored_values = min(state.stored_values, *bad)
            state.loading = None
        if invalid and self.sync_loads:
            bpv = self.keys.blocks_per_value
            for state in self._reqs.values():
                for group in state.block_ids:
                    first = next((i for i, b in enumerate(group) if b in invalid), None)
                    if first is not None:
                        state.stored_values = min(state.stored_values, first // bpv)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """True -- keep the blocks -- while a save may read them or a load may write them.

        A request finished while loading is freed by vLLM when every worker has reported it in
        ``finished_recving`` (the workers are told through ``finished_via_recv``); any other request
        holding blocks is freed when every worker has reported it in ``finished_sending``.
        """
        rid = request.request_id
        state = self._reqs.get(rid)
        self._forget(rid)
        released = state is None or state.loading is not None or not state.had_saves
        if released and self.events is not None:  # no finished_sending will come for it
            self.events.release(rid)
        if state is None:
            return False, None
        if state.loading is not None:
            self._via_recv.add(rid)
            return True, None
        return state.had_saves, None

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: the KV events since the last call (none when events are off)."""
        return self.events.take() if self.events is not None else []

    def _forget(self, rid: str) -> None:
        self._reqs.pop(rid, None)
        self._hits.pop(rid, None)
        self._probes.pop(rid, None)
        self._local.pop(rid, None)
        if self.host is not None:
            self.host.release(rid)
        if self.local_store is not None:
            self.local_store.release(rid)
        if self.lookup is not None:
            self.lookup.discard(rid)

    # -- observability ---------------------------------------------------------------------------------
    def stats(self) -> AsyncConnKVStats | None:
        """Lookup counters and latencies since the previous call (None when nothing happened)."""
        lookup = self.lookup
        observed = sum(lookup.metrics.latency_buckets) if lookup is not None else 0
        changed = self._totals.take()
        dropped = self.own_removals.dropped + (self.events.dropped if self.events is not None else 0)
        if dropped != self._events_dropped:
            changed["events_dropped"] = dropped - self._events_dropped
            self._events_dropped = dropped
        rechecks = self._rechecks()
        now = (sum(r.rechecked for r in rechecks), sum(r.removed for r in rechecks))
        if now != self._rechecked:
            changed["events_rechecked"] = now[0] - self._rechecked[0]
            changed["events_recheck_removed"] = now[1] - self._rechecked[1]
            self._rechecked = now
        if observed == self._lookups_seen and not changed and self._stats.is_empty():
            return None  # nothing happened since the last call (most steps): nothing allocated
        self._lookups_seen = observed
        stats, self._stats = self._stats, AsyncConnKVStats()
        for name, change in changed.items():
            stats.add(name, change)
        if lookup is not None:
            taken = lookup.metrics.take()
            buckets = taken.get("latency_buckets")
            if isinstance(buckets, list):
                stats.merge_histogram("lookup_latency", buckets)
        return None if stats.is_empty() else stats

    def held(self) -> dict[str, int]:
        """Sizes of every per-request structure (tests count them back to zero)."""
        out = {
            "requests": len(self._reqs),
            "hits": len(self._hits),
            "probes": len(self._probes),
            "local_hits": len(self._local),
            "planned_loads": len(self._loads),
            "finished_via_recv": len(self._via_recv),
        }
        if self.lookup is not None:
            out.update({f"lookup_{k}": v for k, v in self.lookup.held().items()})
        if self.events is not None:
            out.update(self.events.held())
        if self.host is not None:
            out.update(self.host.held())
        if self.local_store is not None:
            out.update(self.local_store.held())
        out.update(self.own_removals.held())
        return out

    def _rechecks(self) -> list[ResidencyRecheck]:
        return [r for r in (self.recheck, self.local_recheck) if r is not None]

    def close(self) -> None:
        self._reqs.clear()
        self._hits.clear()
        self._probes.clear()
        self._local.clear()
        self._loads.clear()
        self._via_recv.clear()
        if self.host is not None:
            self.host.close()
        if self.tier_events is not None:
            self.tier_events.close()
        if self.local_events is not None:
            self.local_events.close()
        if self.events is not None:
            self.events.close()
        self.own_removals.close()
        for recheck in self._rechecks():  # before the lookups: they may share their stores
            recheck.close()
        if self.local_store is not None:
            self.local_store.close()
        if self.lookup is not None:
            self.lookup.close()
