"""The one background event loop that all asyncconn I/O runs on, and the bridge sync code uses to reach it.

vLLM's scheduler and worker are synchronous threads that must never wait on I/O. They hand coroutines to
:class:`Runtime` with :meth:`Runtime.submit` and get a :class:`concurrent.futures.Future` back, whose
``done()`` they poll on later steps. The loop thread owns every socket and store client; nothing else touches
them, so no locks are needed around I/O (docs/architecture.md, "Threads and ownership").

Calling ``result()`` on such a future from the loop thread itself would deadlock; here it raises
:class:`LoopThreadBlocked` instead.

Fork: the parent's loop thread does not exist in a forked child. :func:`get_runtime` gives the child a
fresh runtime on first use. A :class:`Runtime` object (or a pending future of one) carried over from the
parent raises :class:`UsedAfterFork` at once when used in the child -- before, a ``run`` there waited
forever for a thread that is not there. :func:`fork_generation` lets other objects that own sockets (a
store) tell that they were made in another process, without a system call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from asyncconn.exceptions import LoopThreadBlocked, RuntimeClosed, UsedAfterFork

__all__ = [
    "LoopFuture",
    "Runtime",
    "fork_generation",
    "forked_error",
    "get_runtime",
    "keep_inherited",
    "shutdown_runtime",
]

T = TypeVar("T")
log = logging.getLogger(__name__)


_generation = 0  # forks this process descends from; bumped in the child (see _after_fork_in_child)


def fork_generation() -> int:
    """A number that changes in a forked child: an object that saved it at birth knows it was inherited."""
    return _generation


def forked_error(what: str, pid: int) -> UsedAfterFork:
    return UsedAfterFork(
        f"{what} was made in process {pid} and cannot be used in its forked child {os.getpid()} (its loop "
        "thread and connections belong to the parent); make a new one in the child -- "
        "asyncconn.runtime.get_runtime() gives the child its own runtime"
    )


def _new_loop(use_uvloop: bool) -> asyncio.AbstractEventLoop:
    if use_uvloop:
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


class LoopFuture(concurrent.futures.Future[T]):
    """A ``concurrent.futures.Future`` that refuses to block on its runtime's own loop thread."""

    _loop_thread: threading.Thread | None = None
    _generation = 0
    _pid = 0

    def _check_thread(self) -> None:
        if not self.done() and self._generation != _generation:
            raise forked_error("this runtime future", self._pid)  # nothing in the child will ever complete it
        if not self.done() and threading.current_thread() is self._loop_thread:
            raise LoopThreadBlocked(
                "blocking on a runtime future from the runtime's own loop thread would deadlock; "
                "await the coroutine instead"
            )

    def result(self, timeout: float | None = None) -> T:
        self._check_thread()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._check_thread()
        return super().exception(timeout)


