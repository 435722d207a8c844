"""The EC connector's worker side: prefetch into staging, install into ``encoder_cache``, deferred saves.

A consumer (PD) worker gets three lists per step (:class:`~asyncconn.vllm.ec.metadata.ECStepMetadata`):
``drop`` frees prefetches nobody needs any more (request aborted, item evicted, load failed elsewhere);
``prefetch`` starts loads on the :class:`~asyncconn.transfer.StreamLoader` (store -> staging -> device on a
side stream); ``install`` moves a staged tensor into vLLM's ``encoder_cache`` -- the same tensor object, so
the forward path copies nothing. The scheduler orders an install only for an item every worker reported
staged, because vLLM has then planned no encoder run for it and fails the step if it is missing; a staged
item is therefore held (a reference, if it was already in ``encoder_cache``) until it is installed or
dropped, so that vLLM evicting it meanwhile cannot lose it. A load that fails is never installed: the
worker reports it and the scheduler plans the encoder for the item. An install of an item not staged here
would be a bug upstream of this class; it is loaded synchronously (bounded by ``load_timeout``) as a last
resort, and reported if that fails too.

A producer (E) worker hands each encoder output to the :class:`~asyncconn.transfer.SaveTracker` from
``save_caches`` (snapshot and return) and pushes the step's saves to the loop once, from ``get_finished``.

Embedding shapes: vLLM's scheduler knows an item's row count, not its width or dtype. The first load reads
the frame's own dtype and shape (staging bounded by ``ec_max_row_bytes`` per row); later loads of the same
width are read straight into exactly-sized staging and checked against it.

Only vLLM's worker thread calls this class (docs/architecture.md, one owner per structure).
"""

from __future__ import annotations

import collections
import logging
import time
import uuid

import torch

from asyncconn.config import Settings
from asyncconn.deadline import STORE_CLOSE_FLOOR_S, Deadline
from asyncconn.lookup.protocol import store_key
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import LoadResult, PinnedPool, SaveTracker, StreamLoader, TensorSpec
from asyncconn.transfer._device import LOAD_PRIORITY, SAVE_PRIORITY, TransferDevice, default_device
from asyncconn.transfer.purge import Purger
from asyncconn.vllm.ec.metadata import ECStepMetadata, ECWorkerReport, ItemRef
from asyncconn.vllm.totals import Totals, host_mark, host_totals, local_mark, local_totals, store_totals

__all__ = ["ECWorkerSide"]

log = logging.getLogger(__name__)

_SYNC_POLL_S = 0.0002


