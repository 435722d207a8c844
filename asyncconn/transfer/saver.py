"""SaveTracker: snapshot now, put later, report completion per request -- ``wait_for_save`` without the wait.

``submit(request_id, key, tensor)`` returns at once. It takes a staging buffer and stages the save; it does
not touch the loop. Two ways to snapshot, chosen by the device:

* **CUDA** (and a ``CpuDevice`` with ``copy_thread=False``): ``submit`` issues the copy -- on CUDA a D2H on
  the tracker's side stream, ordered after an event recorded on the producing stream; on CPU a synchronous
  copy. :meth:`SaveTracker.flush` notices fired events (``event.query()``) and hands the staged saves to the
  loop in batches (one ``exists`` and one ``put`` per batch, one loop wake-up per batch). The loop never
  waits on CUDA; the alternative -- the loop polling events on a timer -- would wake it for nothing most of
  the time.
* **CPU with a copy thread** (the default on CPU): the copies are the expensive part there, so ``submit``
  only takes a staging buffer and queues the save, and ``flush`` posts the step's saves to the tracker's
  :class:`CopyThread` as *one* job (:mod:`asyncconn.transfer.snapshot`), which copies, frames and submits
  the put batches to the loop itself: the worker's ``flush`` is one queue put, no copy and no loop wake-up.
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
  duplicates, staging buffers and the queue waiting for them, CUDA events, completion, ``close``);
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
import functools
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
from asyncconn.transfer.lazy import LazyTensor, Pieces
from asyncconn.transfer.pool import PinnedPool
from asyncconn.transfer.puts import Batch, Putter
from asyncconn.transfer.runs import runs
from asyncconn.transfer.snapshot import Copier, CopyJob, Group
from asyncconn.transfer.staging import Save, Source, Span, aligned

__all__ = ["SaveTracker", "ShutdownReport"]

log = logging.getLogger(__name__)


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
        self._thread = CopyThread("asyncconn-save-copy") if (on_cpu and copy_thread is not False) else None
        if self._thread is not None:
            self._thread.start()  # now, not in the first step's flush (starting a thread waits for it)
        # Appended by the loop (batches whose put ended) and the copy thread (jobs); drained here only.
        self._done: collections.deque[Batch | CopyJob] = collections.deque()
        self._putter = Putter(
            self.store, self.runtime, skip_existing=skip_existing, hand_back=self._done.append
        )
        self._copier = (
            Copier(self.device, self._putter, put_batch, self._done.append)
            if self._thread is not None
            else None
        )
        self._requests: dict[str, _Request] = {}
        self._finished: set[str] = set()  # all saves done, not reported yet
        self._queued: collections.deque[Save] = collections.deque()  # waiting for a staging buffer
        self._copying: collections.deque[Save] = collections.deque()  # snapshot issued, event not fired
        self._staged: list[Save] = []  # snapshot complete, not handed to the loop yet
        # The next copy job (copy-thread path), the worker's until posted:
        self._step: list[Save] = []  # buffer taken
        self._groups: list[Group] = []  # submit_many's values, one shared buffer at hand-off
        self._touch: list[tuple[str, LazyTensor]] = []  # lazy sources of queued saves
        self._jobs: collections.deque[CopyJob] = collections.deque()  # posted, not reported back yet
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

    @property
    def copy_thread(self) -> CopyThread | None:
        """The tracker's copy thread (None on CUDA or when disabled): snapshots run there, asynchronously."""
        return self._thread

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
        if self._thread is None:
            if not isinstance(tensor, torch.Tensor):
                tensor = tensor()
            save = Save(request_id, key, tensor, self.device.mark())
        else:
            save = Save(request_id, key, tensor, None)
        save.ident = ident
        if self._queued or not self._snapshot(save):
            self._queued.append(save)
            if self._thread is not None and not isinstance(tensor, torch.Tensor):
                self._touch.append((request_id, tensor))
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
        if self._thread is None or not isinstance(values, Pieces):
            accepted = 0
            for key, value in zip(keys, values, strict=True):
                if name is None:
                    accepted += self.submit(request_id, cast(str, key), value)
                else:  # known by the identity, as the group path knows it
                    accepted += self.submit(request_id, name(key), value, ident=key)
            return accepted
        if not keys:
            return 0
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
            return 0
        self._finished.discard(request_id)
        request.pending += len(taken)
        group = Group(request_id, keys, name, taken, values, aligned(values.nbytes))
        if self._queued:  # saves are waiting for buffers already: these queue behind them, one by one
            for save in group.expand():
                self._stage_one(save)
            return len(taken)
        self._groups.append(group)
        return len(taken)

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
        nbytes = stacked[0].numel() * stacked.element_size() if len(items) else 0
        stride = aligned(nbytes)
        buf = None
        if taken and self._thread is None and not self._queued:
            with contextlib.suppress(PoolTooSmall):  # one by one below: each value may still fit
                buf = self.pool.acquire(stride * len(taken))
        if buf is None:
            return [
                i for i, (rid, key) in enumerate(items) if self.submit(rid, key, stacked[i], ident=idents[i])
            ]
        self.buffers_out += 1
        span = Span(buf, len(taken))
        producer = self.device.mark()
        saves: list[Save] = []
        for i, (rid, key) in enumerate(items):
            if not self._admit(rid, idents[i]):  # the rows of ``taken``: the same test, in the same order
                continue
            save = Save(rid, key, stacked[i], None)
            save.ident = idents[i]
            save.source = None
            save.span, save.offset = span, len(saves) * stride
            saves.append(save)
        try:
            event = self.device.copy(_span_pairs(buf.storage, stacked, taken, stride), after=producer)
        except RuntimeError as exc:  # torch refused the copy (device error)
            for save in saves:
                self._complete(save, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}")
            return taken
        if not self._copying and event.query():
            self._staged.extend(saves)
            return taken
        for save in saves:
            save.event = event
        self.events_out += len(saves)
        self._copying.extend(saves)
        return taken

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
            jobs = [j for j in self._jobs if j.reads(wanted)]
            if jobs:  # jobs run in order: the last one done means all of them are
                jobs[-1].wait(min(remaining, 0.05))
                continue
            futures = [
                b.future
                for b in self._batches
                if b.future is not None and any(s.request_id in wanted for s in b.saves)
            ]
            others = any(s.request_id in wanted for s in (*self._queued, *self._copying))
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
        wanted = set(request_ids)
        deadline = time.monotonic() + timeout
        if self._thread is not None:
            self._handoff()  # post the step's copies, if flush() has not yet
            jobs = [j for j in self._jobs if j.reads(wanted)]
            return not jobs or jobs[-1].wait(deadline - time.monotonic())
        while any(s.request_id in wanted for s in (*self._queued, *self._copying)):
            if time.monotonic() >= deadline:
                return False
            self._progress()
            time.sleep(0.0005)
        return True

    def held(self) -> dict[str, int]:
        """Resources and state held right now (gauges); all 0 once every request is reported."""
        return {
            "requests": len(self._requests),
            "queued": len(self._queued),
            "buffers_out": self.buffers_out,
            "events_out": self.events_out,
            "futures_pending": self.futures_pending,
            "copy_jobs": len(self._jobs),
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
        """Let running saves finish for up to ``timeout``, then cancel the rest and return their buffers.

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
        if self._copier is not None:
            self._copier.cancelling = True  # read by the copy thread: start no more puts
        deadline = time.monotonic() + timeout
        for save in self._queued:
            self._complete(save, Failure.STORE_ERROR, "tracker closed before the save started")
        self._queued.clear()
        self._touch.clear()
        cancelled: set[Batch] = set()
        while True:
            self._progress()
            for batch in self._batches - cancelled:
                cancelled.add(batch)
                with contextlib.suppress(RuntimeClosed):
                    self._putter.cancel(batch)
            if not (self.futures_pending or self.events_out or self._jobs):
                break
            if time.monotonic() >= deadline:
                break
            time.sleep(0.001)
        self._finished.clear()
        self._requests.clear()
        if self._thread is not None and not self._thread.close(max(deadline - time.monotonic(), 0.1)):
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
            if isinstance(item, CopyJob):
                self._on_job_done(item)
            else:
                self._on_batch_done(item)
        while self._queued and self._snapshot(self._queued[0]):
            self._queued.popleft()  # buffers returned by finished batches: snapshot the queued saves
        self._handoff()

    def _handoff(self) -> None:
        if self._thread is not None:
            if self._groups:
                self._stage_groups()
            if self._step or self._touch or self._groups:
                self._post_job()
            return
        while self._copying and self._copying[0].event is not None and self._copying[0].event.query():
            save = self._copying.popleft()
            self.events_out -= 1
            save.event = None
            self._staged.append(save)
        staged, self._staged = self._staged, []
        for start in range(0, len(staged), self.put_batch):
            self._start_batch(staged[start : start + self.put_batch])

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
        if self._thread is not None:
            self._step.append(save)  # copied by the next job
            return True
        tensor = save.source
        assert isinstance(tensor, torch.Tensor)
        try:
            save.event = self.device.copy([(save.staging(), tensor)], after=save.producer)
        except RuntimeError as exc:  # torch refused the copy (device error)
            self._complete(save, Failure.DEVICE_ERROR, f"{type(exc).__name__}: {exc}")
            return True
        save.source = None
        save.producer = None
        self.events_out += 1
        if not self._copying and save.event.query():
            self.events_out -= 1
            save.event = None
            self._staged.append(save)
        else:
            self._copying.append(save)
        return True

    def _stage_groups(self) -> None:
        """With a copy thread, at hand-off: give the step's ``submit_many`` values *one* staging buffer (one
        pool acquire per step, each value a slice of it). When the pool cannot give that buffer now (or
        saves are queued already), the values become saves here, staged one by one as :meth:`submit` does."""
        groups = self._groups
        total = count = 0
        for group in groups:
            group.offset = total
            total += group.nbytes * len(group.taken)
            count += len(group.taken)
        try:
            # lazy: a fresh span is allocated by the copy thread, its only user, not on vLLM's thread
            buf = self.pool.acquire(total, lazy=True) if not self._queued else None
        except PoolTooSmall:
            buf = None  # one by one, each value may still fit (or fail TOO_LARGE alone)
        if buf is not None:
            self.buffers_out += 1
            span = Span(buf, count)
            for group in groups:
                group.span = span
            return  # posted with the job: the copy thread makes their saves
        self._groups = []
        for group in groups:
            for save in group.expand():
                self._stage_one(save)

    def _stage_one(self, save: Save) -> None:
        """With a copy thread: a buffer of its own for ``save`` now, else the queue (its lazy source is
        evaluated by the step's job all the same)."""
        if self._queued or not self._snapshot(save):
            self._queued.append(save)
            source = save.source
            if isinstance(source, Pieces):
                self._touch.append((save.request_id, source[save.index]))
            elif source is not None and not isinstance(source, torch.Tensor):
                self._touch.append((save.request_id, source))

    def _post_job(self) -> None:
        assert self._thread is not None and self._copier is not None
        job = CopyJob(self._step, self._touch, self._groups)
        self._step, self._touch, self._groups = [], [], []
        try:
            self._thread.post(functools.partial(self._copier.run, job))
        except TransferError as exc:  # the copy thread is closed: only after close()
            for save in job.all_saves():
                self._complete(save, Failure.DEVICE_ERROR, str(exc))
            return
        self._jobs.append(job)

    def _on_job_done(self, job: CopyJob) -> None:
        first = self._jobs.popleft()
        assert first is job, "copy jobs are reported in the order they were posted"
        for save, detail in job.failed:
            self._complete(save, Failure.DEVICE_ERROR, detail)
        for batch in job.batches:
            if batch.error is not None:
                reason, detail = batch.error
                for save in batch.saves:
                    self._complete(save, reason, detail, quiet=True)
                self._log_failed(reason, len(batch.saves), detail)
            else:
                self.futures_pending += 1
                self._batches.add(batch)

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


def _span_pairs(
    storage: torch.Tensor, stacked: torch.Tensor, rows: list[int], stride: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copy pairs putting ``stacked[rows]`` one after another into ``storage`` (uint8), ``stride`` bytes
    apart: one pair per run of consecutive rows when the rows are packed with no padding, else one per row."""
    row_bytes = stacked[0].numel() * stacked.element_size()
    shape, dtype = tuple(stacked.shape[1:]), stacked.dtype
    row_runs = runs(rows) if stride == row_bytes else [(row, 1) for row in rows]
    pairs = []
    offset = 0
    for first, count in row_runs:
        dst = storage[offset : offset + count * row_bytes].view(dtype).view(count, *shape)
        pairs.append((dst, stacked[first : first + count]))
        offset += count * stride
    return pairs
