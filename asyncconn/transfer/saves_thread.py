"""Saves snapshotted on a copy thread (a CPU device's default).

On CPU the copies are the expensive part, so ``submit`` only takes a staging buffer and queues the save,
and ``flush`` posts the step's saves to the tracker's :class:`CopyThread` as *one* job
(:mod:`asyncconn.transfer.snapshot`), which copies, frames and submits the put batches to the loop itself:
the worker's ``flush`` is one queue put, no copy and no loop wake-up. ``submit_many`` of a
:class:`~asyncconn.transfer.lazy.Pieces` only checks duplicates and counts on the caller's thread; the
step's accepted values get *one* staging buffer at ``flush`` (a slice each), and the copy thread makes
their save objects -- and, given ``name``, their store keys -- while it runs the job.

Threads: the worker owns the next job (``_step``, ``_touch``, ``_groups``) until it is posted; the copy
thread owns a posted job until it is on the tracker's done deque. The worker reads a posted job's request
ids (``CopyJob.reads``), and the copy thread reads ``Copier.cancelling``, set once by the worker in
``close`` (both documented in :mod:`asyncconn.transfer.snapshot`).
"""

from __future__ import annotations

import collections
import functools
import time
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from asyncconn.exceptions import PoolTooSmall, TransferError
from asyncconn.transfer.copythread import CopyThread
from asyncconn.transfer.failures import Failure
from asyncconn.transfer.lazy import LazyTensor, Pieces
from asyncconn.transfer.savedevice import SaveDevice
from asyncconn.transfer.snapshot import Copier, CopyJob, Group
from asyncconn.transfer.staging import Save, Source, Span, aligned

if TYPE_CHECKING:
    from asyncconn.transfer.saver import SaveTracker

__all__ = ["ThreadSaves"]


class ThreadSaves(SaveDevice):
    """The tracker's copy thread copies, frames and starts the puts, one job per ``flush``."""

    def __init__(self, tracker: SaveTracker) -> None:
        super().__init__(tracker)
        self._thread = self.copy_thread = CopyThread("asyncconn-save-copy")
        self._thread.start()  # now, not in the first step's flush (starting a thread waits for it)
        self._copier = Copier(tracker.device, tracker._putter, tracker.put_batch, tracker._done.append)
        # The next copy job, the worker's until posted:
        self._step: list[Save] = []  # buffer taken
        self._groups: list[Group] = []  # submit_many's values, one shared buffer at hand-off
        self._touch: list[tuple[str, LazyTensor]] = []  # lazy sources of queued saves
        self._jobs: collections.deque[CopyJob] = collections.deque()  # posted, not reported back yet

    def new_save(self, request_id: str, key: str, tensor: torch.Tensor | LazyTensor) -> Save:
        return Save(request_id, key, tensor, None)  # a lazy source is evaluated by the job

    def waiting(self, save: Save) -> None:
        source = save.source
        if isinstance(source, Pieces):
            self._touch.append((save.request_id, source[save.index]))
        elif source is not None and not isinstance(source, torch.Tensor):
            self._touch.append((save.request_id, source))

    def snapshot(self, save: Save) -> None:
        self._step.append(save)  # copied by the next job

    def submit_many(
        self,
        request_id: str,
        keys: Sequence[Hashable],
        values: Sequence[Source],
        name: Callable[[Any], str] | None,
    ) -> int:
        tracker = self.tracker
        if not isinstance(values, Pieces):
            return tracker._submit_each(request_id, keys, values, name)
        taken = tracker._admit_many(request_id, keys)
        if not taken:
            return 0
        group = Group(request_id, keys, name, taken, values, aligned(values.nbytes))
        if tracker._queued:  # saves are waiting for buffers already: these queue behind them, one by one
            for save in group.expand():
                tracker._stage(save)
            return len(taken)
        self._groups.append(group)
        return len(taken)

    def submit_stacked(
        self,
        items: Sequence[tuple[str, str]],
        stacked: torch.Tensor,
        idents: Sequence[Hashable],
        taken: list[int],
    ) -> list[int]:
        return self.tracker._submit_rows(items, stacked, idents)  # the copies run here one by one anyway

    def handoff(self) -> None:
        if self._groups:
            self._stage_groups()
        if self._step or self._touch or self._groups:
            self._post_job()

    def _stage_groups(self) -> None:
        """At hand-off: give the step's ``submit_many`` values *one* staging buffer (one pool acquire per
        step, each value a slice of it). When the pool cannot give that buffer now (or saves are queued
        already), the values become saves here, staged one by one as :meth:`SaveTracker.submit` does."""
        tracker = self.tracker
        groups = self._groups
        total = count = 0
        for group in groups:
            group.offset = total
            total += group.nbytes * len(group.taken)
            count += len(group.taken)
        try:
            # lazy: a fresh span is allocated by the copy thread, its only user, not on vLLM's thread
            buf = tracker.pool.acquire(total, lazy=True) if not tracker._queued else None
        except PoolTooSmall:
            buf = None  # one by one, each value may still fit (or fail TOO_LARGE alone)
        if buf is not None:
            tracker.buffers_out += 1
            span = Span(buf, count)
            for group in groups:
                group.span = span
            return  # posted with the job: the copy thread makes their saves
        self._groups = []
        for group in groups:
            for save in group.expand():
                tracker._stage(save)

    def _post_job(self) -> None:
        job = CopyJob(self._step, self._touch, self._groups)
        self._step, self._touch, self._groups = [], [], []
        try:
            self._thread.post(functools.partial(self._copier.run, job))
        except TransferError as exc:  # the copy thread is closed: only after close()
            for save in job.all_saves():
                self.tracker._complete(save, Failure.DEVICE_ERROR, str(exc))
            return
        self._jobs.append(job)

    def job_done(self, job: object) -> None:
        assert isinstance(job, CopyJob)
        tracker = self.tracker
        first = self._jobs.popleft()
        assert first is job, "copy jobs are reported in the order they were posted"
        for save, detail in job.failed:
            tracker._complete(save, Failure.DEVICE_ERROR, detail)
        for batch in job.batches:
            if batch.error is not None:
                reason, detail = batch.error
                for save in batch.saves:
                    tracker._complete(save, reason, detail, quiet=True)
                tracker._log_failed(reason, len(batch.saves), detail)
            else:
                tracker.futures_pending += 1
                tracker._batches.add(batch)

    def wait_copies(self, wanted: set[str], timeout: float) -> bool:
        jobs = [j for j in self._jobs if j.reads(wanted)]
        if not jobs:
            return False
        jobs[-1].wait(timeout)  # jobs run in order: the last one done means all of them are
        return True

    def wait_snapshots(self, wanted: set[str], deadline: float) -> bool:
        """Covers lazy sources, also of saves still waiting for a buffer (their gather ran in the step's
        job); a *plain tensor* of such a save is read only when a buffer frees up."""
        self.handoff()  # post the step's copies, if flush() has not yet
        jobs = [j for j in self._jobs if j.reads(wanted)]
        return not jobs or jobs[-1].wait(deadline - time.monotonic())

    @property
    def copy_jobs(self) -> int:
        return len(self._jobs)

    def cancel(self) -> None:
        self._copier.cancelling = True  # read by the copy thread: start no more puts
        self._touch.clear()

    def close(self, timeout: float) -> bool:
        return self._thread.close(timeout)