class ECWorkerSide:
    """Worker-side EC logic for one worker (one rank)."""

    def __init__(
        self,
        settings: Settings,
        *,
        producer: bool,
        consumer: bool,
        runtime: Runtime | None = None,
        device: TransferDevice | None = None,
        store: TensorStore | None = None,
    ) -> None:
        self.settings = settings
        self.producer = producer
        self.consumer = consumer
        self.worker_id = uuid.uuid4().hex[:12]
        self.runtime = runtime if runtime is not None else get_runtime()
        # ``device`` names the hardware; the loader and the save tracker each get a device of their own
        # on it (a side stream each on CUDA, loads at the higher priority): one shared stream would queue
        # a prefetch behind the save copies issued before it.
        self.device = device if device is not None else default_device()
        self._owns_store = store is None
        self.store = store if store is not None else self._open_store()
        self.pool = PinnedPool(settings.pinned_pool_bytes, device=self.device)
        self._purger = Purger(self.runtime, self.store)  # corrupt values being removed
        self.loader: StreamLoader | None = None
        self.saver: SaveTracker | None = None
        if consumer:
            self.loader = StreamLoader(
                self.store,
                runtime=self.runtime,
                device=self.device.sibling(priority=LOAD_PRIORITY),
                pool=self.pool,
                max_inflight=settings.max_inflight_loads,
                on_corrupt=self._purger.remove,  # damaged values: see _settle
            )
        if producer:
            self.saver = SaveTracker(
                self.store,
                runtime=self.runtime,
                device=self.device.sibling(priority=SAVE_PRIORITY),
                pool=self.pool,
                skip_existing=settings.save_skip_existing,
            )
        self._row: tuple[tuple[int, ...], torch.dtype] | None = None  # learned (trailing shape, dtype)
        self._loading: dict[str, int] = {}  # store key -> expected rows, for loads in flight
        self._staged: dict[str, torch.Tensor] = {}  # mm hash -> loaded, checked, not installed yet
        self._ready: set[str] = set()
        self._failed: dict[str, str] = {}
        self._empty_step_hooks = False  # this worker's EC hooks ran on a step with no scheduled tokens
        self._stats: collections.Counter[str] = collections.Counter()  # events since the last report
        self._totals = Totals(self._read_totals, self._totals_mark)  # the saver's and store's, as changes
        self._closed = False

    def _open_store(self) -> TensorStore:
        settings = self.settings
        opening = TensorStore.open(
            settings.backend_url,
            timeout=settings.store_timeout,
            connect_timeout=settings.connect_timeout,
            host_cache_bytes=settings.host_cache_bytes,
            local_url=settings.local_store_url,
        )
        return self.runtime.run(opening, settings.connect_timeout + 1.0)

    def key(self, mm_hash: str) -> str:
        """The store key of an item: the lookup client asks for exactly this (``store_key``)."""
        return store_key(self.settings.key_prefix, mm_hash)

    # -- consumer -------------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], meta: ECStepMetadata) -> None:
        """Apply this step's drop / prefetch / install orders; waits only for a synchronous fallback."""
        if self.loader is None:
            return
        if meta.step_tokens == 0:
            self._empty_step_hooks = True
        for mm_hash in meta.drop:
            self._forget(mm_hash)
        submits: list[tuple[str, TensorSpec]] = []
        for ref in meta.prefetch:
            key = self.key(ref.mm_hash)
            if ref.mm_hash in self._staged:
                self._ready.add(ref.mm_hash)
            elif ref.mm_hash in encoder_cache:  # already here: hold it, vLLM may evict it before the install
                self._staged[ref.mm_hash] = encoder_cache[ref.mm_hash]
                self._ready.add(ref.mm_hash)
            elif key not in self._loading:
                submits.append((key, self._dest(ref)))
                self._loading[key] = ref.num_embeds
        if submits:
            self.loader.submit_many(submits)
            self._stats["prefetches"] += len(submits)
        self._collect()
        for ref in meta.install:
            if ref.mm_hash in encoder_cache:
                self._staged.pop(ref.mm_hash, None)
                continue
            tensor = self._staged.pop(ref.mm_hash, None)
            if tensor is not None:
                self._stats["installs_staged"] += 1
            else:
                log.warning("EC item %s: install ordered but not staged here; loading it now", ref.mm_hash)
                tensor = self._load_now(ref)
                if tensor is None:
                    continue
                self._stats["installs_sync"] += 1
            encoder_cache[ref.mm_hash] = tensor  # the staged tensor itself: no copy on the forward path

    def poll(self) -> None:
        """Collect finished prefetches (called again at the end of the step, for earlier readiness)."""
        if self.loader is not None:
            self._collect()

    def _dest(self, ref: ItemRef) -> TensorSpec:
        if self._row is not None:
            trailing, dtype = self._row
            return TensorSpec((ref.num_embeds, *trailing), dtype)
        return TensorSpec(max_nbytes=max(1, ref.num_embeds) * self.settings.ec_max_row_bytes)

    def _collect(self) -> None:
        assert self.loader is not None
        for result in self.loader.poll():
            self._settle(result)

    def _settle(self, result: LoadResult) -> tuple[str, torch.Tensor | None]:
        rows = self._loading.pop(result.key, None)
        mm_hash = result.key[len(self.settings.key_prefix) :]
        if rows is None:  # dropped meanwhile (cannot happen: a drop cancels), ignore
            return mm_hash, None
        tensor = result.tensor
        if result.ok and tensor is not None and tensor.dim() >= 1 and tensor.shape[0] == rows:
            if self._row is None:
                self._row = (tuple(tensor.shape[1:]), tensor.dtype)
            self._staged[mm_hash] = tensor
            self._ready.add(mm_hash)
            self._stats["loaded"] += 1
            self._stats["loaded_bytes"] += tensor.numel() * tensor.element_size()
            return mm_hash, tensor
        reason = result.failure.value if result.failure is not None else "corrupt"
        if result.ok:
            # There but unusable here (other rows or dtype), like a damaged value (the loader hands those
            # to the purger itself). E skips keys the store has, so it would stay; once deleted, E's next
            # encode of the item writes it again.
            self._purger.remove(result.key)
            log.warning(
                "EC item %s: stored embedding has shape %s, expected %d rows",
                mm_hash,
                None if tensor is None else tuple(tensor.shape),
                rows,
            )
        self._failed[mm_hash] = reason
        self._stats[f"load_failed_{reason}"] += 1
        return mm_hash, None

    def _load_now(self, ref: ItemRef) -> torch.Tensor | None:
        """The synchronous fallback: wait (bounded) for this item's load, starting it if needed."""
        assert self.loader is not None
        key = self.key(ref.mm_hash)
        if key not in self._loading:
            self.loader.submit(key, self._dest(ref))
            self._loading[key] = ref.num_embeds
        deadline = time.monotonic() + self.settings.load_timeout
        while True:
            for result in self.loader.poll():
                mm_hash, tensor = self._settle(result)
                if mm_hash == ref.mm_hash:
                    self._staged.pop(mm_hash, None)
                    return tensor
            if time.monotonic() >= deadline:
                self.loader.cancel(key)
                self._loading.pop(key, None)
                self._failed[ref.mm_hash] = "timeout"
                self._stats["load_failed_timeout"] += 1
                return None
            time.sleep(_SYNC_POLL_S)

    def _forget(self, mm_hash: str) -> None:
        key = self.key(mm_hash)
        if self._loading.pop(key, None) is not None:
            assert self.loader is not None
            self.loader.cancel(key)
            self._stats["prefetch_dropped"] += 1
        if self._staged.pop(mm_hash, None) is not None:
            self._stats["prefetch_dropped"] += 1
        self._ready.discard(mm_hash)
        self._failed.pop(mm_hash, None)

    # -- producer -------------------------------------------------------------------------------------
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str) -> None:
        """Snapshot the item and return; the put happens on the loop (``get_finished`` hands it over)."""
        if self.saver is None:
            return
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        if self.saver.submit(mm_hash, self.key(mm_hash), tensor):
            self._stats["saves_submitted"] += 1  # "saves" counts what the store confirmed (end_step)
        else:
            self._stats["saves_skipped"] += 1

    def end_step(self) -> None:
        """``get_finished``: hand staged saves to the loop, count finished ones, collect prefetches."""
        if self.saver is not None:
            self.saver.flush()
            self._stats["saves_done"] += len(self.saver.poll())
        self._stats.update(self._totals.take())
        self.poll()

    def _read_totals(self) -> dict[str, int]:
        """Saves the store confirmed (``saves``, ``saved_bytes``), failed ones by cause (``save_failed_*``),
        the store's reachability, and its host tier's counters (``host_cache_bytes``): the totals the saver's
        and the store's log lines quote."""
        totals = store_totals(getattr(self.store, "reachability", None))
        totals.update(host_totals(getattr(self.store, "host_tier", None)))
        totals.update(local_totals(getattr(self.store, "layered", None)))
        saver = self.saver
        if saver is not None:
            totals.update(saves=saver.saved, saved_bytes=saver.saved_bytes)
            totals["save_failed"] = sum(saver.failures.values())
            for reason, n in saver.failures.items():
                totals[f"save_failed_{reason.value}"] = n
        return totals

    def _totals_mark(self) -> object:
        reach, saver = getattr(self.store, "reachability", None), self.saver
        counts = (saver.saved, saver.failures.total()) if saver is not None else None
        store = self.store
        tier = host_mark(getattr(store, "host_tier", None)), local_mark(getattr(store, "layered", None))
        return counts, None if reach is None else (reach.outages, reach.reachable), tier

    def has_pending_saves(self) -> bool:
        return self.saver is not None and self.saver.held()["requests"] > 0

    # -- reporting ------------------------------------------------------------------------------------
    def report(self) -> ECWorkerReport:
        """This step's report; readiness, failures and event counts are handed over once."""
        me = frozenset({self.worker_id})
        report = ECWorkerReport(
            workers=me,
            ready={mm_hash: me for mm_hash in self._ready},
            failed=self._failed,
            stats={k: v for k, v in self._stats.items() if v},
            empty_step_hooks=self._empty_step_hooks,
        )
        self._ready, self._failed = set(), {}
        self._stats = collections.Counter()
        return report

    def held(self) -> dict[str, int]:
        """Resources held right now: all 0 once nothing is loading, staged or saving."""
        out = {"loading": len(self._loading), "staged": len(self._staged)}
        if self.loader is not None:
            out.update({f"loader_{k}": v for k, v in self.loader.held().items()})
        if self.saver is not None:
            out.update({f"saver_{k}": v for k, v in self.saver.held().items()})
        out["pool_buffers_out"] = self.pool.buffers_out
        out["deletes"] = self._purger.pending
        return out

    def close(self, timeout: float = 5.0) -> None:
        """Cancel prefetches, let saves finish, close the engines and the store, all within ``timeout`` (plus
        the saver's cancel bound, ``CLOSE_CANCEL_S``, and a last try at closing the store). Safe twice."""
        if self._closed:
            return
        self._closed = True
        deadline = Deadline(timeout)
        if self.loader is not None:
            for key in list(self._loading):
                self.loader.cancel(key)
            self._loading.clear()
            self._staged.clear()
            self.loader.close(deadline.left())
        if self.saver is not None:
            self.saver.close(deadline.left()).log(
                log, "EC connector", timeout, "those items are encoded again on their next request"
            )
        if self._owns_store and not self.runtime.closed:
            try:
                self.runtime.run(self.store.close(), deadline.left(STORE_CLOSE_FLOOR_S))
            except Exception:  # shutting down: a store that fails to close must not mask the caller's path
                log.warning("EC worker: closing the store failed", exc_info=True)
