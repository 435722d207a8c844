"""The Mooncake backend's worker threads: Mooncake's client is blocking, so its calls run here, never on
the loop thread.

This pool is the one place in asyncconn where a structure is written by two threads (docs/architecture.md,
"Threads and ownership", says so too). ``Workers._queued`` holds submitted jobs not yet claimed: the loop
inserts into it; a worker pops a job to claim it before running it, or the loop pops it to withdraw it
(cancellation). ``dict.pop(job, False)`` is one atomic operation and jobs hash by identity (no Python code
runs inside the pop), so exactly one party gets the entry: the worker runs the job only if it got it, the
loop counts it withdrawn only if it did. ``_live`` (jobs not finished) is added to by the loop and
discarded from by whichever party won that claim. The thread list, the idle count and the closed flag are
guarded by ``_lock``; the job queue is a ``queue.SimpleQueue``. A job's function and arguments are set on
the loop before it is queued and only read by the worker, which hands the outcome back with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Job", "Workers"]


class Job:
    """One blocking call handed to the workers; its outcome lands in ``future`` on the caller's loop."""

    __slots__ = ("args", "ended", "finished", "fn", "future", "loop")

    def __init__(
        self, fn: Callable[..., Any], args: tuple[Any, ...], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.fn = fn
        self.args = args
        self.loop = loop
        self.future: asyncio.Future[Any] = loop.create_future()
        self.finished = False  # (loop thread) the outcome has been delivered
        self.ended: asyncio.Future[None] | None = None  # (loop thread) made by whoever must outlast it

    def deliver(self, result: Any, error: BaseException | None) -> None:
        """(loop thread) Hand the outcome to the caller, unless it stopped waiting (cancelled, timed out)."""
        self.finished = True
        if not self.future.done():
            if error is None:
                self.future.set_result(result)
            else:
                self.future.set_exception(error)
        if self.ended is not None and not self.ended.done():
            self.ended.set_result(None)


class Workers:
    """At most ``size`` threads running blocking store calls, started only when every one is busy.

    Why not ``ThreadPoolExecutor`` + ``wrap_future``: a hop through it costs about twice one queue and a
    ``call_soon_threadsafe``, which matters when the Mooncake operation itself is as short as the hop.
    Sequential callers keep meeting the same, warm, thread.
    """

    def __init__(self, size: int, name: str) -> None:
        self._size = size
        self._name = name
        self._queue: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()  # guards _idle, _threads and _closed
        self._idle = 0  # threads waiting for a job, less the jobs already queued for them
        self._closed = False
        # Submitted jobs: a worker claims one, or the loop withdraws it, by popping it (atomic in CPython).
        self._queued: dict[Job, None] = {}
        self._live: set[Job] = set()  # submitted, not yet finished

    def submit(self, job: Job) -> bool:
        """Queue ``job``; ``False`` when the workers were shut down."""
        with self._lock:
            if self._closed:
                return False
            if self._idle:
                self._idle -= 1
            elif len(self._threads) < self._size:
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            self._live.add(job)
            self._queued[job] = None
            self._queue.put(job)
        return True

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if self._queued.pop(job, False) is not None:  # withdrawn by the loop: never run it
                self._ready()
                continue
            result: Any = None
            error: BaseException | None = None
            try:
                result = job.fn(*job.args)
            except BaseException as exc:  # handed to the caller, who translates it
                error = exc
            self._live.discard(job)
            self._ready()
            with contextlib.suppress(RuntimeError):  # the caller's loop is closed: nobody is waiting
                job.loop.call_soon_threadsafe(job.deliver, result, error)
            del job, result, error

    def _ready(self) -> None:
        with self._lock:
            self._idle += 1

    async def outlast(self, job: Job, *, withdraw: bool = True) -> None:
        """Wait for ``job`` to end, through further cancellation (re-raised once it has ended).

        With ``withdraw`` a job still queued is withdrawn instead (it will never run); a job shared by
        several callers (a batch of reads) is never withdrawn by one of them.
        """
        if withdraw and self._queued.pop(job, False) is None:  # still queued: it will never run
            self._live.discard(job)
            return
        if job.finished:
            return
        if job.ended is None:
            job.ended = job.loop.create_future()
        ended = job.ended
        cancelled = False
        while not ended.done():
            try:
                await asyncio.shield(ended)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError

    def shutdown(self) -> None:
        """(any thread but a worker) Let queued and running calls finish, then stop every thread."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            thread.join()

    def thread_count(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def jobs_in_flight(self) -> int:
        return len(self._live)
