"""SaveTracker: snapshot now, put later, report completion per request -- ``wait_for_save`` without the wait.

``submit(request_id, key, tensor)`` returns at once. It takes a staging buffer and stages the save; it does
not touch the loop. Two ways to snapshot, chosen once when the tracker is built (a
:class:`~asyncconn.transfer.savedevice.SaveDevice`, one module each):

* **CUDA** (and a ``CpuDevice`` with ``copy_thread=False``), :mod:`asyncconn.transfer.saves_events`:
  ``submit`` issues the copy (on CUDA a D2H on the tracker's side stream); :meth:`SaveTracker.flush` hands
  the saves whose event fired to the loop in batches (one ``exists`` and one ``put`` per batch, one loop
  wake-up per batch). The loop never waits on CUDA.
* **CPU with a copy thread** (the default on CPU), :mod:`asyncconn.transfer.saves_thread`: ``submit`` only
  takes a staging buffer and queues the save, and ``flush`` posts the step's saves to the tracker's
  :class:`CopyThread` as *one* job, which copies, frames and submits the put batches to the loop itself.
  ``wait_snapshots`` blocks until the copies reading given requests' sources are done (preemption: their
  blocks are about to be reused).

``submit_many(request_id, keys, values)`` is ``submit`` per value, cheaper on the caller's thread: with a copy
thread and a :class:`~asyncconn.transfer.lazy.Pieces` of values (the KV adapter's step), the caller's thread
only checks duplicates and counts; the step's accepted values get *one* staging buffer at ``flush`` (a slice
each), and the copy thread makes their save objects -- and, given ``name``, their store keys -- while it runs
the job. Those objects are new to the worker when the job is reported, so every counter keeps one owner.

``poll``, ``pending`` and ``wait`` flush first. The KV adapter calls ``flush()`` from
``wait_for_save()``, at the end of the step's saves. Waking the loop once per save would hand the GIL to the
loop thread in the middle of the worker's kernel launches, which is what makes a submit's tail slow.

A request is reported by :meth:`SaveTracker.poll` once all of its saves are done, whether they
succeeded or failed (failures are counted and logged: a failed save is a future miss, never a hung request),
and then every trace of it is dropped. :meth:`SaveTracker.wait` blocks for given requests only (preemption).

Duplicates are not re-sent: a key saved recently by this tracker (a bounded LRU set) or being saved right now
is skipped at ``submit``; with ``skip_existing`` the loop asks the store ``exists`` for each batch and puts
only the missing keys. Keys are content addresses (block hashes, mm hashes): the same key, the same bytes.

The caller's tensor: with a synchronous CPU device it may be reused as soon as ``submit`` returns. On CUDA
and with a copy thread the snapshot itself runs asynchronously, and when the pool has no staging buffer free
the save waits in a queue holding a reference to the tensor; in both cases the tensor must not be *written*
until the request is reported -- exactly the contract of vLLM's delayed block free (``request_finished`` ->
True). Freeing it is always safe. A lazy source (a :class:`LazyTensor`) is read when its copy runs: the copy
thread evaluates every lazy source of a step in that step's job, even for saves still waiting for a buffer,
so once ``wait_snapshots`` returns nothing reads the memory behind them any more.

The parts, one job each:

* this module -- :class:`SaveTracker`: the public API and the worker thread's bookkeeping (requests,
  duplicates, staging buffers and the queue waiting for them, put batches, completion, ``close``);
* :mod:`asyncconn.transfer.saves_events` and :mod:`asyncconn.transfer.saves_thread` -- the two save modes
  (:class:`~asyncconn.transfer.savedevice.SaveDevice`): CUDA events, or the copy thread's jobs;
* :mod:`asyncconn.transfer.staging` -- :class:`~asyncconn.transfer.staging.Save`, one value on its way,
  and where its snapshot is staged (a buffer of its own or a slice of a shared span);
* :mod:`asyncconn.transfer.snapshot` -- the copy thread's jobs (CPU): evaluate, copy, frame, start puts;
* :mod:`asyncconn.transfer.puts` -- put batches on the loop, handed back when the put task has ended.

Threads. The tracker is called from one thread (vLLM's worker thread), which owns every structure here:
requests, counters, the pool, the duplicate sets, the queues of saves. Other threads reach it only through
``_done``, a deque they append to and the worker alone drains: the loop appends a batch whose put has
ended (a done-callback), the copy thread a job it has finished (before that job's batches can follow).
A save belongs to one thread at a time: the worker until it is posted in a copy job (then the copy thread's
until the job is on ``_done``) or handed to the loop in a batch (then the put reads it, the worker reads
only its request id, until the batch is on ``_done``). The other reads across threads, both of values that
one thread writes and documented in :mod:`asyncconn.transfer.snapshot`: the worker reads a posted job's
request ids (``CopyJob.reads``), and the copy thread reads ``Copier.cancelling``, a flag the worker sets
once in ``close``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from asyncconn._deprecated import renamed_method
from asyncconn.exceptions import PoolTooSmall, RuntimeClosed, TransferError
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer._device import SAVE_PRIORITY, CpuDevice, TransferDevice, default_device
from asyncconn.transfer.copythread import CopyThread
from asyncconn.transfer.failures import Failure, RateLimitedLog, classify
from asyncconn.transfer.lazy import LazyTensor
from asyncconn.transfer.pool import PinnedPool
from asyncconn.transfer.puts import Batch, Putter
from asyncconn.transfer.savedevice import SaveDevice
from asyncconn.transfer.saves_events import EventSaves
from asyncconn.transfer.saves_thread import ThreadSaves
from asyncconn.transfer.staging import Save, Source

__all__ = ["CLOSE_CANCEL_S", "SaveTracker", "ShutdownReport"]

log = logging.getLogger(__name__)

#: How long :meth:`SaveTracker.close` waits, after its grace period, for the cancelled saves to hand their
#: buffers back and for the copy thread to stop. Cancelling runs on the loop and takes milliseconds; the
#: bound is for a put stuck in a thread it cannot interrupt, which must not hold a shutdown (vLLM kills a
#: worker that has not exited after its own grace period, ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS``).
CLOSE_CANCEL_S = 0.25


@dataclass(frozen=True, slots=True)
class ShutdownReport:
    """What :meth:`SaveTracker.close` found: saves in flight when it was called, and those of them the store
    had not confirmed when the grace period ended (cancelled: their values may be missing)."""

    in_flight: int = 0
    abandoned: int = 0

    @property
    def finished(self) -> int:
        return self.in_flight - self.abandoned

    def log(self, logger: logging.Logger, owner: str, timeout: float, lost: str) -> None:
        """The one shutdown line an operator needs: whether values were lost (nothing when none was in
        flight). ``lost`` says what happens to an abandoned save's value."""
        if not self.in_flight:
            return
        logger.log(
            logging.WARNING if self.abandoned else logging.INFO,
            "%s shutdown: %d saves in flight, %d finished within %.1fs, %d abandoned (not in the store; %s)",
            owner,
            self.in_flight,
            self.finished,
            timeout,
            self.abandoned,
            lost,
        )


