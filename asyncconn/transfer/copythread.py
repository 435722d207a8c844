"""The CPU's "side stream": one daemon thread that runs copy jobs in order, off the caller's thread.

On CUDA a snapshot is an asynchronous D2H launch on a side stream, so ``SaveTracker.submit`` costs a kernel
launch. On CPU the same snapshot is a synchronous ``copy_`` (plus, for the KV adapter, a gather over the KV
cache) on vLLM's thread -- the whole cost of ``wait_for_save`` there. A :class:`CopyThread` takes those copies
instead: torch's copies and gathers release the GIL while they run, so the caller's thread goes on.

Jobs run in the order posted (a stream's order). A job must not raise; one that does is logged and the
thread goes on (the save tracker catches its own errors and reports them as save failures). The thread
starts on :meth:`start` or the first job, is a daemon (it never keeps the interpreter alive), and
:meth:`close` -- or the owner being garbage-collected -- stops it after the jobs already posted. It runs
under ``SCHED_BATCH`` where Linux offers it, so waking it never preempts the thread that posted the job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable

from asyncconn.exceptions import TransferError
from asyncconn.transfer._device import single_thread_torch

__all__ = ["CopyThread"]

log = logging.getLogger(__name__)

Job = Callable[[], None]


class CopyThread:
    """Runs posted jobs one after another on a single daemon thread. Post and close from one thread."""

    def __init__(self, name: str = "asyncconn-copy") -> None:
        self.name = name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._closed = False
        # A tracker dropped without close(): the thread still ends (it holds the queue, not this object).
        self._finalizer = weakref.finalize(self, self._queue.put, None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def closed(self) -> bool:
        return self._closed

    def start(self) -> None:
        """Start the thread now (idempotent; :meth:`post` starts it otherwise).

        Why: ``Thread.start`` waits until the new thread runs (milliseconds on a loaded machine), so an owner
        on vLLM's hot path starts it at construction (engine start-up), not in the first step.
        """
        if self._closed:
            raise TransferError(f"{self.name}: copy thread is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=_run, args=(self._queue,), name=self.name, daemon=True)
            self._thread.start()

    def post(self, job: Job) -> None:
        """Queue ``job``; it runs after every job posted before it. Never blocks (once started)."""
        if self._thread is None:
            self.start()
        elif self._closed:
            raise TransferError(f"{self.name}: copy thread is closed")
        self._queue.put(job)

    def close(self, timeout: float = 5.0) -> bool:
        """Run the jobs already posted, then stop the thread; True when it has ended within ``timeout``."""
        if not self._closed:
            self._closed = True
            self._finalizer()  # posts the stop marker once
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _run(jobs: queue.SimpleQueue[Job | None]) -> None:
    _yield_to_posters()
    single_thread_torch()  # its gathers and copies must not start an OpenMP team beside vLLM's
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            job()
        except BaseException:  # a job's bug must not kill the stream: later jobs would never run
            log.exception("copy job failed")
        del job


def _yield_to_posters() -> None:
    """Put the calling thread under ``SCHED_BATCH`` where the OS has it (Linux; unprivileged).

    Why: a job is posted from vLLM's thread, and waking this thread used to preempt the poster on its own
    CPU (the kernel favours a thread that wakes from sleep). A batch thread never preempts on wake-up; it
    gets the same CPU share, just not in the middle of the poster's step, which keeps ``post`` cheap on a
    machine with few cores. Elsewhere this does nothing.
    """
    setter = getattr(os, "sched_setscheduler", None)
    policy = getattr(os, "SCHED_BATCH", None)
    if setter is None or policy is None:
        return
    with contextlib.suppress(OSError):
        setter(0, policy, os.sched_param(0))
