"""The KV connector's worker side: request bookkeeping for loads into the registered KV cache, deferred
saves and completion reports.

One object per worker (TP rank), driven from vLLM's worker thread; all store I/O runs on the runtime loop
through the transfer engines, so no method here waits on the store except ``handle_preemptions`` (vLLM's
contract: a preempted request's blocks are reused by this very step), and then only with a timeout.

A stored value holds ``blocks_per_value`` consecutive blocks of *every* layer, for this rank's heads (see
:mod:`asyncconn.vllm.kv.layout`, which scatters and gathers them) -- or, on an MLA model, the latent rows
every rank holds alike: then all ranks use rank 0's keys, only rank 0 saves, and every rank loads that one
copy (:meth:`~asyncconn.vllm.kv.keys.KeySpace.saves_on`). On a hybrid model whose windowed groups are stored
apart, a value is two parts (:mod:`asyncconn.vllm.kv.parts`), each with its own keys, layout, landing and
save mode; ``ValueRef.part`` says which. One key per value and rank keeps lookups
and round trips per token low (a per-layer key would multiply both by the layer count) and makes "present"
mean "every layer present". What differs by device is chosen once, when the caches are registered: where a
loaded value lands and how it reaches the blocks (:mod:`asyncconn.vllm.kv.loads`, and
:mod:`asyncconn.vllm.kv.in_place` for reads straight into the blocks on a CPU engine), and where a step's
saves are gathered and snapshotted (:mod:`asyncconn.vllm.kv.saves`). This module is the same in every mode.

Loads: ``start_load_kv`` hands each value to the :class:`StreamLoader` (store -> staging -> device on its
side stream); a value several requests need is fetched once. When a value has landed, its blocks are
written into each layer at the request's block ids, on the worker's current stream -- before the next
forward that could read them. A fetch that reads into a request's own blocks (in place) keeps that
request's load open until the read has ended, also when it was aborted or timed out meanwhile. A request
is reported in ``finished_recving`` once all its values are in; a failed value (miss, corrupt, timeout,
dead store, deadline) is reported the same step so vLLM recomputes: its blocks through
``get_block_ids_with_load_errors``, or on a model with several KV cache groups the request through
``failed_recving`` (:mod:`asyncconn.vllm.kv.failures`, the mode chosen at construction). A sync load
(``kv_sync_loads``) is the same load, but ``start_load_kv`` returns only once it is in (vLLM runs the
forward on top of it right after), and it is never reported in ``finished_recving``.

Saves: ``wait_for_save`` submits the step's planned values to the :class:`SaveTracker` as slices of one
gather over the cache -- evaluated lazily on the tracker's copy thread on CPU, here on CUDA -- flushes, and
returns; no copy and no store I/O on vLLM's thread. A request the
scheduler kept alive for its saves (see :mod:`asyncconn.vllm.kv.scheduler`) is reported in
``finished_sending`` once vLLM has finished it and its saves are done; one finished while loading is
reported in ``finished_recving`` once its loads are cancelled, so nothing writes its blocks any more.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncconn.deadline import STORE_CLOSE_FLOOR_S, Deadline
from asyncconn.exceptions import AsyncConnError, ConfigError
from asyncconn.runtime import Runtime
from asyncconn.scattered import Scattered
from asyncconn.store import TensorStore
from asyncconn.transfer import Failure, LoadResult, SaveTracker, StreamLoader, TensorSpec
from asyncconn.transfer.purge import Purger
from asyncconn.vllm.kv.events import SavedReport, SaveReports
from asyncconn.vllm.kv.failures import LoadFailures, load_failures
from asyncconn.vllm.kv.groups import real_blocks
from asyncconn.vllm.kv.keys import KeySpace
from asyncconn.vllm.kv.layout import CacheLayout
from asyncconn.vllm.kv.loads import Landing, landing_for
from asyncconn.vllm.kv.localevents import LocalNews
from asyncconn.vllm.kv.metadata import (
    AsyncConnKVMetadata,
    AsyncConnKVStats,
    SaveSpec,
    ValueRef,
    worker_totals,
)
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.saves import StepSaves, step_saves
from asyncconn.vllm.kv.tiernews import WorkerTierNews

__all__ = ["KVWorkerSide"]

log = logging.getLogger(__name__)

#: Longest wait for the loads in flight on a step that scheduled no tokens (see ``get_finished``). Each
#: empty step costs vLLM's thread CPU that a small CPU engine takes from the threads reading the loads; a
#: bound of a few empty steps' length keeps that small, and a request arriving meanwhile is scheduled at most
#: this much later (the wait ends as soon as every load has landed).
IDLE_WAIT_S = 0.010


@dataclass
class _Fetch:
    """One value being loaded, and every (request, value ref) waiting for it.

    A fetch whose destination is the blocks of ``owner`` (``owner_ref``; an in-place read) may write them
    until its result comes, so the owner's load keeps the key in ``remaining`` until then, even when the
    owner is dropped (``owner_dropped``): vLLM frees or recomputes a request's blocks only after it is
    reported.
    """

    targets: list[tuple[str, ValueRef]] = field(default_factory=list)
    owner: str | None = None
    owner_ref: ValueRef | None = None
    owner_dropped: bool = False
    part: int = 0  # which part of the value (``ValueRef.part``): its landing


@dataclass
class _ReqLoad:
    t0: float
    deadline: float
    remaining: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
    aborted: bool = False  # finished while loading: reported without load errors once nothing writes
    timed_out: bool = False
    sync: bool = False  # settled by ``start_load_kv`` of the step that issued it, never reported


class KVWorkerSide:
    """Plain worker-side logic; the connector facade delegates to it. Call from one thread."""

    def __init__(
        self,
        keys: KeySpace,
        *,
        store: TensorStore,
        loader: StreamLoader,
        saver: SaveTracker,
        runtime: Runtime,
        layers: list[str],
        group_of_layer: dict[str, int],
        num_blocks: int,
        rank: int = 0,
        load_timeout: float = 10.0,
        preempt_timeout: float = 5.0,
        windowed: bool = False,
        events: SaveReports | None = None,
        parts: ValueParts | None = None,
        num_groups: int = 1,
        tier_news: WorkerTierNews | None = None,
        local_news: LocalNews | None = None,
        stage: int = 0,
    ) -> None:
        if loader.device is saver.device:
            raise ConfigError(
                "KV connector: the loader and the save tracker need a device each (engine_devices()): "
                "on one side stream every load would wait for the save copies issued before it"
            )
        self.keys = keys
        self.store = store
        self.loader = loader
        self.saver = saver
        self.runtime = runtime
        self.layers = layers
        self.group_of_layer = group_of_layer
        # How a value is split (one part of ``layers`` unless given; a split part's layers are its keys').
        self.parts = parts if parts is not None else ValueParts.single(keys)
        self.num_blocks = num_blocks
        self.rank = rank
        #: The pipeline stage (0 without pipeline parallelism): a later stage's reports name its layers
        #: until the scheduler's metadata says it knows every stage's (``stages_known``).
        self.stage = stage
        self._stage_known = stage == 0
        self.load_timeout = load_timeout
        self.preempt_timeout = preempt_timeout
        # Some KV cache group is windowed (sliding-window, chunked-local): vLLM hands such a group's blocks
        # back to the pool while the request runs, and the next step may zero and write them for another
        # request. A step's saves are then gathered here, on vLLM's thread, not later on the copy thread.
        self.windowed = windowed
        # Set when the caches are registered: where the blocks are, and the device's load and save modes.
        self.layout: CacheLayout | None = None
        self.landing: Landing | None = None
        self.saves: StepSaves | None = None
        # The same per part of a value (index ``ValueRef.part``); the three above are part 0's.
        self.landings: list[Landing] = []
        self.part_saves: list[StepSaves] = []
        self._fetches: dict[str, _Fetch] = {}  # store key -> waiting targets
        self._req_loads: dict[str, _ReqLoad] = {}  # request id -> its load, until reported
        # How a failed load reaches vLLM: blocks (one KV cache group) or requests (several).
        self.failed_loads: LoadFailures = load_failures(num_groups)
        self._had_saves: set[str] = set()  # requests whose blocks the scheduler keeps for our saves
        self._finishing: set[str] = set()  # finished by vLLM, to report in finished_sending
        self._save_t0: dict[str, float] = {}
        self._purger = Purger(self.runtime, self.store)  # corrupt values being removed
        self.loader.on_corrupt = self._on_corrupt  # every damaged value it meets, wanted still or not
        self._stats = AsyncConnKVStats()
        self._issued: AsyncConnKVMetadata | None = None  # the last step's metadata whose loads were issued
        # A sync load failed this step: what this step computes on top of its blocks is wrong -- for the
        # request that loaded them and for any other request sharing them through vLLM's prefix cache, which
        # this side cannot tell apart -- so none of this step's values is saved (vLLM recomputes them).
        self._sync_failed = False
        # The save tracker's, loader's and store's running totals, reported as changes (see ``stats``).
        self._totals = worker_totals(saver, loader, store, keys.tokens_per_value)
        # KV events on (vLLM's ``kv_events_config``): which values the store confirmed, for the scheduler.
        self.events = events
        self._events_dropped = 0  # the event buffers' ``dropped`` at the last stats()
        # Several ranks with a host tier: what the tier holds goes to the scheduler, and each load's values
        # are claimed before the scheduler's acknowledgements free anything (asyncconn.vllm.kv.tiernews).
        self.tier_news = tier_news
        # The local store's residency published as KV events: what it took in and let go, for the scheduler
        # (asyncconn.vllm.kv.localevents).
        self.local_news = local_news
        layered = store.layered
        if local_news is not None and layered is not None:
            layered.on_local = local_news.heard
        if events is not None:
            saver.on_done = self._on_save_done
            # A backend that reports its own removals (eviction, expiry: ``StorageBackend.on_removed``,
            # where the backend contract has it) tells us too; feature-detected, never required.
            backend: Any = store.backend
            if hasattr(backend, "on_removed"):
                backend.on_removed = self.report_removed
        self._closed = False

    # -- set-up ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        parts = self.parts
        part_layers = [list(k.identity.layers) for k in parts.keys] if parts.split else [self.layers]
        layouts = [
            CacheLayout(kv_caches, layers, self.group_of_layer, self.num_blocks, self.keys.blocks_per_value)
            for layers in part_layers
        ]
        self.landings = [landing_for(layout, self.loader, self.store) for layout in layouts]
        self.part_saves = [
            step_saves(self.saver, layout, windowed=self.windowed, part=i) for i, layout in enumerate(layouts)
        ]
        self.layout, self.landing, self.saves = layouts[0], self.landings[0], self.part_saves[0]

    def set_rank(self, rank: int) -> None:
        """This worker's TP rank (vLLM's TP group when initialized; simulators set it here)."""
        if not 0 <= rank < self.keys.tp_size:
            raise ConfigError(f"KV connector: rank {rank} outside tp_size {self.keys.tp_size}")
        self.rank = rank

    @property
    def slot(self) -> int:
        """This worker among all the engine's: ``stage * tp_size + rank``."""
        return self.stage * self.keys.tp_size + self.rank

    # -- loads -----------------------------------------------------------------------------------------
    @property
    def loads_before_forward(self) -> bool:
        """Whether a step's loads should be issued before its forward (:meth:`issue_loads` at bind time).

        vLLM 0.32 starts asynchronous loads after the forward: on CUDA the forward is a launch that returns
        at once, so that keeps the loads' submission off the critical path. A CPU forward runs to its end
        before returning, so the loads would wait a whole step; issued when the metadata is bound they run
        beside the forward (a request that loads is not scheduled, and its new blocks were zeroed before).
        """
        return self.landing is not None and self.landing.before_forward

    def issue_loads(self, meta: AsyncConnKVMetadata) -> None:
        """Submit this step's loads (never waits); once per metadata, whichever of bind or
        ``start_load_kv`` comes first."""
        if meta is self._issued:
            return
        self._issued = meta
        if meta.stages_known:
            self._stage_known = True
        if meta.loads:
            self._issue(meta)
        if self.tier_news is not None:  # after this metadata's claims: they keep what its loads read
            self.tier_news.acknowledge(meta.tier_acks.get(self.slot))

    def _issue(self, meta: AsyncConnKVMetadata) -> None:
        landings, spaces = self.landings, self.parts.keys
        assert landings, "register_kv_caches was not called"
        now = time.monotonic()
        submit: list[tuple[str, TensorSpec | Scattered]] = []
        for spec in meta.loads:
            load = self._req_loads.setdefault(
                spec.request_id, _ReqLoad(now, now + self.load_timeout, sync=spec.sync)
            )
            for ref in spec.values:
                key = spaces[ref.part].store_key(ref.value_hash, self.rank)
                fetch = self._fetches.get(key)
                if fetch is None:
                    fetch = self._fetches[key] = _Fetch(part=ref.part)
                    dest, into_blocks = landings[ref.part].destination(ref, key)
                    if into_blocks:
                        fetch.owner, fetch.owner_ref = spec.request_id, ref
                    submit.append((key, dest))
                fetch.targets.append((spec.request_id, ref))
                load.remaining.add(key)
            if self.tier_news is not None:
                keys = [spaces[ref.part].store_key(ref.value_hash, self.rank) for ref in spec.values]
                self.tier_news.claim(spec.request_id, keys)
        if submit:
            self.loader.submit_many(submit)

    def start_load_kv(self, meta: AsyncConnKVMetadata) -> None:
        """Issue this step's loads unless bind did, then collect whatever has landed.

        Waits only for sync loads (``kv_sync_loads``): vLLM runs this step's forward on top of them as soon
        as this returns, so it returns once each one's values are in or have failed (``load_timeout``); a
        failed value's blocks are reported through ``get_block_ids_with_load_errors`` this same step, and
        vLLM then drops the step's output for that request and recomputes from the first bad block.
        """
        self.issue_loads(meta)
        self._poll_loads()
        if any(spec.sync for spec in meta.loads):
            self._settle_sync_loads()

    def _settle_sync_loads(self) -> None:
        """Wait until no sync load has a read outstanding, then settle them (see ``start_load_kv``).

        Once a load is stuck (``_stuck``) ``_poll_loads`` drops its values; an in-place read already
        running still writes the request's blocks, so the wait goes on until it ends -- a copy out of
        memory, as in-place reads are only issued for values the store holds in memory. Only a read that is
        still running a whole ``load_timeout`` after every load timed out is left behind, with an error
        logged: that would be a broken store.
        """
        pending = [load for load in self._req_loads.values() if load.sync]
        if not pending:
            return
        give_up: float | None = None
        while any(load.remaining for load in pending):
            now = time.monotonic()
            live = [load.deadline for load in pending if load.remaining and not load.timed_out]
            if not live:
                give_up = give_up if give_up is not None else now + self.load_timeout
                if now >= give_up:
                    log.error("KV sync load: reads still running %.1fs after timing out", self.load_timeout)
                    break
            # Until the first deadline, wait for it; past it, re-check for a stuck load every 10 ms (the
            # wait returns as soon as a value lands either way).
            until = min(live) if live else give_up
            assert until is not None
            if not self.loader.wait(max(until - now, 0.01), landed=1):
                time.sleep(1e-4)  # device copies in flight (the wait returns at once then): poll again soon
            self._poll_loads()
        now = time.monotonic()
        for rid, load in list(self._req_loads.items()):
            if not load.sync:
                continue
            for key in list(load.remaining):  # only after give_up
                self._drop_target(rid, key, failed=load.failed_blocks)
            self._load_ended(rid)
            if load.failed_blocks:  # sync loads exist with one KV cache group only (the connector checks)
                self._sync_failed = True
                self.failed_loads.blocks |= load.failed_blocks
            self._stats.observe("load_latency", now - load.t0)

    def poll(self) -> None:
        """Collect landed and cancelled loads (vLLM's calls do this every step; an idle engine makes none,
        so a cancelled load's staging buffer comes back on the next step or at shutdown)."""
        self._poll_loads()

    def _poll_loads(self) -> None:
        # Each value is delivered as it is handed over (the landing writes it out, or holds it for the end
        # of the poll: ``flush``).
        self.loader.poll(self._on_loaded)
        for landing in self.landings:
            landing.flush()
        if self._req_loads:
            now = time.monotonic()
            for rid, load in self._req_loads.items():
                if load.remaining and not load.timed_out and now > load.deadline and self._stuck(load, now):
                    load.timed_out = True
                    log.warning(
                        "KV load of request %s made no progress for %.1fs: recomputing",
                        rid,
                        self.load_timeout,
                    )
                    for key in list(load.remaining):
                        self._drop_target(rid, key, failed=load.failed_blocks)
                    self._stats.add("load_failures")

    def _a_load_is_whole(self) -> bool:
        """Whether some request has nothing left to read (it is reported this step)."""
        return any(not load.remaining for load in self._req_loads.values())

    def _landings_to_wait(self) -> int:
        """How many values to let land before an idle step looks again: one while a staged value is in
        flight (this thread scatters each as it lands, beside the loop's next reads), else the fewest any
        loading request still waits for -- an in-place value needs nothing from this thread, and a wake-up
        per value only took the GIL from the loop that was reading the next ones."""
        if any(fetch.owner is None for fetch in self._fetches.values()):
            return 1
        return min((len(load.remaining) for load in self._req_loads.values() if load.remaining), default=1)

    def _load_ended(self, rid: str) -> None:
        """``rid``'s load has nothing left to read: forget it, and release its tier claims."""
        del self._req_loads[rid]
        if self.tier_news is not None:
            self.tier_news.release(rid)

    def _stuck(self, load: _ReqLoad, now: float) -> bool:
        """Whether a load past its first deadline is stuck rather than slow: a store call of one of its
        values has run for ``load_timeout``, or the loader as a whole has not moved for that long.

        A request whose values wait behind other loads (call slots, staging buffers) moves the loader's
        clock as they go, so a long prompt, or one loaded beside a long step of the engine, does not time
        out on a healthy store; a store that stops answering does, within ``load_timeout``.
        """
        if now - self.loader.last_progress > self.load_timeout:
            return True
        fetching_for = self.loader.fetching_for
        return any(fetching_for(key, now) > self.load_timeout for key in load.remaining)

    def _on_loaded(self, result: LoadResult) -> None:
        fetch = self._fetches.pop(result.key, None)
        if fetch is None:
            return
        if fetch.owner_dropped:  # its read has ended: nothing writes the dropped owner's blocks any more
            owner = self._req_loads.get(fetch.owner or "")
            if owner is not None:
                owner.remaining.discard(result.key)
        landing = self.landings[fetch.part]
        retry = None if result.ok else landing.fallback(result)
        if retry is not None:  # e.g. an in-place read the store would have had to wait for: via staging
            self._stats.add("loads_not_in_memory")
            if fetch.targets:
                self._fetches[result.key] = _Fetch(fetch.targets, part=fetch.part)
                self.loader.submit(result.key, retry)
            return
        value = result.tensor
        ok = result.ok and (value is not None or result.in_place)
        if ok:
            self._stats.add("loads")
            self._stats.add("bytes_loaded", landing.staged.staging_nbytes)
            if result.in_place:
                self._stats.add("loads_in_place")
        else:
            if fetch.targets or not fetch.owner_dropped:  # not a read stopped after everyone let go of it
                self._stats.add("load_failures")
            log.debug("KV value %s not loaded (%s): %s", result.key, result.failure, result.detail)
            if result.failure is Failure.MISS:
                # The lookup found it and the store has lost it since: a removal routers hear of (with
                # events on), also from stores that never report their own (Mooncake's evictions).
                self.report_removed([result.key])
        block_size = self.keys.identity.block_size
        for rid, ref in fetch.targets:
            load = self._req_loads.get(rid)
            if load is None:
                continue
            load.remaining.discard(result.key)
            if not ok:
                load.failed_blocks.update(real_blocks(ref.block_ids))
                continue
            if ref is not fetch.owner_ref:  # the owner's value landed in its blocks already
                landing.deliver(value, ref, fetch.owner_ref)
            if ref.part == 0:  # a value's tokens once, not once per part
                self._stats.add("tokens_loaded", len(ref.positions) * block_size)

    def _drop_target(self, rid: str, key: str, failed: set[int] | None) -> None:
        """Detach a request from a fetch (cancelling the fetch when nobody else waits for it).

        A request whose blocks a fetch may be writing (its owner) keeps the key in ``remaining`` until the
        read has ended (:meth:`_on_loaded`): a memory copy away from a page cache; a remote read nobody else
        waits for is stopped (``StreamLoader.interrupt``).
        """
        fetch = self._fetches.get(key)
        load = self._req_loads.get(rid)
        if fetch is None:
            if load is not None:
                load.remaining.discard(key)
            return
        kept = []
        for target in fetch.targets:
            if target[0] == rid:
                if failed is not None:
                    failed.update(real_blocks(target[1].block_ids))
            else:
                kept.append(target)
        fetch.targets = kept
        if fetch.owner == rid:
            if fetch.owner_dropped:  # dropped before: still waiting for its read to end
                return
            if not kept and self.loader.cancel(key):  # not started: nothing was written
                del self._fetches[key]
                if load is not None:
                    load.remaining.discard(key)
                return
            fetch.owner_dropped = True
            if not kept:  # nobody else waits for it: a read that can be abandoned stops now
                self.loader.interrupt(key)
            return
        if load is not None:
            load.remaining.discard(key)
        if not kept and fetch.owner_dropped:  # the dropped owner waits for this read alone: stop it
            self.loader.interrupt(key)
        elif not kept:
            del self._fetches[key]
            self.loader.cancel(key)

    # -- saves -----------------------------------------------------------------------------------------
    def save(self, meta: AsyncConnKVMetadata) -> None:
        """``wait_for_save``: hand this step's values to the save tracker, flush, return.

        The save mode (:mod:`asyncconn.vllm.kv.saves`) hands them over as slices of one gather for the
        whole step; nothing here waits for the store or for the GPU. Bookkeeping is per request, not per
        value. A step in which a sync load failed saves nothing: what its forward computed on top of the
        failed blocks is wrong (see ``_sync_failed``).
        """
        specs = meta.saves
        if self._sync_failed:
            self._sync_failed = False
            self._had_saves.update(spec.request_id for spec in specs)  # the scheduler holds them: report them
            specs = []
        elif specs and not self.keys.saves_on(self.rank):
            # Replicated KV (MLA): rank 0 saves the one copy every rank loads. The scheduler holds these
            # requests until every rank reports them in finished_sending: this rank does so as soon as vLLM
            # finishes them, having nothing pending.
            self._had_saves.update(spec.request_id for spec in specs)
            specs = []
        if specs:
            assert self.part_saves, "register_kv_caches was not called"
            accepted, total = self._submit(specs)
            self._had_saves.update(accepted)
            now = time.monotonic()
            saved = 0
            for rid, got in accepted.items():
                if got:
                    self._save_t0.setdefault(rid, now)
                    saved += got
            if saved:  # handed over; ``saves`` counts what the store confirmed (``stats``)
                self._stats.add("saves_submitted", saved)
            if saved < total:
                self._stats.add("saves_skipped", total - saved)
        self.saver.flush()

    def _submit(self, specs: list[SaveSpec]) -> tuple[dict[str, int], int]:
        """Each part's values to that part's save mode; (accepted per request, offered) over all parts."""
        if len(self.part_saves) == 1:
            return self.part_saves[0].submit(specs, self.parts.keys[0], self.rank)
        accepted: dict[str, int] = {}
        total = 0
        for part, saves in enumerate(self.part_saves):
            mine = [
                SaveSpec(spec.request_id, refs)
                for spec in specs
                if (refs := tuple(ref for ref in spec.values if ref.part == part))
            ]
            if not mine:
                continue
            got, offered = saves.submit(mine, self.parts.keys[part], self.rank)
            total += offered
            for rid, n in got.items():
                accepted[rid] = accepted.get(rid, 0) + n
        return accepted, total

    def handle_preemptions(self, meta: AsyncConnKVMetadata) -> None:
        """The preempted requests' blocks are reused by this step: wait (bounded by ``preempt_timeout``)
        until no save still reads them; what that means depends on the save mode."""
        if not meta.preempted or self.saves is None:
            return
        for rid in self.saves.protect(set(meta.preempted), self.preempt_timeout):
            self._observe_save(rid)

    def _observe_save(self, rid: str) -> None:
        t0 = self._save_t0.pop(rid, None)
        if t0 is not None:
            self._stats.observe("save_latency", time.monotonic() - t0)

    # -- completion ------------------------------------------------------------------------------------
    def get_finished(
        self,
        finished_req_ids: set[str],
        finished_via_recv: frozenset[str] = frozenset(),
        step_tokens: int = -1,
    ) -> tuple[set[str] | None, set[str] | None]:
        """``(finished_sending, finished_recving)`` for this step.

        ``finished_via_recv`` (from the scheduler, see :class:`AsyncConnKVMetadata`) are finished requests
        vLLM frees on ``finished_recving``: their loads stop here and the id is reported there once by this
        worker (now, or never again if it was reported already). Other finished requests that had saves are
        reported in ``finished_sending`` once those saves are done.

        On a step that scheduled no tokens (``step_tokens == 0``) while loads are in flight, this waits up to
        ``IDLE_WAIT_S`` for them to land (``StreamLoader.wait``), scattering each one as it lands: the engine
        has nothing else to do, and its back-to-back empty steps would otherwise hold the GIL the loop thread
        needs to finish the loads. It stops waiting as soon as a request's load is whole, which is then
        reported at once: with several requests loading, the first one done is not held for the others.
        """
        for rid in finished_req_ids:
            load = self._req_loads.get(rid)
            if rid in finished_via_recv:
                self._had_saves.discard(rid)  # freed through finished_recving, never finished_sending
                if load is not None:  # stop writing its blocks; report it below, without load errors
                    for key in list(load.remaining):
                        self._drop_target(rid, key, failed=None)
                    load.aborted = True
                continue
            if load is not None:  # every worker reported it already (the scheduler says so): nothing to do
                for key in list(load.remaining):
                    self._drop_target(rid, key, failed=None)
                self._load_ended(rid)
            if rid in self._had_saves:
                self._had_saves.discard(rid)
                self._finishing.add(rid)
        if step_tokens == 0 and self._fetches and not self._a_load_is_whole():
            # Scatter each staged value as it lands while the loop reads the next ones (values read in place
            # need nothing until a request's are all in: ``_landings_to_wait``), until a request's load is
            # whole or the bound has passed (the scatters themselves are work this step would do anyway).
            deadline = time.monotonic() + IDLE_WAIT_S
            while self.loader.wait(max(deadline - time.monotonic(), 0.0), landed=self._landings_to_wait()):
                self._poll_loads()
                if not self._fetches or time.monotonic() >= deadline or self._a_load_is_whole():
                    break
        self._poll_loads()
        recving: set[str] = set()
        for rid, load in list(self._req_loads.items()):
            if not load.remaining:
                self._load_ended(rid)
                recving.add(rid)
                if not load.aborted:
                    if load.failed_blocks:
                        self.failed_loads.async_failed(rid, load.failed_blocks)
                    self._stats.observe("load_latency", time.monotonic() - load.t0)
        # ``pending`` moves the tracker on (it may finish saves); ``poll`` comes after it, so that every
        # request found done here is also forgotten by the tracker now, not on a next step that an idle
        # engine never takes.
        sending = {rid for rid in self._finishing if not self.saver.pending(rid)}
        for rid in self.saver.poll():
            self._observe_save(rid)
        self._finishing -= sending
        for rid in sending:
            self._save_t0.pop(rid, None)
        return sending or None, recving or None

    # -- events --------------------------------------------------------------------------------------
    def _on_corrupt(self, key: str) -> None:
        """A damaged value is deleted from the store: a removal routers hear of (with events on)."""
        self._purger.remove(key)
        self.report_removed([key])

    def _on_save_done(self, ident: object, ok: bool) -> None:
        events = self.events
        if events is not None and isinstance(ident, bytes):  # every KV save is known by its value hash
            if ok:
                events.saved(ident)
            else:
                events.failed(ident)

    def report_removed(self, keys: Iterable[str]) -> None:
        """Store keys that left the store (an eviction, an expiry): the one call a removal source makes,
        from any thread; they become ``BlockRemoved`` events on the scheduler side. No-op with events off."""
        if self.events is not None:
            self.events.report_removed(keys)

    def events_report(self) -> SavedReport | None:
        """``build_connector_worker_meta``: the values confirmed or failed, and keys removed, since the last
        call, what the host tier indexed and let go, and what the local store took in and let go (None:
        all off, or nothing new)."""
        report = self.events.take() if self.events is not None else None
        news = self.tier_news.take() if self.tier_news is not None else None
        if news is not None:
            report = report if report is not None else SavedReport()
            report.tiers[self.slot] = news
        local = self.local_news.take() if self.local_news is not None else None
        if local:
            report = report if report is not None else SavedReport()
            report.local = local
        if not self._stage_known:  # its keys are its stage's (asyncconn.vllm.kv.stages): named until known
            report = report if report is not None else SavedReport()
            report.layers[self.stage] = self.keys.identity.layers
        return report

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.failed_loads.take_blocks()

    def take_failed_recving(self) -> set[str]:
        """Requests reported in ``finished_recving`` whose load failed (several KV cache groups; none
        otherwise), for ``KVConnectorTransferResults.failed_recving``."""
        return self.failed_loads.take_requests()

    # -- observability and shutdown --------------------------------------------------------------------
    def stats(self) -> AsyncConnKVStats | None:
        """Counters and latencies since the previous call; None (nothing allocated) when nothing happened.

        Saves are counted when the store confirmed them, failures apart and by cause (the save tracker's and
        the loader's totals, which their log lines quote); what ``save`` counted when it handed values over
        is reported as ``saves_submitted``. Also the store's outages and reachability.
        """
        changed = self._totals.take()
        dropped = (self.events.dropped if self.events is not None else 0) + (
            self.local_news.dropped if self.local_news is not None else 0
        )
        if dropped != self._events_dropped:
            changed["events_dropped"] = dropped - self._events_dropped
            self._events_dropped = dropped
        if not changed and self._stats.is_empty():
            return None
        stats, self._stats = self._stats, AsyncConnKVStats()
        for name, change in changed.items():
            stats.add(name, change)
        return None if stats.is_empty() else stats

    def held(self) -> dict[str, int]:
        """Everything this worker holds per request or per transfer; all 0 when idle."""
        out = {
            "fetches": len(self._fetches),
            "req_loads": len(self._req_loads),
            "had_saves": len(self._had_saves),
            "finishing": len(self._finishing),
            "load_errors": self.failed_loads.held(),
            "sync_failed": int(self._sync_failed),
            "deletes": self._purger.pending,
            "event_reports": self.events.held() if self.events is not None else 0,
            "tier_claims": self.tier_news.held() if self.tier_news is not None else 0,
            "local_news": self.local_news.held() if self.local_news is not None else 0,
        }
        out.update({f"loader_{k}": v for k, v in self.loader.held().items()})
        out.update({f"saver_{k}": v for k, v in self.saver.held().items()})
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Cancel loads, let saves finish, close the engines and the store, all within ``timeout`` (plus the
        saver's cancel bound, ``CLOSE_CANCEL_S``, and a last try at closing the store). Safe twice."""
        if self._closed:
            return
        self._closed = True
        deadline = Deadline(timeout)
        backend: Any = self.store.backend
        if self.events is not None and getattr(backend, "on_removed", None) == self.report_removed:
            backend.on_removed = None  # the backend must not reach into a closed worker
        layered = self.store.layered
        if self.local_news is not None and layered is not None:
            layered.on_local = None  # (the one hook it has is ours)
        self.loader.close(deadline.left())
        if self.tier_news is not None:
            self.tier_news.close()
        self.saver.close(deadline.left()).log(
            log, "KV connector", timeout, "those prompts are computed again on their next request"
        )
        self._fetches.clear()
        self._req_loads.clear()
        self._had_saves.clear()  # nothing reports them any more: the engine is going away
        self._finishing.clear()
        self._save_t0.clear()
        self.failed_loads.clear()
        self._sync_failed = False
        if not self.runtime.closed:
            try:
                self.runtime.run(self.store.close(), timeout=deadline.left(STORE_CLOSE_FLOOR_S))
            except (
                AsyncConnError,
                concurrent.futures.TimeoutError,
            ) as exc:  # never raise into vLLM's teardown
                log.warning("KV connector: closing the store failed: %s", exc)
