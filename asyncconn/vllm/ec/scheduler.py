"""The EC connector's scheduler side: non-blocking lookups, prefetch admission, the E->PD race, failures.

vLLM calls ``ensure_cache_available`` for every waiting multimodal request on every step and
``has_cache_item`` for every item it is about to schedule, inside ``schedule()``. Both answer from state held
here, never from a store call: a lookup is submitted once (through :class:`~asyncconn.lookup.LookupClient`,
answered on the runtime loop) and its answer is polled on later steps.

An item the lookup finds goes through these states (one :class:`_Item` per mm hash, shared by every
request that needs it)::

    LOOKUP -> FOUND -> ORDERED -> READY -> INSTALLED   the prefetch path (the request waits meanwhile)
    LOOKUP -> ARRIVING -> (looked up again) -> FOUND   E announced it is saving it (bounded wait)
    LOOKUP -> MISS                                     not stored, lookup error or timeout: encoder runs
    FOUND, ORDERED or ARRIVING -> MISS                 released to the encoder (stalled engine, full budget)
    ORDERED -> MISS                                    a worker's prefetch failed: encoder runs

The one rule that keeps vLLM from crashing: ``has_cache_item`` is True only for a READY item, one that
*every* worker has reported staged (loaded, checked, held). vLLM then plans no encoder run for it and
``_gather_mm_embeddings`` raises ("Encoder cache miss") if it is not in ``encoder_cache`` by the forward
pass; a staged copy cannot fail to install, whereas a load started at install can (store down, value gone
or corrupt, timeout). Anything not yet confirmed is either waited for or planned for the encoder.

Waiting needs the workers to run: ORDERED items reach them in the step metadata and readiness comes back in
their reports, and vLLM's V1 GPU model runner skips the EC hooks on a step that schedules no tokens (its
V2 runner calls them, ``no_forward``). A worker that sees an empty step's metadata says so in its report;
until one has, an engine whose previous step scheduled nothing is *stalled*: nothing would ever move a
prefetch. Then one waiting request per step is released -- its found, ordered or announced items go to
the encoder -- which makes the step non-empty, so the other requests' prefetches start. The staging budget
(``max_inflight_loads`` items ordered and not installed) is bounded the same way: past it an item goes to
the encoder rather than waiting, so admission can never deadlock on staging held by waiting requests.

Preemption: vLLM frees a preempted request's encoder inputs; when it comes back its installed and missed
items are looked up again (the store may have lost or gained them since) and it waits for nothing vLLM
already allocated to it before.

Only the scheduler thread calls this class; the lookup client is the only thing shared with the loop.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncconn.config import Settings
from asyncconn.lookup import EXISTS, LookupClient
from asyncconn.vllm.ec.metadata import SAVING_PARAM, ECStepMetadata, ECWorkerReport, ItemRef

__all__ = ["ECSchedulerSide", "ItemState"]

log = logging.getLogger(__name__)

#: How soon PD looks again for an item E announced but that was not in the store yet; each further look
#: waits twice as long, up to ARRIVAL_POLL_MAX_S. An item usually lands within milliseconds, so the first
#: looks are quick; one that never lands (E's store went down) costs a few dozen lookups until
#: ``arrival_timeout``, not one every few milliseconds. E polls its own unconfirmed saves the same way.
ARRIVAL_POLL_S = 0.005
ARRIVAL_POLL_MAX_S = 0.1
#: How long an otherwise idle producer sleeps per step while its saves are unconfirmed.
IDLE_YIELD_S = 0.0005
_PUSH_PREFIX = "\x00push:"  # lookup ids of the producer's own save confirmations (never a request id)


class ItemState(enum.Enum):
    NEW = "new"  # known, no lookup in flight (the owner of a lookup went away)
    LOOKUP = "lookup"
    MISS = "miss"
    ARRIVING = "arriving"
    FOUND = "found"
    ORDERED = "ordered"
    READY = "ready"
    INSTALLED = "installed"


_WAIT = frozenset({ItemState.NEW, ItemState.LOOKUP, ItemState.ARRIVING, ItemState.FOUND, ItemState.ORDERED})
#: Waiting states a stalled engine may hand to the encoder (a lookup still in flight is waited for: it
#: progresses on the loop thread, and meanwhile a V2 runner's workers can say they run on empty steps).
_RELEASABLE = frozenset({ItemState.ARRIVING, ItemState.FOUND, ItemState.ORDERED})


@dataclass(slots=True)
class _Item:
    ref: ItemRef
    state: ItemState
    owner: str | None = None  # request whose lookup decides this item while LOOKUP
    requests: set[str] = field(default_factory=set)
    ready_on: set[str] = field(default_factory=set)  # worker ids that staged it
    ordered: bool = False  # sent to the workers as a prefetch: they may hold a copy until told to drop it
    deadline: float = 0.0  # ARRIVING: give up (miss) after this
    next_poll: float = 0.0  # ARRIVING: look again after this
    poll_interval: float = ARRIVAL_POLL_S  # ARRIVING: the wait before the next look (doubles each time)


@dataclass(slots=True)
class _Request:
    items: tuple[tuple[str, int], ...]  # (mm hash, end position of its placeholder), prompt order
    announced: frozenset[str]
    lookup_keys: tuple[str, ...] | None = None  # keys of the lookup in flight for this request
    allocated: set[str] = field(default_factory=set)  # items vLLM allocated to it: never waited for again
    preemptions: int = 0  # vLLM's count when last seen: a change means it was preempted meanwhile


@dataclass(slots=True)
class _Push:
    deadline: float
    outstanding: bool = False
    next_poll: float = 0.0
    poll_interval: float = ARRIVAL_POLL_S


class ECSchedulerSide:
    """Scheduler-side EC logic for one engine. ``lookup`` is an ``EXISTS`` client over the same keys the
    workers load and save (``key_prefix + mm_hash``)."""

    def __init__(
        self,
        settings: Settings,
        lookup: LookupClient[tuple[bool, ...]],
        *,
        producer: bool,
        consumer: bool,
        expected_workers: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if lookup.mode is not EXISTS:
            raise ValueError("the EC scheduler needs an EXISTS lookup client")
        self.settings = settings
        self.lookup = lookup
        self.producer = producer
        self.consumer = consumer
        self._expected_workers = max(1, expected_workers)
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._items: dict[str, _Item] = {}
        self._staged: set[str] = set()  # ORDERED or READY: staging held on the workers
        self._install: list[ItemRef] = []
        self._drop: list[str] = []
        self._workers: set[str] = set()
        self._unavailable: set[str] = set()
        self._pushing: collections.OrderedDict[str, _Push] = collections.OrderedDict()
        self._last_step_tokens = 0
        self._empty_step_hooks = False  # a worker reported EC hooks on an empty step (V2 runner)
        self._released = False  # a stalled engine released one request during this schedule() pass
        self._stats: collections.Counter[str] = collections.Counter()  # events since start: stats()

    # -- vLLM: admission ------------------------------------------------------------------------------
    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        """False while an item at or beyond ``num_computed_tokens`` is being looked up, prefetched or is
        announced as arriving; True otherwise. Never waits: cheap and idempotent (called every step)."""
        if not self.consumer:
            return True
        rid: str = request.request_id
        state = self._requests.get(rid)
        if state is None:
            state = self._track(request)
        preemptions: int = getattr(request, "num_preemptions", 0)
        if preemptions != state.preemptions:
            self._readmit(state, preemptions)
        now = self._clock()
        if state.lookup_keys is not None:
            answer = self.lookup.poll(rid)
            if answer is not None:
                self._apply(state, answer, now)
        waiting: list[_Item] = []
        due: list[str] = []
        for mm_hash, end in state.items:
            if end <= num_computed_tokens or mm_hash in state.allocated:
                continue
            item = self._items[mm_hash]
            st = item.state
            if st not in _WAIT:
                continue
            if st is ItemState.FOUND and len(self._staged) >= self.settings.max_inflight_loads:
                self._to_encoder(item, "encode_budget")
                continue
            if st is ItemState.ARRIVING:
                if now >= item.deadline:
                    item.state = ItemState.MISS
                    self._stats["arrival_timeouts"] += 1
                    continue
                if now >= item.next_poll:
                    due.append(mm_hash)
            elif st is ItemState.NEW:
                due.append(mm_hash)
            waiting.append(item)
        if waiting and self._stalled() and all(item.state in _RELEASABLE for item in waiting):
            # Nothing would move these prefetches: encode them, so that this step runs the workers.
            self._released = True
            for item in waiting:
                self._to_encoder(item, "encode_stalled")
            return True
        if due and state.lookup_keys is None:
            self._submit(rid, state, due, now)
        if waiting:
            self._stats["deferrals"] += 1
            return False
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """True only when every worker has the item staged: then its install cannot fail."""
        item = self._items.get(identifier)
        return item is not None and item.state is ItemState.READY

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        """vLLM allocated encoder cache for an item, local or external: install it if it is ours to load."""
        mm_hash: str = request.mm_features[index].identifier
        state = self._requests.get(request.request_id)
        if state is not None:
            state.allocated.add(mm_hash)
        item = self._items.get(mm_hash)
        if item is None or item.state is not ItemState.READY:
            if self.producer:  # encoded here: the worker saves it; confirm it lands before going idle
                self._expect_push(mm_hash)
            return
        self._stats["admit_prefetched"] += 1
        self._install.append(item.ref)
        self._staged.discard(mm_hash)
        item.state, item.ordered = ItemState.INSTALLED, False  # the install takes the staged copy

    # -- vLLM: per step ----------------------------------------------------------------------------------
    def build_connector_meta(self, scheduler_output: Any) -> ECStepMetadata:
        """This step's orders. Under vLLM's V1 runner workers only see them on a step that schedules tokens,
        so prefetch orders and drops wait for such a step unless the workers said they also run on empty
        ones (installs only ever come with a non-empty step: they follow an admission)."""
        tokens = int(scheduler_output.total_num_scheduled_tokens)
        self._last_step_tokens = tokens
        self._released = False
        meta = ECStepMetadata(install=self._install, step_tokens=tokens)
        self._install = []
        if tokens > 0 or self._empty_step_hooks:
            meta.drop, self._drop = self._drop, []
            for item in self._items.values():
                if item.state is ItemState.FOUND:
                    item.state, item.ordered = ItemState.ORDERED, True
                    self._staged.add(item.ref.mm_hash)
                    meta.prefetch.append(item.ref)
            self._stats["prefetch_orders"] += len(meta.prefetch)
        self._expire_pushes(self._clock())
        return meta

    def update_connector_output(self, report: ECWorkerReport | None) -> None:
        """Count worker readiness per item; a failed prefetch becomes a miss (the encoder runs). An install
        cannot fail (only staged items are installed); were one reported, the requests that need the item
        are failed (``take_unavailable_requests``) rather than left waiting."""
        if report is None:
            return
        self._workers |= report.workers
        if report.empty_step_hooks and not self._empty_step_hooks:
            self._empty_step_hooks = True
            log.debug("EC workers run on empty steps: prefetches progress on an idle engine")
        self._stats.update(report.stats)
        needed = self.expected_workers
        for mm_hash, ids in report.ready.items():
            item = self._items.get(mm_hash)
            if item is None or item.state is not ItemState.ORDERED:
                continue
            item.ready_on |= ids
            if len(item.ready_on) >= needed:
                item.state = ItemState.READY
        for mm_hash in report.failed:  # (counted in the worker's stats, merged above: not again here)
            item = self._items.get(mm_hash)
            if item is None:
                continue
            if item.state is ItemState.INSTALLED:
                self._unavailable |= item.requests
                self._stats["unavailable"] += len(item.requests)
            elif item.ordered:
                self._staged.discard(mm_hash)
                self._drop.append(mm_hash)  # free the copies other workers staged
                item.ordered = False
            item.state = ItemState.MISS  # recompute: the encoder runs for it
            item.ready_on = set()

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    @property
    def expected_workers(self) -> int:
        return max(self._expected_workers, len(self._workers))

    # -- vLLM: end of a request -------------------------------------------------------------------------
    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request (discard its lookup, free prefetches nobody else needs). Never True: an EC
        True is OR-ed into the KV delayed free and would leak the request without a KV connector.

        A producer returns ``{SAVING_PARAM: [mm hashes]}`` for a request that finished normally, so that a
        consumer the proxy hands it to waits for those items instead of recomputing them.
        """
        rid: str = request.request_id
        state = self._requests.pop(rid, None)
        if state is not None:
            if state.lookup_keys is not None:
                self.lookup.discard(rid)
            for mm_hash, _ in state.items:
                item = self._items.get(mm_hash)
                if item is None:
                    continue
                item.requests.discard(rid)
                if not item.requests:
                    self._release(item)
                elif item.owner == rid and item.state is ItemState.LOOKUP:
                    item.state, item.owner = ItemState.NEW, None  # another request asks again
        self._unavailable.discard(rid)
        if not self.producer or _status_name(request) in ("FINISHED_ABORTED", "FINISHED_ERROR"):
            return False, None
        hashes = list(dict.fromkeys(f.identifier for f in request.mm_features))
        return False, ({SAVING_PARAM: hashes} if hashes else None)

    def has_pending_push_work(self) -> bool:
        """Producer: True until every item it encoded is seen in the store (or its deadline passed).

        vLLM drops the worker's EC output on an encoder-only instance, so the scheduler cannot hear about
        finished saves; it asks the store instead, with the same non-blocking lookups (vLLM only calls this
        once no request is left, so these lookups never run beside scheduling work).
        """
        if not self._pushing:
            return False
        now = self._clock()
        self._expire_pushes(now)
        for mm_hash, push in list(self._pushing.items()):
            lookup_id = _PUSH_PREFIX + mm_hash
            if push.outstanding:
                answer = self.lookup.poll(lookup_id)
                if answer is None:
                    continue
                push.outstanding = False
                if answer and answer[0]:
                    del self._pushing[mm_hash]
                    self._stats["saves_confirmed"] += 1
                    continue
                push.next_poll = now + push.poll_interval
                push.poll_interval = min(push.poll_interval * 2, ARRIVAL_POLL_MAX_S)
            if now >= push.next_poll:
                self.lookup.submit(lookup_id, [mm_hash])
                push.outstanding = True
        if self._pushing:
            # The engine is otherwise idle and will spin on empty steps until this turns False: give the
            # loop thread the GIL for the answer rather than spin it away (the switch interval is 5 ms).
            time.sleep(IDLE_YIELD_S)
            return True
        return False

    # -- bookkeeping ------------------------------------------------------------------------------------
    def totals(self) -> collections.Counter[str]:
        """Events counted since start (this side's and the workers' reports): lookups, hits, deferrals,
        prefetches, loads, saves, failures. A copy; a name never counted reads 0."""
        return collections.Counter(self._stats)

    def held(self) -> dict[str, int]:
        """What this object holds right now (all 0 once every request is gone and saves are confirmed)."""
        return {
            "requests": len(self._requests),
            "items": len(self._items),
            "staged": len(self._staged),
            "pending_installs": len(self._install),
            "pending_drops": len(self._drop),
            "pushing": len(self._pushing),
            "unavailable": len(self._unavailable),
            "lookups": self.lookup.held()["entries"],
        }

    def item_state(self, mm_hash: str) -> ItemState | None:
        item = self._items.get(mm_hash)
        return None if item is None else item.state

    def close(self) -> None:
        self.lookup.close()

    # -- internals --------------------------------------------------------------------------------------
    def _track(self, request: Any) -> _Request:
        rid: str = request.request_id
        items: list[tuple[str, int]] = []
        for feature in request.mm_features:
            mm_hash: str = feature.identifier
            pos = feature.mm_position
            items.append((mm_hash, int(pos.offset) + int(pos.length)))
            item = self._items.get(mm_hash)
            if item is None:
                item = self._items[mm_hash] = _Item(
                    ItemRef(mm_hash, int(pos.get_num_embeds())), ItemState.NEW
                )
            else:
                _ask_again(item)
            item.requests.add(rid)
        state = _Request(tuple(items), _announced(request))
        state.preemptions = getattr(request, "num_preemptions", 0)
        self._requests[rid] = state
        return state

    def _readmit(self, state: _Request, preemptions: int) -> None:
        """The request was preempted: vLLM freed its encoder inputs, and what the store answered for it may
        be stale. Its installed and missed items are looked up again; staged ones (READY) stay valid."""
        state.preemptions = preemptions
        state.allocated.clear()
        for mm_hash, _ in state.items:
            _ask_again(self._items[mm_hash])
        self._stats["readmissions"] += 1

    def _stalled(self) -> bool:
        """No worker will run before a request is admitted (previous step empty, V1 runner or not known
        otherwise), and no request has been released yet in this ``schedule()`` pass."""
        return self._last_step_tokens == 0 and not self._empty_step_hooks and not self._released

    def _submit(self, rid: str, state: _Request, keys: Sequence[str], now: float) -> None:
        keys = tuple(dict.fromkeys(keys))
        self.lookup.submit(rid, keys)
        state.lookup_keys = keys
        self._stats["lookups"] += 1
        for mm_hash in keys:
            item = self._items[mm_hash]
            if item.state is ItemState.NEW:
                item.state, item.owner = ItemState.LOOKUP, rid
            else:  # ARRIVING: looked at again, each time a little later
                item.next_poll = now + item.poll_interval
                item.poll_interval = min(item.poll_interval * 2, ARRIVAL_POLL_MAX_S)
        if self.settings.sync_lookup:  # operator's choice: block schedule() for the answer (bounded)
            self._apply(state, self.lookup.lookup_sync(rid, keys), now)

    def _apply(self, state: _Request, answer: tuple[bool, ...], now: float) -> None:
        keys = state.lookup_keys or ()
        state.lookup_keys = None
        for mm_hash, present in zip(keys, answer, strict=False):
            item = self._items.get(mm_hash)
            if item is None or item.state not in (ItemState.LOOKUP, ItemState.ARRIVING, ItemState.NEW):
                continue
            item.owner = None
            if present:
                self._stats["lookup_hits"] += 1
                item.state = ItemState.FOUND
            elif item.state is ItemState.ARRIVING:
                pass  # still on its way: looked at again after ARRIVAL_POLL_S, until the deadline
            elif mm_hash in state.announced:
                self._stats["arrivals_awaited"] += 1
                item.state = ItemState.ARRIVING
                item.deadline = now + self.settings.arrival_timeout
                item.next_poll = now + ARRIVAL_POLL_S
                item.poll_interval = 2 * ARRIVAL_POLL_S
            else:
                self._stats["lookup_misses"] += 1
                item.state = ItemState.MISS

    def _to_encoder(self, item: _Item, reason: str) -> None:
        """Plan the item for the encoder (a MISS); free any copy the workers were ordered to stage."""
        mm_hash = item.ref.mm_hash
        if item.ordered:
            self._staged.discard(mm_hash)
            self._drop.append(mm_hash)
            item.ordered = False
        item.state, item.owner, item.ready_on = ItemState.MISS, None, set()
        self._stats[reason] += 1

    def _release(self, item: _Item) -> None:
        mm_hash = item.ref.mm_hash
        if mm_hash in self._staged:
            self._staged.discard(mm_hash)
            self._drop.append(mm_hash)
            self._stats["prefetch_abandoned"] += 1
        elif item.ordered:
            self._drop.append(mm_hash)  # ordered, never installed: free any copy
        del self._items[mm_hash]

    def _expect_push(self, mm_hash: str) -> None:
        if mm_hash in self._pushing:
            return
        self._pushing[mm_hash] = _Push(deadline=self._clock() + self.settings.arrival_timeout)

    def _expire_pushes(self, now: float) -> None:
        while self._pushing:
            mm_hash, push = next(iter(self._pushing.items()))
            if push.deadline > now:
                break
            del self._pushing[mm_hash]
            if push.outstanding:
                self.lookup.discard(_PUSH_PREFIX + mm_hash)
            self._stats["saves_unconfirmed"] += 1


def _ask_again(item: _Item) -> None:
    """A missed item may be stored since, an installed one evicted since: look it up again (a worker still
    holding it answers the prefetch at once)."""
    if item.state in (ItemState.MISS, ItemState.INSTALLED):
        item.state, item.ready_on, item.ordered = ItemState.NEW, set(), False


def _announced(request: Any) -> frozenset[str]:
    """The hashes E said it is saving, from the request's ``ec_transfer_params`` (ignored if malformed)."""
    params = getattr(request, "ec_transfer_params", None)
    if not isinstance(params, dict):
        return frozenset()
    value = params.get(SAVING_PARAM)
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        if value is not None:
            log.warning(
                "request %s: ignoring malformed ec_transfer_params[%r]", request.request_id, SAVING_PARAM
            )
        return frozenset()
    return frozenset(value)


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return str(getattr(status, "name", status))
