from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest

from asyncconn.exceptions import LoopThreadBlocked, RuntimeClosed
from asyncconn.runtime import Runtime, get_runtime


async def _add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


def test_submit_returns_concurrent_future(runtime: Runtime) -> None:
    fut = runtime.submit(_add(1, 2))
    assert isinstance(fut, concurrent.futures.Future)
    assert fut.result(5) == 3
    assert runtime.run(_add(2, 3), timeout=5) == 5


def test_exceptions_propagate(runtime: Runtime) -> None:
    async def boom() -> None:
        raise KeyError("x")

    with pytest.raises(KeyError):
        runtime.run(boom(), timeout=5)


def test_uses_uvloop_when_installed(runtime: Runtime) -> None:
    import uvloop  # noqa: F401  (a runtime dependency on Linux)

    assert runtime.uses_uvloop


def test_blocking_from_loop_thread_raises_instead_of_deadlocking(runtime: Runtime) -> None:
    async def inner() -> str:
        fut = runtime.submit(asyncio.sleep(0.05, "late"))
        try:
            fut.result(1)
        except LoopThreadBlocked:
            return "refused"
        return "blocked"

    assert runtime.run(inner(), timeout=5) == "refused"

    async def run_from_loop() -> str:
        coro = _add(1, 1)
        try:
            runtime.run(coro)
        except LoopThreadBlocked:
            return "refused"
        return "ran"

    assert runtime.run(run_from_loop(), timeout=5) == "refused"


def test_cancel_future_cancels_task(runtime: Runtime) -> None:
    started = threading.Event()
    cancelled = threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    fut = runtime.submit(forever())
    assert started.wait(5)
    fut.cancel()
    assert cancelled.wait(5)


def test_run_timeout_cancels_task(runtime: Runtime) -> None:
    cancelled = threading.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(TimeoutError):
        runtime.run(slow(), timeout=0.05)
    assert cancelled.wait(5)


def test_close_cancels_outstanding_and_rejects_new_work() -> None:
    rt = Runtime().start()
    fut = rt.submit(asyncio.sleep(3600))
    rt.close(timeout=2)
    assert fut.cancelled() or fut.done()
    assert not rt.thread or not rt.thread.is_alive()
    coro = _add(1, 2)
    with pytest.raises(RuntimeClosed):
        rt.submit(coro)
    rt.close()  # idempotent


def test_many_threads_submit_concurrently(runtime: Runtime) -> None:
    results: list[int] = []
    lock = threading.Lock()

    def worker(base: int) -> None:
        futs = [runtime.submit(_add(base, i)) for i in range(200)]
        vals = [f.result(10) for f in futs]
        with lock:
            results.extend(vals)

    threads = [threading.Thread(target=worker, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == sorted(k * 1000 + i for k in range(4) for i in range(200))


def test_forked_child_gets_a_fresh_runtime() -> None:
    parent = get_runtime()
    assert parent.run(_add(1, 1), timeout=5) == 2
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            child = get_runtime()
            ok = child is not parent and child.run(_add(20, 22), timeout=5) == 42
            os.write(write_fd, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(write_fd)
    data = os.read(read_fd, 1)
    os.waitpid(pid, 0)
    os.close(read_fd)
    assert data == b"1"
    assert get_runtime() is parent
