"""The KV connector's worker side: loads into the registered KV cache, deferred saves, completion reports.

One object per worker (TP rank), driven from vLLM's worker thread; all store I/O runs on the runtime loop
through the transfer engines, so no method here waits on the store except ``handle_preemptions`` (vLLM's
contract: a preempted request's blocks are reused by this very step), and then only with a timeout.

A stored value holds ``blocks_per_value`` consecutive blocks of *every* layer, for this rank's heads:
``[num_layers, *layer_shape]`` with the cache's block dimension cut to ``blocks_per_value``. One key per
value and rank keeps lookups and round trips per token low (a per-layer key would multiply both by the
layer count) and makes "present" mean "every layer present".

Loads: ``start_load_kv`` hands each value to the :class:`StreamLoader` (store -> staging -> device on its
side stream); a value several requests need is fetched once. When a value has landed, its blocks are
scattered into each layer at the request's block ids, on the worker's current stream -- before the next
forward that could read them; on CUDA the values one poll hands over are scattered together, one indexed
write per layer, and no index tensor is made in a way that waits for the GPU. On a CPU engine over a store
that serves reads from memory (``file://``'s page cache), a whole value is read *in place* instead: its
destination is the request's blocks themselves, so there is no staging buffer and no copy out of one; such
a request is reported only once every read into its blocks has ended, also when it was aborted or timed
out meanwhile. A request is reported in
``finished_recving`` once all its values are in; blocks whose value failed (miss, corrupt, timeout, dead
store, deadline) are reported the same step through ``get_block_ids_with_load_errors`` so vLLM recomputes
them. A sync load (``kv_sync_loads``) is the same load, but ``start_load_kv`` returns only once it is in
(vLLM runs the forward on top of it right after), and it is never reported in ``finished_recving``.

Saves: ``wait_for_save`` submits the step's planned values to the :class:`SaveTracker` as slices of one
gather over the cache (one ``index_select`` per layer) -- evaluated lazily on the tracker's copy thread on
CPU, here on CUDA -- flushes, and returns; no copy and no store I/O on vLLM's thread. A request the
scheduler kept alive for its saves (see :mod:`asyncconn.vllm.kv.scheduler`) is reported in
``finished_sending`` once vLLM has finished it and its saves are done; one finished while loading is
reported in ``finished_recving`` once its loads are cancelled, so nothing writes its blocks any more.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from asyncconn import codec
from asyncconn.exceptions import AsyncConnError, ConfigError
from asyncconn.runtime import Runtime
from asyncconn.store import Scattered, TensorStore
from asyncconn.transfer import CpuDevice, Failure, LoadResult, NewTensor, SaveTracker, StreamLoader
from asyncconn.transfer.lazy import Pieces, Shared
from asyncconn.transfer.purge import Purger
from asyncconn.transfer.runs import runs
from asyncconn.vllm.kv.groups import NULL_BLOCK_ID, has_null, real_blocks
from asyncconn.vllm.kv.keys import KeySpace
from asyncconn.vllm.kv.metadata import (
    AsyncConnKVMetadata,
    AsyncConnKVStats,
    SaveSpec,
    ValueRef,
    worker_totals,
)

__all__ = ["KVWorkerSide", "LayerLayout"]

log = logging.getLogger(__name__)

#: Longest wait for the loads in flight on a step that scheduled no tokens (see ``get_finished``). Each
#: empty step costs vLLM's thread ~0.6 ms of CPU that a small CPU engine takes from the threads reading the
#: loads; 10 ms keeps that under a tenth of a core, and a request arriving meanwhile is scheduled 10 ms
#: later at worst (the wait ends as soon as every load has landed).
IDLE_WAIT_S = 0.010


@dataclass(frozen=True)
class LayerLayout:
    """Where the blocks are in the registered per-layer KV tensors (all layers alike)."""

    block_dim: int
    layer_shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def detect(cls, caches: dict[str, torch.Tensor], layers: Iterable[str], num_blocks: int) -> LayerLayout:
        """The block dimension is the first of dims 0 and 1 whose size is ``num_blocks`` (vLLM's layouts
        are ``[num_blocks, ...]`` or ``[2, num_blocks, ...]``); every layer must share shape and dtype,
        because one value stacks them all."""
        names = list(layers)
        missing = [n for n in names if n not in caches]
        if missing:
            raise ConfigError(
                f"KV connector: layers {missing[:3]} of the KV cache config were not registered"
            )
        first = caches[names[0]]
        for name in names[1:]:
            t = caches[name]
            if t.shape != first.shape or t.dtype != first.dtype:
                raise ConfigError(
                    f"KV connector: layer {name} is {t.dtype}{list(t.shape)}, {names[0]} is "
                    f"{first.dtype}{list(first.shape)}; one value stacks layers, so they must match"
                )
        dims = [d for d in (0, 1) if d < first.dim() and first.shape[d] == num_blocks]
        if not dims:
            raise ConfigError(
                f"KV connector: no block dimension of size {num_blocks} in a KV tensor of shape "
                f"{list(first.shape)}"
            )
        return cls(dims[0], tuple(first.shape), first.dtype)

    def value_shape(self, num_layers: int, blocks_per_value: int) -> tuple[int, ...]:
        shape = list(self.layer_shape)
        shape[self.block_dim] = blocks_per_value
        return (num_layers, *shape)


@dataclass
class _Fetch:
    """One value being loaded, and every (request, value ref) waiting for it.

    An in-place fetch reads straight into the blocks of ``owner`` (``owner_ref``). Those blocks may be
    written until its result comes, so the owner's load keeps the key in ``remaining`` until then, even
    when the owner is dropped (``owner_dropped``): vLLM frees or recomputes a request's blocks only after
    it is reported.
    """

    targets: list[tuple[str, ValueRef]] = field(default_factory=list)
    owner: str | None = None
    owner_ref: ValueRef | None = None
    owner_dropped: bool = False


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
        self.num_blocks = num_blocks
        self.rank = rank
        self.load_timeout = load_timeout
        self.preempt_timeout = preempt_timeout
        # Some KV cache group is windowed (sliding-window, chunked-local): vLLM hands such a group's blocks
        # back to the pool while the request runs, and the next step may zero and write them for another
        # request. A step's saves are then gathered here, on vLLM's thread, not later on the copy thread.
        self.windowed = windowed
        self.caches: dict[str, torch.Tensor] = {}
        self._layer_caches: list[tuple[torch.Tensor, int]] = []  # (cache, KV cache group) per layer, in order
        self._whole: tuple[int, ...] = ()  # every block position of a value
        self.layout: LayerLayout | None = None
        # Flat byte views of the layers' caches when loads can land in them directly (see _in_place_dest),
        # with the bytes of one block and the number of block runs per layer (outer dims before the blocks).
        self._cache_bytes: list[memoryview] | None = None
        self._block_bytes = 0
        self._outer = 1
        self._staged: NewTensor | None = None  # a whole value loaded through staging (set at registration)
        self._batch: list[tuple[torch.Tensor, ValueRef]] = []  # device values of one poll, scattered together
        self._fetches: dict[str, _Fetch] = {}  # store key -> waiting targets
        self._req_loads: dict[str, _ReqLoad] = {}  # request id -> its load, until reported
        self._load_errors: set[int] = set()
        self._had_saves: set[str] = set()  # requests whose blocks the scheduler keeps for our saves
        self._finishing: set[str] = set()  # finished by vLLM, to report in finished_sending
        self._save_t0: dict[str, float] = {}
        self._purger = Purger(self.runtime, self.store)  # corrupt values being removed
        self.loader.on_corrupt = self._purger.remove  # every damaged value it meets, wanted still or not
        self._stats = AsyncConnKVStats()
        self._issued: AsyncConnKVMetadata | None = None  # the last step's metadata whose loads were issued
        # A sync load failed this step: what this step computes on top of its blocks is wrong -- for the
        # request that loaded them and for any other request sharing them through vLLM's prefix cache, which
        # this side cannot tell apart -- so none of this step's values is saved (vLLM recomputes them).
        self._sync_failed = False
        # The save tracker's, loader's and store's running totals, reported as changes (see ``stats``).
        self._totals = worker_totals(saver, loader, store, keys.tokens_per_value)
        self._namers: dict[int, Callable[[bytes], str]] = {}  # rank -> store key of a value hash
        self._closed = False

    # -- set-up ----------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layout = LayerLayout.detect(kv_caches, self.layers, self.num_blocks)
        self.caches = {name: kv_caches[name] for name in self.layers}
        self._layer_caches = [(self.caches[n], self.group_of_layer[n]) for n in self.layers]
        self._whole = tuple(range(self.keys.blocks_per_value))
        self._staged = NewTensor(self._value_shape(), self.layout.dtype)
        self._cache_bytes = None
        if (
            self.loader.device.synchronous
            and self.store.cached_reads
            and all(c.device.type == "cpu" and c.is_contiguous() for c, _ in self._layer_caches)
        ):
            self._cache_bytes = [codec.tensor_bytes(c) for c, _ in self._layer_caches]
            shape, dim = self.layout.layer_shape, self.layout.block_dim
            self._outer = math.prod(shape[:dim])
            self._block_bytes = self._cache_bytes[0].nbytes // (self._outer * shape[dim])
            # Why each load's destination can be built unchecked (Scattered.trusted): the layers share one
            # shape (LayerLayout.detect), so every layer's pieces of a whole value add up to the value.
            per_layer = self._outer * self.keys.blocks_per_value * self._block_bytes
            assert per_layer * len(self._cache_bytes) == self._staged.staging_nbytes

    def set_rank(self, rank: int) -> None:
        """This worker's TP rank (vLLM's TP group when initialized; simulators set it here)."""
        if not 0 <= rank < self.keys.tp_size:
            raise ConfigError(f"KV connector: rank {rank} outside tp_size {self.keys.tp_size}")
        self.rank = rank

    def _value_shape(self) -> tuple[int, ...]:
        assert self.layout is not None, "register_kv_caches was not called"
        return self.layout.value_shape(len(self.layers), self.keys.blocks_per_value)

    # -- loads -----------------------------------------------------------------------------------------
    @property
    def loads_before_forward(self) -> bool:
        """Whether a step's loads should be issued before its forward (:meth:`issue_loads` at bind time).

        vLLM 0.32 starts asynchronous loads after the forward: on CUDA the forward is a launch that returns
        at once, so that keeps the loads' submission off the critical path. A CPU forward runs to its end
        before returning, so the loads would wait a whole step; issued when the metadata is bound they run
        beside the forward (a request that loads is not scheduled, and its new blocks were zeroed before).
        """
        return bool(self._layer_caches) and self._layer_caches[0][0].device.type == "cpu"

    def issue_loads(self, meta: AsyncConnKVMetadata) -> None:
        """Submit this step's loads (never waits); once per metadata, whichever of bind or
        ``start_load_kv`` comes first."""
        if meta is self._issued:
            return
        self._issued = meta
        if not meta.loads:
            return
        dest = self._staged
        assert dest is not None, "register_kv_caches was not called"
        now = time.monotonic()
        submit: list[tuple[str, NewTensor | Scattered]] = []
        for spec in meta.loads:
            load = self._req_loads.setdefault(
                spec.request_id, _ReqLoad(now, now + self.load_timeout, sync=spec.sync)
            )
            for ref in spec.values:
                key = self.keys.store_key(ref.value_hash, self.rank)
                fetch = self._fetches.get(key)
                if fetch is None:
                    fetch = self._fetches[key] = _Fetch()
                    in_place = self._in_place_dest(ref)
                    if in_place is not None:
                        fetch.owner, fetch.owner_ref = spec.request_id, ref
                    submit.append((key, in_place or dest))
                fetch.targets.append((spec.request_id, ref))
                load.remaining.add(key)
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
            if not self.loader.wait(max(until - now, 0.01), first=True):
                time.sleep(1e-4)  # device copies in flight (the wait returns at once then): poll again soon
            self._poll_loads()
        now = time.monotonic()
        for rid, load in list(self._req_loads.items()):
            if not load.sync:
                continue
            for key in list(load.remaining):  # only after give_up
                self._drop_target(rid, key, failed=load.failed_blocks)
            del self._req_loads[rid]
            if load.failed_blocks:
                self._sync_failed = True
                self._load_errors |= load.failed_blocks
            self._stats.observe("load_latency", now - load.t0)

    def _in_place_dest(self, ref: ValueRef) -> Scattered | None:
        """The value's blocks in the cache as its destination, when it can land there directly: a host
        cache (CPU engine), a store that serves reads from memory (``file://``'s page cache), and the whole
        value wanted. Its bytes, layer by layer, are the blocks ``ref.block_ids`` of each layer in order (a
        run of consecutive ids is one piece), so no staging buffer and no copy out of one."""
        if self._cache_bytes is None or ref.positions != self._whole or has_null(ref.block_ids):
            return None
        assert self.layout is not None and self._staged is not None
        per_block = self._block_bytes
        blocks = self.layout.layer_shape[self.layout.block_dim]
        # Byte ranges of one layer, the same in every layer of a group: runs of consecutive ids, per outer
        # index (computed once per group, not once per layer: this runs on vLLM's thread for every value).
        ranges = []
        for ids in ref.block_ids:
            id_runs = runs(ids)
            ranges.append(
                [
                    ((o * blocks + first) * per_block, (o * blocks + first + count) * per_block)
                    for o in range(self._outer)
                    for first, count in id_runs
                ]
            )
        views = [
            flat[a:b]
            for (_, group), flat in zip(self._layer_caches, self._cache_bytes, strict=True)
            for a, b in ranges[group]
        ]
        return Scattered.trusted(self.layout.dtype, self._staged.shape or (), tuple(views))

    def poll(self) -> None:
        """Collect landed and cancelled loads (vLLM's calls do this every step; an idle engine makes none,
        so a cancelled load's staging buffer comes back on the next step or at shutdown)."""
        self._poll_loads()

    def _poll_loads(self) -> None:
        # Each value is scattered as it is handed over; on CPU straight from the staging buffer (no copy
        # into a new tensor first: the loader lends the buffer for the call and takes it back after).
        self.loader.poll(self._on_loaded)
        if self._batch:
            self._scatter_batch()
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
        if result.failure is Failure.NOT_CACHED:  # the store would have had to wait: read it via staging
            self._stats.add("loads_not_in_memory")
            if fetch.targets:
                assert self._staged is not None
                self._fetches[result.key] = _Fetch(fetch.targets)
                self.loader.submit(result.key, self._staged)
            return
        value = result.tensor
        ok = result.ok and (value is not None or result.in_place)
        if ok:
            self._stats.add("loads")
            assert self._staged is not None
            self._stats.add("bytes_loaded", self._staged.staging_nbytes)
            if result.in_place:
                self._stats.add("loads_in_place")
        else:
            self._stats.add("load_failures")
            log.debug("KV value %s not loaded (%s): %s", result.key, result.failure, result.detail)
        block_size = self.keys.identity.block_size
        for rid, ref in fetch.targets:
            load = self._req_loads.get(rid)
            if load is None:
                continue
            load.remaining.discard(result.key)
            if not ok:
                load.failed_blocks.update(real_blocks(ref.block_ids))
                continue
            if value is None:  # landed in the owner's blocks; another request copies them from there
                if ref is not fetch.owner_ref:
                    assert fetch.owner_ref is not None and self.layout is not None
                    owner_ids = [list(g) for g in fetch.owner_ref.block_ids]
                    value = _gather_layers(self._layer_caches, owner_ids, self.layout.block_dim)
                    self._scatter(value, ref)
            elif value.is_cuda:  # a device copy of its own, valid past this call: batched per poll
                self._batch.append((value, ref))
            else:  # the lent staging buffer (CPU): written out now, before the loader takes it back
                self._scatter(value, ref)
            self._stats.add("tokens_loaded", len(ref.positions) * block_size)

    def _scatter(self, value: torch.Tensor, ref: ValueRef) -> None:
        """Write the value's blocks at ``ref.positions`` into every layer, at the request's block ids.

        A group with the null block at a position (a sliding-window group, outside the window at the cut)
        is not written there: vLLM never reads it, and the null block belongs to no request.
        """
        assert self.layout is not None
        dim = self.layout.block_dim
        device = value.device
        plans = [_group_plan(g, ref.positions, self._whole, device) for g in ref.block_ids]
        for index, (cache, group) in enumerate(self._layer_caches):
            plan = plans[group]
            if plan is None:
                continue
            where, positions, n = plan
            src = value[index] if positions is None else value[index].index_select(dim, positions)
            if isinstance(where, int):
                cache.narrow(dim, where, n).copy_(src)
            else:
                cache.index_copy_(dim, where, src)

    def _scatter_batch(self) -> None:
        """Write the whole device values one poll handed over with one stack and one kernel per layer.

        Why: :meth:`_scatter` launches one copy per value and layer from vLLM's thread. Measured on an H200
        machine for 256 values of one block on 32 layers (a 4k-token prefix; ``asyncconn bench gpu``,
        ``kv_scatter``): 84 ms of host time that way, 2.2 ms this way (a ``cat`` per layer is no cure: its
        host cost grows with its inputs too). The
        values are stacked once (one device-to-device pass, cheap next to the host-to-device copies that
        brought them) and each layer gets one indexed write at all their block ids. Partial values go
        through :meth:`_scatter`.
        """
        batch, self._batch = self._batch, []
        whole = [(v, ref) for v, ref in batch if ref.positions == self._whole and not has_null(ref.block_ids)]
        for value, ref in batch:
            if ref.positions != self._whole or has_null(ref.block_ids):
                self._scatter(value, ref)
        if len(whole) == 1:
            self._scatter(*whole[0])
        if len(whole) <= 1:
            return
        assert self.layout is not None
        dim, bpv = self.layout.block_dim, self.keys.blocks_per_value
        device = whole[0][0].device
        stacked = _rows_of_one([value for value, _ in whole])  # [values, layers, *layer_shape]
        ids = [
            _index([b for _, ref in whole for b in ref.block_ids[g]], device).view(len(whole), bpv)
            for g in range(len(whole[0][1].block_ids))
        ]
        lead: tuple[slice, ...] = (slice(None),) * dim  # the dims before the block dim are written whole
        for index, (cache, group) in enumerate(self._layer_caches):
            # cache[..., ids] has shape [*lead, values, bpv, *rest]: the stacked layer with values moved in
            where: tuple[slice | torch.Tensor, ...] = (*lead, ids[group])
            cache[where] = stacked[:, index].movedim(0, dim)

    def _drop_target(self, rid: str, key: str, failed: set[int] | None) -> None:
        """Detach a request from a fetch (cancelling the fetch when nobody else waits for it).

        A request whose blocks an in-place read may be writing keeps the key in ``remaining`` until the read
        has ended (:meth:`_on_loaded`); such reads come from memory, so that is a memory copy away.
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
            return
        if load is not None:
            load.remaining.discard(key)
        if not kept and not fetch.owner_dropped:
            del self._fetches[key]
            self.loader.cancel(key)

    # -- saves -----------------------------------------------------------------------------------------
    def save(self, meta: AsyncConnKVMetadata) -> None:
        """``wait_for_save``: hand this step's values to the save tracker, flush, return.

        One gather per layer for the whole step (not one per value): each value is a slice of a single
        stacked tensor. With the tracker's copy thread (CPU) the gather itself is lazy -- a :class:`Shared`
        the copy thread evaluates (block ids included), then copies each piece into staging -- so vLLM's
        thread only hands each request's values over as one :class:`Pieces` range named by value hash
        (``submit_many``: a tight duplicate check; store keys, save objects and copies on the copy thread,
        one staging buffer for the step); on CUDA it is gathered here on the current stream (kernel
        launches), value-major, and snapshotted by one D2H on the tracker's side stream into one staging
        span (``submit_stacked``). Nothing here waits for the store or for the GPU.
        Bookkeeping is per request, not per value. A step in which a sync load failed saves nothing: what
        its forward computed on top of the failed blocks is wrong (see ``_sync_failed``).
        """
        specs = meta.saves
        if self._sync_failed:
            self._sync_failed = False
            self._had_saves.update(spec.request_id for spec in specs)  # the scheduler holds them: report them
            specs = []
        if specs:
            assert self.layout is not None, "register_kv_caches was not called"
            if self.saver.copy_thread is not None:
                saved, total = self._submit_lazy(specs)
            else:
                saved, total = self._submit_gathered(specs)
            if saved:  # handed over; ``saves`` counts what the store confirmed (``stats``)
                self._stats.add("saves_submitted", saved)
            if saved < total:
                self._stats.add("saves_skipped", total - saved)
        self.saver.flush()

    def _submit_lazy(self, specs: Sequence[SaveSpec]) -> tuple[int, int]:
        """Copy-thread path: the step's gather is one lazy :class:`Shared`, each request a :class:`Pieces`
        range of it. Duplicates are detected by value hash; the store key (a blake2b each) is derived on the
        copy thread -- one worker, one rank, one key space: a hash names its key one way only."""
        assert self.layout is not None
        specs = tuple(specs)  # the copy thread reads their block ids later: a private, immutable copy
        dim, bpv, dtype = self.layout.block_dim, self.keys.blocks_per_value, self.layout.dtype
        shape = self._value_shape()
        shared = Shared(functools.partial(_gather_specs, self._layer_caches, specs, dim))
        if self.windowed:
            shared.get()  # a private copy of the step's blocks before vLLM may reuse them (see __init__)
        name = self._namers.get(self.rank)
        if name is None:
            name = self._namers[self.rank] = self.keys.namer(self.rank)
        submit_many, had_saves, save_t0 = self.saver.submit_many, self._had_saves, self._save_t0
        now = time.monotonic()
        saved = start = 0
        for spec in specs:
            rid, refs = spec.request_id, spec.values
            n = len(refs)
            if not n:
                continue
            had_saves.add(rid)
            values = Pieces(shared, dim + 1, bpv, n, shape, dtype, start)
            got = submit_many(rid, [ref.value_hash for ref in refs], values, name=name)
            start += n
            if got:
                save_t0.setdefault(rid, now)
                saved += got
        return saved, start

    def _submit_gathered(self, specs: Sequence[SaveSpec]) -> tuple[int, int]:
        """Synchronous snapshots (CUDA; CPU without a copy thread): gathered here, value-major, and handed to
        the tracker as one stack: one staging span and one snapshot copy for the step."""
        refs = [(spec.request_id, ref) for spec in specs for ref in spec.values]
        if not refs:
            return 0, 0
        stacked = self._gather(refs)
        keys = self.keys.store_keys([ref.value_hash for _, ref in refs], self.rank)
        items = [(rid, key) for (rid, _), key in zip(refs, keys, strict=True)]
        accepted = self.saver.submit_stacked(items, stacked)
        self._had_saves.update(rid for rid, _ in refs)
        now = time.monotonic()
        for row in accepted:
            self._save_t0.setdefault(items[row][0], now)
        return len(accepted), len(refs)

    def _block_ids(self, refs: list[tuple[str, ValueRef]]) -> list[list[int]]:
        """The step's block ids per KV cache group, value after value."""
        return [[b for _, ref in refs for b in ref.block_ids[g]] for g in range(len(refs[0][1].block_ids))]

    def _gather(self, refs: list[tuple[str, ValueRef]]) -> torch.Tensor:
        """``[values, layers, *layer_shape]``: the step's values gathered value-major, so each value is
        contiguous and the whole step is one snapshot copy."""
        assert self.layout is not None
        dim, bpv = self.layout.block_dim, self.keys.blocks_per_value
        device = self._layer_caches[0][0].device
        ids = [_index(group, device) for group in self._block_ids(refs)]
        per_layer = []
        for cache, group in self._layer_caches:
            picked = cache.index_select(dim, ids[group])  # [..., values * bpv, ...]
            split = (*picked.shape[:dim], len(refs), bpv, *picked.shape[dim + 1 :])
            per_layer.append(picked.view(split).movedim(dim, 0))
        return torch.stack(per_layer, dim=1)

    def handle_preemptions(self, meta: AsyncConnKVMetadata) -> None:
        """The preempted requests' blocks are reused by this step: wait until no save still reads them.

        With the save tracker's copy thread (CPU) only the copies still pending for those requests are
        waited for (their puts read staging, not the blocks), bounded by ``preempt_timeout``. With the
        synchronous CPU device the snapshot was taken inside ``submit``: nothing to wait for. On CUDA the
        snapshot is an asynchronous D2H and the tracker tells only when a request's saves are done, so this
        waits for those saves, bounded.
        """
        if not meta.preempted:
            return
        if self.saver.copy_thread is not None:
            if not self.saver.wait_snapshots(meta.preempted, self.preempt_timeout):
                log.warning("KV snapshots of preempted requests %s still running", sorted(meta.preempted))
            return
        if isinstance(self.saver.device, CpuDevice):
            return
        busy = [rid for rid in meta.preempted if self.saver.pending(rid)]
        if busy:
            done = self.saver.wait(busy, self.preempt_timeout)
            for rid in done:
                self._observe_save(rid)
            if len(done) < len(busy):
                log.warning("KV saves of preempted requests %s still running", sorted(set(busy) - done))

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
        needs to finish the loads.
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
                del self._req_loads[rid]
            if rid in self._had_saves:
                self._had_saves.discard(rid)
                self._finishing.add(rid)
        if step_tokens == 0 and self._fetches:
            # Scatter each value as it lands while the loop reads the next ones, until all are in or the
            # bound has passed (the scatters themselves are work this step would do anyway).
            deadline = time.monotonic() + IDLE_WAIT_S
            while self.loader.wait(max(deadline - time.monotonic(), 0.0), first=True):
                self._poll_loads()
                if not self._fetches or time.monotonic() >= deadline:
                    break
        self._poll_loads()
        recving: set[str] = set()
        for rid, load in list(self._req_loads.items()):
            if not load.remaining:
                del self._req_loads[rid]
                recving.add(rid)
                if not load.aborted:
                    self._load_errors |= load.failed_blocks
                    self._stats.observe("load_latency", time.monotonic() - load.t0)
        for rid in self.saver.poll_finished():
            self._observe_save(rid)
        sending = {rid for rid in self._finishing if not self.saver.pending(rid)}
        self._finishing -= sending
        for rid in sending:
            self._save_t0.pop(rid, None)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # -- observability and shutdown --------------------------------------------------------------------
    def stats(self) -> AsyncConnKVStats | None:
        """Counters and latencies since the previous call; None (nothing allocated) when nothing happened.

        Saves are counted when the store confirmed them, failures apart and by cause (the save tracker's and
        the loader's totals, which their log lines quote); what ``save`` counted when it handed values over
        is reported as ``saves_submitted``. Also the store's outages and reachability.
        """
        changed = self._totals.take()
        if not changed and self._stats.is_empty():
            return None
        stats, self._stats = self._stats, AsyncConnKVStats()
        for name, change in changed.items():
            stats.add(name, change)
        return None if stats.is_empty() else stats

    def counters(self) -> dict[str, int]:
        """Everything this worker holds per request or per transfer; all 0 when idle."""
        out = {
            "fetches": len(self._fetches),
            "req_loads": len(self._req_loads),
            "had_saves": len(self._had_saves),
            "finishing": len(self._finishing),
            "load_errors": len(self._load_errors),
            "sync_failed": int(self._sync_failed),
            "deletes": self._purger.pending,
        }
        out.update({f"loader_{k}": v for k, v in self.loader.counters().items()})
        out.update({f"saver_{k}": v for k, v in self.saver.counters().items()})
        return out

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.loader.close(timeout)
        self.saver.close(timeout).log(
            log, "KV connector", timeout, "those prompts are computed again on their next request"
        )
        self._fetches.clear()
        self._req_loads.clear()
        self._had_saves.clear()  # nothing reports them any more: the engine is going away
        self._finishing.clear()
        self._save_t0.clear()
        self._load_errors.clear()
        self._sync_failed = False
        if not self.runtime.closed:
            try:
                self.runtime.run(self.store.close(), timeout=timeout)
            except (
                AsyncConnError,
                concurrent.futures.TimeoutError,
            ) as exc:  # never raise into vLLM's teardown
                log.warning("KV connector: closing the store failed: %s", exc)


def _group_plan(
    ids: Sequence[int], positions: tuple[int, ...], whole: tuple[int, ...], device: torch.device
) -> tuple[int | torch.Tensor, torch.Tensor | None, int] | None:
    """Where one group's layers take a value's blocks: (block ids -- the first one when they are a run of
    consecutive ids, a plain slice of the cache with no index tensor to build --, the value positions to
    take or None for the whole value in order, the count); None when every position is the null block."""
    if NULL_BLOCK_ID in ids:
        keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK_ID]
        if not keep:
            return None
        ids = [ids[i] for i in keep]
        positions = tuple(positions[i] for i in keep)
    first = ids[0]
    run = tuple(ids) == tuple(range(first, first + len(ids)))
    where: int | torch.Tensor = first if run else _index(ids, device)
    return where, (None if positions == whole else _index(positions, device)), len(ids)


def _rows_of_one(values: list[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(values)``, without the copy when the values are already the consecutive rows of one
    tensor (the loader lands the values a poll hands over so, on CUDA)."""
    first = values[0]
    size, offset = first.numel(), first.storage_offset()
    base = first.untyped_storage().data_ptr()
    if first.is_contiguous() and all(
        v.is_contiguous()
        and v.shape == first.shape
        and v.untyped_storage().data_ptr() == base
        and v.storage_offset() == offset + i * size
        for i, v in enumerate(values)
    ):
        return first.as_strided((len(values), *first.shape), (size, *first.stride()), offset)
    return torch.stack(values)


def _index(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """``ids`` as an int64 index tensor on ``device``, made without waiting for the device.

    Why: ``torch.tensor(ids, device="cuda")`` copies from pageable memory, and such a copy waits for every
    kernel queued on the current stream -- on vLLM's thread, a stall until the GPU has caught up with the
    forward. From pinned memory (torch's caching host allocator keeps it until the copy has run) the copy is
    queued like any kernel.
    """
    host = torch.tensor(ids, dtype=torch.int64)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _gather_specs(
    caches: list[tuple[torch.Tensor, int]], specs: Sequence[SaveSpec], dim: int
) -> torch.Tensor:
    """:func:`_gather_layers` of every value of ``specs``, value after value (run by the copy thread)."""
    refs = [ref for spec in specs for ref in spec.values]
    groups = len(refs[0].block_ids)
    return _gather_layers(caches, [[b for ref in refs for b in ref.block_ids[g]] for g in range(groups)], dim)


def _gather_layers(
    caches: list[tuple[torch.Tensor, int]], block_ids: list[list[int]], dim: int
) -> torch.Tensor:
    """``[num_layers, *layer_shape]`` with the block dimension holding ``block_ids`` (per group), stacked."""
    device = caches[0][0].device
    ids = [_index(group, device) for group in block_ids]
    return torch.stack([cache.index_select(dim, ids[group]) for cache, group in caches])