class Runtime:
    """A background thread running one asyncio loop (uvloop when installed).

    ``submit`` is cheap and thread-safe; ``run`` blocks the caller (never on the loop thread) with an
    optional timeout; ``close`` cancels outstanding work and joins the thread.
    """

    def __init__(self, *, name: str = "asyncconn-loop", use_uvloop: bool = True) -> None:
        self._name = name
        self._use_uvloop = use_uvloop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pid = os.getpid()
        self._generation = _generation
        self._tasks: set[asyncio.Task[Any]] = set()

    def _check_process(self) -> None:
        if self._generation != _generation:
            raise forked_error("this runtime", self._pid)

    # -- lifecycle -------------------------------------------------------------------------------------
    def start(self) -> Runtime:
        """Start the loop thread (idempotent)."""
        self._check_process()
        with self._lock:
            if self._closed:
                raise RuntimeClosed("runtime is closed")
            if self._thread is not None:
                return self
            loop = _new_loop(self._use_uvloop)
            started = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                try:
                    loop.run_forever()
                finally:
                    try:
                        loop.run_until_complete(loop.shutdown_asyncgens())
                    finally:
                        loop.close()

            thread = threading.Thread(target=main, name=self._name, daemon=True)
            thread.start()
            started.wait()
            self._loop, self._thread = loop, thread
        return self

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        self._check_process()
        if self._loop is None:
            self.start()
        assert self._loop is not None
        return self._loop

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    @property
    def uses_uvloop(self) -> bool:
        return type(self.loop).__module__.startswith("uvloop")

    def close(self, timeout: float = 5.0) -> None:
        """Cancel outstanding tasks, stop the loop and join the thread. Safe to call twice.

        In a forked child it only marks the runtime closed: the loop and its thread are the parent's.
        """
        if self._generation != _generation:
            self._closed = True
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if threading.current_thread() is thread:
            raise LoopThreadBlocked("Runtime.close() cannot be called from the loop thread")

        async def _drain() -> None:
            tasks = [t for t in self._tasks if not t.done()]
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=timeout)

        try:
            asyncio.run_coroutine_threadsafe(_drain(), loop).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("asyncconn runtime: tasks did not finish within %.1fs of close()", timeout)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout)

    # -- the bridge ------------------------------------------------------------------------------------
    def submit(self, coro: Coroutine[Any, Any, T]) -> LoopFuture[T]:
        """Schedule ``coro`` on the loop; return a future that sync code may poll or wait on.

        Cancelling the returned future cancels the task on the loop.
        """
        if self._generation != _generation:
            coro.close()
            raise forked_error("this runtime", self._pid)
        if self._closed:
            coro.close()
            raise RuntimeClosed("runtime is closed")
        loop = self.loop
        fut: LoopFuture[T] = LoopFuture()
        fut._loop_thread = self._thread
        fut._generation, fut._pid = self._generation, self._pid

        def _spawn() -> None:
            if fut.done():  # cancelled before the loop got to it
                coro.close()
                return
            task = loop.create_task(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            task.add_done_callback(lambda t: _copy_to_future(t, fut))
            fut.add_done_callback(lambda f: _cancel_task_from_future(f, task, loop))

        if threading.current_thread() is self._thread:
            _spawn()
        else:
            try:
                loop.call_soon_threadsafe(_spawn)
            except RuntimeError:
                coro.close()
                raise RuntimeClosed("runtime loop is not running") from None
        return fut

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (from a thread other than the loop thread).

        On timeout the task is cancelled and ``concurrent.futures.TimeoutError`` is raised.
        """
        if self._generation != _generation:
            coro.close()
            raise forked_error("this runtime", self._pid)
        if self.in_loop_thread():
            coro.close()
            raise LoopThreadBlocked("Runtime.run() called from the loop thread; await the coroutine instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Run a plain callback on the loop thread (thread-safe, fire and forget)."""
        self._check_process()
        if self._closed:
            raise RuntimeClosed("runtime is closed")
        self.loop.call_soon_threadsafe(fn, *args)


def _copy_to_future(task: asyncio.Task[T], fut: concurrent.futures.Future[T]) -> None:
    # The future stays PENDING until here (so a caller's cancel() works); a cancel racing with this copy
    # from another thread wins and the result is dropped.
    if fut.done():
        return
    try:
        if task.cancelled():
            fut.cancel()
            return
        exc = task.exception()
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(task.result())
    except concurrent.futures.InvalidStateError:
        pass


def _cancel_task_from_future(
    fut: concurrent.futures.Future[Any], task: asyncio.Task[Any], loop: asyncio.AbstractEventLoop
) -> None:
    if fut.cancelled() and not task.done():
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(task.cancel)


_default: Runtime | None = None
_default_lock = threading.Lock()


def get_runtime() -> Runtime:
    """The process-wide runtime, started on first use (and anew in a forked child)."""
    global _default
    rt = _default
    if rt is not None and not rt.closed and rt._generation == _generation:
        return rt
    with _default_lock:
        if _default is None or _default.closed or _default._generation != _generation:
            _default = Runtime().start()
        return _default


def shutdown_runtime(timeout: float = 5.0) -> None:
    """Close the process-wide runtime, if one was started."""
    global _default
    with _default_lock:
        rt, _default = _default, None
    if rt is not None and rt._generation == _generation:
        rt.close(timeout)


#: What the child inherited and must never finalize: closing a parent's transport in the child would take
#: its socket out of the epoll set the two processes share (the parent would stop hearing its replies).
_inherited: list[object] = []


def _after_fork_in_child() -> None:
    # The parent's loop thread does not exist here; keep its runtime out of reach without touching it.
    global _default, _default_lock, _generation
    _generation += 1
    if _default is not None:
        _inherited.append(_default)
    _default = None
    _default_lock = threading.Lock()


def keep_inherited(obj: object) -> None:
    """Hold ``obj`` (a parent's connection pool, client, loop) for the child's lifetime, never closed."""
    _inherited.append(obj)


os.register_at_fork(after_in_child=_after_fork_in_child)