class _Request:
    __slots__ = ("failed", "pending")

    def __init__(self) -> None:
        self.pending = 0
        self.failed = 0


class SaveTracker:
    """Deferred saves to a :class:`TensorStore`, tracked per request. Call every method from one thread.

    ``put_batch`` bounds the saves per loop hand-off (one ``exists`` + one ``put`` each); ``recent_keys``
    bounds the set of keys remembered as saved. ``copy_thread`` (default: on for a CPU device, refused for
    CUDA, whose side stream already makes snapshots asynchronous) runs the snapshots and the loop hand-off
    on a :class:`CopyThread` owned by the tracker; ``close`` joins it.
    """

    def __init__(
        self,
        store: TensorStore,
        *,
        runtime: Runtime | None = None,
        device: TransferDevice | None = None,
        pool: PinnedPool | None = None,
        skip_existing: bool = True,
        recent_keys: int = 65536,
        put_batch: int = 64,
        copy_thread: bool | None = None,
    ) -> None:
        if recent_keys < 0:
            raise TransferError(f"recent_keys must be >= 0, got {recent_keys}")
        if put_batch <= 0:
            raise TransferError(f"put_batch must be > 0, got {put_batch}")
        self.store = store
        self.runtime = runtime if runtime is not None else get_runtime()
        self.device = device if device is not None else default_device(priority=SAVE_PRIORITY)
        self.pool = pool if pool is not None else PinnedPool(device=self.device)
        self.skip_existing = skip_existing
        self.recent_keys = recent_keys
        self.put_batch = put_batch
        on_cpu = isinstance(self.device, CpuDevice)
        if copy_thread and not on_cpu:
            raise TransferError("copy_thread is for CPU devices; CUDA snapshots run on the side stream")
        # Appended by the loop (batches whose put ended) and the copy thread (jobs); drained here only.
        self._done: collections.deque[object] = collections.deque()
        self._putter = Putter(
            self.store, self.runtime, skip_existing=skip_existing, hand_back=self._done.append
        )
        self._requests: dict[str, _Request] = {}
        self._finished: set[str] = set()  # all saves done, not reported yet
        self._queued: collections.deque[Save] = collections.deque()  # waiting for a staging buffer
        self._batches: set[Batch] = set()  # running on the loop
        self._recent: collections.OrderedDict[Hashable, None] = collections.OrderedDict()
        self._inflight_keys: set[Hashable] = set()
        self._failure_log = RateLimitedLog(log)  # a store that is down fails every batch: not a line each
        self._closed = False
        #: Called on this thread with ``(ident, ok)`` as each admitted save ends (ok: the value is in the
        #: store, written or found there); the KV adapter's events hook in here.
        self.on_done: Callable[[Hashable, bool], None] | None = None
        # Leak counters.
        self.buffers_out = 0
        self.events_out = 0
        self.futures_pending = 0
        # Totals.
        self.saved = 0
        self.saved_bytes = 0
        self.skipped = 0  # duplicates caught at submit (recent or in flight)
        self.skipped_existing = 0  # already in the store (exists before put)
        self.requests_failed = 0
        self.failures: collections.Counter[Failure] = collections.Counter()
        # The save mode, chosen once (last: it binds to the bookkeeping above).
        self._mode: SaveDevice = (
            ThreadSaves(self) if (on_cpu and copy_thread is not False) else EventSaves(self)
        )

    @property
    def copy_thread(self) -> CopyThread | None:
        """The tracker's copy thread (None on CUDA or when disabled): snapshots run there, asynchronously."""
        return self._mode.copy_thread

    # -- public API ------------------------------------------------------------------------------------
    def submit(
        self, request_id: str, key: str, tensor: torch.Tensor | LazyTensor, *, ident: Hashable = None
    ) -> bool:
        """Stage ``tensor`` to save under ``key`` for ``request_id``; never waits, never wakes the loop.

        ``tensor`` may be a :class:`LazyTensor`: with a copy thread it is evaluated there, otherwise here.
        Returns False when the key is skipped as a duplicate (saved recently or being saved now).
        ``ident``: what duplicates are detected by and ``on_done`` names (default: ``key``), as in
        :meth:`submit_many`.
        """
        if self._closed:
            raise TransferError("SaveTracker is closed")
        ident = key if ident is None else ident
        if not self._admit(request_id, ident):
            return False
        save = self._mode.new_save(request_id, key, tensor)
        save.ident = ident
        self._stage(save)
        return True

    def submit_many(
        self,
        request_id: str,
        keys: Sequence[Hashable],
        values: Sequence[Source],
        *,
        name: Callable[[Any], str] | None = None,
    ) -> int:
        """:meth:`submit` of ``values[i]`` under ``keys[i]`` for one request; returns how many were accepted.

        The same semantics as one ``submit`` per value, in order (duplicates skipped, within the call too),
        at a fraction of the cost on the caller's thread when ``values`` is a :class:`Pieces` and the tracker
        has a copy thread: no object per lazy source, no pool acquire per value -- the accepted values of
        every ``submit_many`` until the next hand-off (``flush``) share *one* staging buffer, back in the
        pool once the last of them is done. When the pool cannot give that buffer then, or saves are queued
        already, the values are staged one by one as :meth:`submit` does.

        ``name``: ``keys`` are then identities (e.g. the KV adapter's block hashes) and ``name(key)`` the
        store key, derived on the copy thread: duplicates are detected by the identity, so a tracker should
        name a value one way only (the KV adapter always goes through here on CPU). ``name`` must be safe to
        call from another thread.
        """
        if self._closed:
            raise TransferError("SaveTracker is closed")
        if len(keys) != len(values):
            raise TransferError(f"submit_many: {len(keys)} keys for {len(values)} values")
        return self._mode.submit_many(request_id, keys, values, name)

    def _submit_each(
        self,
        request_id: str,
        keys: Sequence[Hashable],
        values: Sequence[Source],
        name: Callable[[Any], str] | None,
    ) -> int:
        """:meth:`submit_many` as one :meth:`submit` per value."""
        accepted = 0
        for key, value in zip(keys, values, strict=True):
            if name is None:
                accepted += self.submit(request_id, cast(str, key), value)
            else:  # known by the identity, as the group path knows it
                accepted += self.submit(request_id, name(key), value, ident=key)
        return accepted

    def _admit_many(self, request_id: str, keys: Sequence[Hashable]) -> list[int]:
        """:meth:`_admit` of each of ``keys`` for one request (duplicates within ``keys`` skipped too);
        returns the indexes admitted."""
        if not keys:
            return []
        request = self._requests.get(request_id)
        if request is None:
            request = self._requests[request_id] = _Request()
        inflight, recent = self._inflight_keys, self._recent
        taken: list[int] = []
        for i, key in enumerate(keys):
            if key in inflight or key in recent:
                continue
            inflight.add(key)
            taken.append(i)
        self.skipped += len(keys) - len(taken)
        if not taken:
            if request.pending == 0:
                self._finished.add(request_id)
            return taken
        self._finished.discard(request_id)
        request.pending += len(taken)
        return taken

    def submit_stacked(
        self,
        items: Sequence[tuple[str, str]],
        stacked: torch.Tensor,
        idents: Sequence[Hashable] | None = None,
    ) -> list[int]:
        """Save ``stacked[i]`` under ``items[i] = (request_id, key)``: one staging span and one snapshot copy
        for them all; returns the rows accepted (duplicates are skipped as :meth:`submit` skips them).

        For the synchronous-snapshot flow (CUDA): one :meth:`submit` per value costs vLLM's thread a pool
        acquire, a copy launch and an event each -- ~200 us per value on a GPU machine's host, and a 4k-token
        prefill saves hundreds of values in one step. Here that is once per call: one acquire, one D2H of
        the accepted rows (a copy per run of consecutive rows), one event. ``stacked`` must not be written
        until the requests are reported (the same contract as ``submit``). When saves are queued already,
        the pool cannot give the span now, or the tracker has a copy thread, the values go through
        :meth:`submit` one by one. ``idents[i]``: what row ``i`` is known by (default: its key; see
        :meth:`submit`).
        """
        if self._closed:
            raise TransferError("SaveTracker is closed")
        if len(items) != len(stacked):
            raise TransferError(f"submit_stacked: {len(items)} items for {len(stacked)} values")
        if idents is None:
            idents = [key for _, key in items]
        elif len(idents) != len(items):
            raise TransferError(f"submit_stacked: {len(idents)} idents for {len(items)} items")
        seen: set[Hashable] = set()
        taken: list[int] = []
        for i, ident in enumerate(idents):
            if ident not in seen and not self._known(ident):
                taken.append(i)
            seen.add(ident)
        return self._mode.submit_stacked(items, stacked, idents, taken)

    def _submit_rows(
        self, items: Sequence[tuple[str, str]], stacked: torch.Tensor, idents: Sequence[Hashable]
    ) -> list[int]:
        """:meth:`submit_stacked` as one :meth:`submit` per row."""
        return [i for i, (rid, key) in enumerate(items) if self.submit(rid, key, stacked[i], ident=idents[i])]

    def _known(self, key: Hashable) -> bool:
        """``key`` is being saved now or was saved recently: another save of it is a duplicate."""
        return key in self._inflight_keys or key in self._recent

    def _admit(self, request_id: str, key: Hashable) -> bool:
        """Count a save of ``key`` against its request, or skip it as a duplicate (saved recently or being
        saved now; a request with nothing pending is then finished)."""
        request = self._requests.get(request_id)
        if request is None:
            request = self._requests[request_id] = _Request()
        if self._known(key):
            self.skipped += 1
            if request.pending == 0:
                self._finished.add(request_id)
            return False
        self._finished.discard(request_id)
        request.pending += 1
        self._inflight_keys.add(key)
        return True

    def flush(self) -> None:
        """Hand the step's saves on; the adapter's ``wait_for_save`` calls this.

        With a copy thread: one job posted (nothing when nothing new was staged), no loop wake-up here.
        Otherwise: every snapshotted save to the loop, one wake-up per ``put_batch`` saves. Completed puts
        are processed (buffers returned, requests counted) by ``poll``.
        """
        self._handoff()

    def pending(self, request_id: str) -> int:
        """Saves of ``request_id`` not finished yet (0 for an unknown or fully saved request)."""
        self._progress()
        request = self._requests.get(request_id)
        return request.pending if request is not None else 0

    def poll(self) -> set[str]:
        """Request ids whose saves are all done (ok or failed) since the last call; then forgotten."""
        self._progress()
        return self._report(self._finished) if self._finished else set()

    def wait(self, request_ids: Iterable[str], timeout: float) -> set[str]:
        """Block until the saves of ``request_ids`` are done or ``timeout`` passes (preemption only).

        Returns the ids that finished; those are forgotten (not reported again by :meth:`poll`).
        The others keep saving and are reported by a later :meth:`poll`.
        """
        wanted = {r for r in request_ids if r in self._requests}
        deadline = time.monotonic() + timeout
        while True:
            self._progress()
            if wanted <= self._finished:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if self._mode.wait_copies(wanted, min(remaining, 0.05)):
                continue
            futures = [
                b.future
                for b in self._batches
                if b.future is not None and any(s.request_id in wanted for s in b.saves)
            ]
            others = any(s.request_id in wanted for s in self._queued) or self._mode.copying(wanted)
            if futures and not others:
                concurrent.futures.wait(futures, min(remaining, 0.05), concurrent.futures.FIRST_COMPLETED)
            else:
                time.sleep(min(remaining, 0.0005))  # a D2H event or a staging buffer: re-check soon
        return self._report(wanted & self._finished)

    def wait_snapshots(self, request_ids: Iterable[str], timeout: float) -> bool:
        """Block until no snapshot still reads the sources of ``request_ids``; False if ``timeout`` passed.

        What preemption needs: the requests' memory (KV blocks) is reused right after, but their puts may go
        on, since they read staging only. With a copy thread this covers lazy sources, also of saves still
        waiting for a buffer (their gather ran in the step's job); a *plain tensor* of such a save is read
        only when a buffer frees up, so it must stay unwritten until the request is reported. Without a copy
        thread a CPU snapshot happened in ``submit`` and a CUDA one is followed through its event, queued
        saves included.
        """
        return self._mode.wait_snapshots(set(request_ids), time.monotonic() + timeout)

    def held(self) -> dict[str, int]:
        """Resources and state held right now (gauges); all 0 once every request is reported."""
        return {
            "requests": len(self._requests),
            "queued": len(self._queued),
            "buffers_out": self.buffers_out,
            "events_out": self.events_out,
            "futures_pending": self.futures_pending,
            "copy_jobs": self._mode.copy_jobs,
            "inflight_keys": len(self._inflight_keys),
        }

    def totals(self) -> dict[str, int]:
        """Running totals since start (they only grow): saves, bytes, skips, failures by reason."""
        out = {
            "saved": self.saved,
            "saved_bytes": self.saved_bytes,
            "skipped": self.skipped,
            "skipped_existing": self.skipped_existing,
            "requests_failed": self.requests_failed,
        }
        out.update({f"failed_{reason.value}": n for reason, n in self.failures.items()})
        return out

    # Old names (deprecated, docs/transfer.md): they warn and call the new ones.
    counters = renamed_method("counters", "held")
    stats = renamed_method("stats", "totals")
    poll_finished = renamed_method("poll_finished", "poll")

    def close(self, timeout: float = 5.0) -> ShutdownReport:
        """Let running saves finish for up to ``timeout``, then cancel the rest and return their buffers
        (for up to ``CLOSE_CANCEL_S`` more: the whole close stays within ``timeout`` plus that).

        Copies already posted still run (their puts are not started once the grace period is over); the
        copy thread is joined last. Returns how many saves were in flight and how many of them were
        abandoned (not confirmed by the store within the grace period: their values may be missing), so
        the owner can say so at shutdown. A second call does nothing and reports nothing.
        """
        if self._closed:
            return ShutdownReport()
        self._closed = True
        in_flight = sum(request.pending for request in self._requests.values())
        self.wait(list(self._requests), timeout)
        self._progress()
        report = ShutdownReport(in_flight, sum(request.pending for request in self._requests.values()))
        self._mode.cancel()
        deadline = time.monotonic() + min(timeout, CLOSE_CANCEL_S)
        for save in self._queued:
            self._complete(save, Failure.STORE_ERROR, "tracker closed before the save started")
        self._queued.clear()
        cancelled: set[Batch] = set()
        while True:
            self._progress()
            for batch in self._batches - cancelled:
                cancelled.add(batch)
                with contextlib.suppress(RuntimeClosed):
                    self._putter.cancel(batch)
            if not (self.futures_pending or self.events_out or self._mode.copy_jobs):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        self._finished.clear()
        self._requests.clear()
        if not self._mode.close(max(deadline - time.monotonic(), 0.05)):
            log.warning("SaveTracker.close: the copy thread is still running a job")
        if self.buffers_out:
            log.warning(
                "SaveTracker.close: %d staging buffers still out after %.1fs", self.buffers_out, timeout
            )
        return report

    # -- worker side -----------------------------------------------------------------------------------
    def _progress(self) -> None:
        while self._done:
            item = self._done.popleft()
            if isinstance(item, Batch):
                self._on_batch_done(item)
            else:
                self._mode.job_done(item)
        while self._queued and self._snapshot(self._queued[0]):
            self._queued.popleft()  # buffers returned by finished batches: snapshot the queued saves
        self._handoff()

    def _handoff(self) -> None:
        self._mode.handoff()

    def _stage(self, save: Save) -> None:
        """A staging buffer for ``save`` now, else the queue (behind the saves queued already)."""
        if self._queued or not self._snapshot(save):
            self._queued.append(save)
            self._mode.waiting(save)

    def _snapshot(self, save: Save) -> bool:
        """Take a staging buffer and copy (or stage the copy); False when no buffer is free now."""
        try:
            buf = self.pool.acquire(save.nbytes())
        except PoolTooSmall as exc:
            self._complete(save, Failure.TOO_LARGE, str(exc))
            return True
        if buf is None:
            return False
        save.buf = buf
        self.buffers_out += 1
        self._mode.snapshot(save)
        return True

    def _start_batch(self, saves: list[Save]) -> None:
        batch = Batch(saves)
        try:
            self._putter.submit(batch)
        except RuntimeClosed as exc:
            for save in saves:
                self._complete(save, Failure.STORE_ERROR, f"runtime closed: {exc}")
            return
        self.futures_pending += 1
        self._batches.add(batch)
        self._putter.hand_back_when_done(batch)

    def _on_batch_done(self, batch: Batch) -> None:
        future, batch.future = batch.future, None
        assert future is not None and future.done()
        self.futures_pending -= 1
        self._batches.discard(batch)
        if future.cancelled():
            for save in batch.saves:
                self._complete(save, Failure.STORE_ERROR, "put cancelled", quiet=True)
            self._failure_log.warning(
                "cancelled",
                "%d saves cancelled (tracker or runtime closed); %d failed saves (store_error) since start",
                len(batch.saves),
                self.failures[Failure.STORE_ERROR],
            )
            return
        exc = future.exception()
        if exc is not None:
            reason, detail = classify(exc)
            for save in batch.saves:
                self._complete(save, reason, detail, quiet=True)
            self._log_failed(reason, len(batch.saves), detail)
            return
        for save, existed in zip(batch.saves, future.result(), strict=True):
            if existed:
                self.skipped_existing += 1
            else:
                self.saved += 1
                self.saved_bytes += save.nbytes()
            self._remember(save.ident)
            self._complete(save, None, "")

    def _log_failed(self, reason: Failure, count: int, detail: str) -> None:
        """One line for a failed batch, at most one per kind of failure and interval (a store that is down
        must not flood the log). It names the running total, which is the exported counter: a line's own
        count alone fell short of the counter whenever lines were held back."""
        self._failure_log.warning(
            reason,
            "%d saves failed, %s: %s; %d failed saves (%s) since start",
            count,
            reason,
            detail,
            self.failures[reason],
            reason,
        )

    def _complete(self, save: Save, failure: Failure | None, detail: str, *, quiet: bool = False) -> None:
        """Release everything the save holds and count it against its request."""
        if save.buf is not None:
            self.pool.release(save.buf)
            save.buf = None
            self.buffers_out -= 1
        elif save.span is not None:
            span, save.span = save.span, None
            span.refs -= 1
            if span.refs == 0:
                self.pool.release(span.buf)
                self.buffers_out -= 1
        save.source = None
        self._inflight_keys.discard(save.ident)
        if self.on_done is not None:
            self.on_done(save.ident, failure is None)
        if failure is not None:
            self.failures[failure] += 1
        if failure is not None and not quiet:
            self._failure_log.warning(
                failure, "save of %r (request %r) failed, %s: %s", save.key, save.request_id, failure, detail
            )
        request = self._requests.get(save.request_id)
        if request is None:
            return  # forgotten by a close() that timed out
        request.pending -= 1
        if failure is not None:
            request.failed += 1
        if request.pending == 0:
            self._finished.add(save.request_id)

    def _report(self, ids: set[str]) -> set[str]:
        out = set(ids)
        for request_id in out:
            request = self._requests.pop(request_id, None)
            if request is not None and request.failed:
                self.requests_failed += 1
            self._finished.discard(request_id)
        return out

    def _remember(self, key: Hashable) -> None:
        if not self.recent_keys:
            return
        self._recent[key] = None
        self._recent.move_to_end(key)
        while len(self._recent) > self.recent_keys:
            self._recent.popitem(last=False)
