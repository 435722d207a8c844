"""fork(): a runtime, runtime future or store inherited by a child works there or fails at once -- never
hangs -- and the child never touches the parent's connections (real os.fork, real redis-server)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable

import pytest
import torch

from asyncconn.exceptions import AsyncConnError, UsedAfterFork
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import TensorStore
from tests.servers import RedisServer

CHILD_LIMIT = 20.0  # a child still running after this has hung: killed, and the test fails


def in_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child and return its exit status (the child leaves through os._exit).

    The child arms SIGALRM so that even a hang the parent fails to notice ends it.
    """
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            signal.alarm(int(CHILD_LIMIT) + 5)
            code = body()
        except BaseException:  # anything unexpected: a distinct status, never a second pytest run
            code = 98
        finally:
            os._exit(code)
    deadline = time.monotonic() + CHILD_LIMIT
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFEXITED(status), f"child killed by signal {os.WTERMSIG(status)}"
            return os.WEXITSTATUS(status)
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"the forked child hung for {CHILD_LIMIT}s")


async def _answer() -> int:
    await asyncio.sleep(0)
    return 42


def test_a_runtime_and_its_future_captured_before_fork_fail_at_once_in_the_child() -> None:
    rt = Runtime(name="fork-parent").start()
    try:
        assert rt.run(_answer(), timeout=5) == 42
        pending = rt.submit(asyncio.sleep(30))

        def child() -> int:
            started = time.monotonic()
            for use in (
                lambda: rt.run(_answer()),
                lambda: rt.submit(_answer()),
                lambda: rt.call_soon(print),
                lambda: pending.result(),
            ):
                try:
                    use()
                except UsedAfterFork as exc:
                    if "forked child" not in str(exc):
                        return 2
                else:
                    return 3
            rt.close()  # only marks it closed: the loop is the parent's
            if time.monotonic() - started > 1.0:
                return 4
            # the process-wide runtime is fresh in the child and works
            return 0 if get_runtime().run(_answer(), timeout=5) == 42 else 5

        assert in_child(child) == 0
        pending.cancel()
        assert rt.run(_answer(), timeout=5) == 42  # the parent's runtime is untouched
    finally:
        rt.close()


@pytest.mark.redis
@pytest.mark.parametrize("fast_read", ["true", "false"])
def test_a_child_using_an_inherited_store_leaves_the_parents_answers_right(
    redis_server: RedisServer, fast_read: str
) -> None:
    """The parent's pooled connections (redis-py's and the raw chunk reader's) are warm when it forks; the
    child uses the inherited store on a fresh runtime: an error at once, never an answer over the parent's
    sockets. The parent's next ``exists``/``get`` answers are right, every time."""
    rt = Runtime(name="fork-store").start()
    prefix = f"fork-{fast_read}-{os.getpid()}:"
    url = f"{redis_server.url}?prefix={prefix}&fast_read={fast_read}&chunk_size=4096"
    value = torch.arange(4096, dtype=torch.float32)  # 16 KiB: chunked, read by the raw reader
    store = rt.run(TensorStore.open(url))
    try:
        rt.run(store.put([("a", value)]))
        assert rt.run(store.exists(["a", "b"])) == [True, False]
        (got,) = rt.run(store.get(["a"]))
        assert got is not None and torch.equal(got, value)

        def child() -> int:
            fresh = get_runtime()
            for call in (
                lambda: store.exists(["b", "a", "b"]),
                lambda: store.get(["a"]),
                lambda: store.put([("c", value)]),
            ):
                started = time.monotonic()
                try:
                    fresh.run(call(), timeout=10)
                except UsedAfterFork:
                    pass
                except AsyncConnError:
                    return 2
                except (TypeError, ValueError):
                    return 3  # a raw client error reached the caller
                else:
                    return 4  # the child used the parent's connections
                if time.monotonic() - started > 1.0:
                    return 5
            fresh.run(store.close(), timeout=5)  # leaves the parent's sockets alone
            # a store the child opens itself works
            own = fresh.run(TensorStore.open(url), timeout=10)
            ok = fresh.run(own.exists(["a", "b"]), timeout=10) == [True, False]
            fresh.run(own.close(), timeout=10)
            return 0 if ok else 6

        for _ in range(3):
            assert in_child(child) == 0
            for _ in range(20):
                assert rt.run(store.exists(["a", "b"]), timeout=5) == [True, False]
                assert rt.run(store.exists(["b", "a"]), timeout=5) == [False, True]
                (got,) = rt.run(store.get(["a"]), timeout=5)
                assert got is not None and torch.equal(got, value)
    finally:
        rt.run(store.delete(["a", "c"]))
        rt.run(store.close())
        rt.close()


@pytest.mark.redis
def test_an_unexpected_client_error_becomes_ours_and_drops_every_connection(
    redis_server: RedisServer, runtime: Runtime
) -> None:
    """A reply that is not the one expected (a connection out of step) makes redis-py raise a plain
    TypeError/ValueError: the caller gets a BackendError, and no pooled connection is used again."""
    from asyncconn.exceptions import BackendError

    store = runtime.run(TensorStore.open(f"{redis_server.url}?prefix=oos-{os.getpid()}:"))
    backend = store.backend
    real = backend._client.pipeline
    try:
        assert runtime.run(store.exists(["a"])) == [False]
        assert backend.held()["connected"] >= 1
        for error in (TypeError, ValueError):

            def broken(*args, _error=error, **kwargs):
                pipe = real(*args, **kwargs)

                async def execute(*a, **kw):
                    raise _error("int() argument must be a string, not 'NoneType'")

                pipe.execute = execute
                return pipe

            backend._client.pipeline = broken
            with pytest.raises(BackendError, match=error.__name__):
                runtime.run(store.exists(["a"]))
            assert backend.held() == {"connected": 0, "in_use": 0}  # dropped, not returned to the pool
            backend._client.pipeline = real
            assert runtime.run(store.exists(["a"])) == [False]  # a fresh connection answers
    finally:
        backend._client.pipeline = real
        runtime.run(store.close())
