"""CPU snapshots for the save tracker: the jobs its :class:`~asyncconn.transfer.copythread.CopyThread` runs.

On CPU the snapshot copy -- and, for the KV adapter, the gather over the KV cache behind a lazy source -- is
the whole cost of a save on vLLM's thread, so the tracker does neither there: at ``flush`` it posts the
step's saves to its copy thread as one :class:`CopyJob`, and :meth:`Copier.run` evaluates the lazy sources,
copies into staging (torch releases the GIL meanwhile), makes each value's frame header (its checksum is a
pass over every byte, better spent here than on the loop thread when the put starts) and submits the put
batches to the loop itself. The worker's ``flush`` is one queue put: no copy and no loop wake-up.

Threads and hand-over (the worker thread is vLLM's, which calls the tracker):

* **Worker -> copy thread.** The worker builds a job (its saves, each with a staging buffer; the step's
  :class:`Group`\\ s, sharing one :class:`~asyncconn.transfer.staging.Span`; the lazy sources to ``touch``)
  and hands it over with ``CopyThread.post`` (a ``SimpleQueue``). From then the copy thread owns the job,
  its saves and their staging bytes: it clears their sources, writes staging and headers, and fills
  ``failed`` and ``batches``. A span's buffer may be allocated by its first toucher (``lazy`` acquire):
  that is the copy thread, its only user until the job is reported.
* **Copy thread -> worker.** The job is handed back by appending it to the tracker's done deque
  (``deque.append`` is thread-safe), *before* any of its batches can be appended there (their
  done-callbacks are added after), so the worker registers every batch before it sees one done. The saves
  made by :meth:`Group.expand` on the copy thread are new objects the worker first sees in that report.
* **The one read across threads**: while a job is posted the worker may call :meth:`CopyJob.reads`
  (preemption: which jobs read these requests' sources?). It reads only what was fixed before posting --
  the lists of saves, groups and touched sources and their request ids -- none of which the copy thread
  writes. :meth:`CopyJob.wait` blocks on a lock the copy thread releases when the job is over.
* **``Copier.cancelling``**: a flag the worker sets once, in ``close`` past its grace period; the copy
  thread reads it before starting each put. A stale read starts one more put, which ``close`` cancels
  like any other.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Any, cast

import torch

from asyncconn import codec
from asyncconn.exceptions import RuntimeClosed
from asyncconn.transfer._device import TransferDevice
from asyncconn.transfer.failures import Failure, classify
from asyncconn.transfer.lazy import LazyTensor, Pieces
from asyncconn.transfer.puts import Batch, Putter
from asyncconn.transfer.staging import Save, Span

__all__ = ["Copier", "CopyJob", "Group"]


class Group:
    """The accepted values of one ``submit_many`` (copy-thread path), in a step's shared staging buffer.

    The worker records only this -- request id, keys, which pieces were taken, where they start in the
    span -- and the copy thread makes the :class:`Save` objects (:meth:`expand`) while it runs the job: new
    objects the worker first sees in the job's report, so each still has one owner at a time.
    """

    __slots__ = ("idents", "name", "nbytes", "offset", "request_id", "span", "taken", "values")

    def __init__(
        self,
        request_id: str,
        idents: Sequence[Hashable],
        name: Callable[[Any], str] | None,
        taken: list[int],
        values: Pieces,
        nbytes: int,
    ) -> None:
        self.request_id = request_id
        self.idents = idents  # what duplicates are detected by; ``name(ident)`` is the store key
        self.name = name
        self.taken = taken
        self.values = values
        self.nbytes = nbytes  # bytes per save in the span (aligned)
        self.span: Span | None = None
        self.offset = 0

    def expand(self) -> list[Save]:
        """One :class:`Save` per taken piece, staged at its slice of the span (when there is one)."""
        rid, idents, name, values = self.request_id, self.idents, self.name, self.values
        span, nbytes, offset = self.span, self.nbytes, self.offset
        out: list[Save] = []
        for i in self.taken:
            ident = idents[i]
            save = Save(rid, cast(str, ident) if name is None else name(ident), values, None, i)
            save.ident = ident
            if span is not None:
                save.span = span
                save.offset = offset
                offset += nbytes
            out.append(save)
        return out


class CopyJob:
    """One flush's snapshots, run by the copy thread; it fills ``failed`` and ``batches``, then ends.

    ``touch`` are the lazy sources of saves still waiting for a staging buffer: evaluated here too, so the
    memory behind them (KV blocks) is read during this job, not whenever a buffer frees up. ``_running`` is
    a lock held from creation until the copy thread has finished the job (cheaper to make on the worker's
    hot path than a ``threading.Event``); :meth:`wait` blocks on it.
    """

    __slots__ = ("_running", "batches", "failed", "groups", "saves", "touch")

    def __init__(self, saves: list[Save], touch: list[tuple[str, LazyTensor]], groups: list[Group]) -> None:
        self.saves = saves
        self.touch = touch
        self.groups = groups  # submit_many's saves, in one staging buffer: made into saves by the copy thread
        self.failed: list[tuple[Save, str]] = []
        self.batches: list[Batch] = []
        self._running = threading.Lock()
        self._running.acquire()

    def reads(self, request_ids: set[str]) -> bool:
        """Worker, off the hot path: whether this job copies or evaluates a source of ``request_ids``."""
        return (
            any(s.request_id in request_ids for s in self.saves)
            or any(g.request_id in request_ids for g in self.groups)
            or any(rid in request_ids for rid, _ in self.touch)
        )

    def all_saves(self) -> list[Save]:
        """The job's saves, its groups' included (expanded now: new objects each call)."""
        return [*self.saves, *(s for g in self.groups for s in g.expand())]

    def finish(self) -> None:
        """Copy thread: the job is over (its report is on the deque already)."""
        self._running.release()

    def wait(self, timeout: float) -> bool:
        """True once the copy thread has finished the job; waits up to ``timeout`` seconds."""
        if not self._running.acquire(timeout=max(timeout, 0.0)):
            return False
        self._running.release()
        return True


class Copier:
    """Runs a tracker's copy jobs (:meth:`run`, posted to its copy thread) and starts their puts.

    ``report`` hands a finished job back to the worker (the tracker's done deque ``append``).
    """

    def __init__(
        self,
        device: TransferDevice,
        putter: Putter,
        put_batch: int,
        report: Callable[[CopyJob], object],
    ) -> None:
        self.device = device
        self.putter = putter
        self.put_batch = put_batch
        self._report = report
        self.cancelling = False  # set by the worker past close()'s grace period: start no puts

    def run(self, job: CopyJob) -> None:
        """Evaluate, copy into staging, frame, submit the puts; then report the job to the worker.

        Runs on the copy thread. It touches only the job, its saves (owned by the job until reported) and
        the thread-safe runtime and deque; the worker learns everything from the job object.
        """
        for _, lazy in job.touch:
            # The gather behind a queued save, run while its memory is valid; a failure here comes back as
            # that save's own copy failure later.
            with contextlib.suppress(Exception):
                lazy()
        ok: list[Save] = []
        saves = job.all_saves() if job.groups else job.saves
        for save in saves:
            source, save.source = save.source, None
            try:
                assert source is not None
                if isinstance(source, torch.Tensor):
                    tensor = source
                elif isinstance(source, Pieces):
                    tensor = source.tensor(save.index)
                else:
                    tensor = source()
                staging = save.staging()
                self.device.copy([(staging, tensor)])
            except Exception as exc:  # a device error, or a lazy source that could not be computed
                job.failed.append((save, f"{type(exc).__name__}: {exc}"))
            else:
                # The frame header is made here, not on the loop thread when the put starts.
                save.header = codec.encode_parts(staging, key=save.key)[0]
                ok.append(save)
        for start in range(0, len(ok), self.put_batch):
            batch = Batch(ok[start : start + self.put_batch])
            job.batches.append(batch)
            if self.cancelling:
                batch.error = (Failure.STORE_ERROR, "tracker closed before the put started")
                continue
            try:
                self.putter.submit(batch)
            except RuntimeClosed as exc:
                batch.error = (Failure.STORE_ERROR, f"runtime closed: {exc}")
            except Exception as exc:  # anything else must still come back as a failure, never a lost job
                batch.error = classify(exc)
        # The job goes on the deque before any of its batches can (their callbacks are added after), so the
        # worker always registers a batch before it sees the batch done.
        self._report(job)
        job.finish()
        for batch in job.batches:
            if batch.future is not None:
                self.putter.hand_back_when_done(batch)
