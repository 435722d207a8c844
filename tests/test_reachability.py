"""A store that goes away and comes back: one "unreachable" line, one "back" line, and the counts they
quote."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

import pytest
from asyncconn_backends.memory import MemoryBackend

from asyncconn.exceptions import BackendError, BackendUnavailable
from asyncconn.reachability import Reachability
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore

LOGGER = "asyncconn.reachability"


class FlakyBackend(MemoryBackend):
    """A memory store whose ``exists`` fails while ``down`` (unreachable) or ``refuse`` (answers an error)."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False
        self.refuse = False

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if self.down:
            raise BackendUnavailable("connection refused")
        if self.refuse:
            raise BackendError("OOM command not allowed")
        return await super().exists(keys)


@pytest.fixture
def flaky(runtime: Runtime) -> Iterator[tuple[TensorStore, FlakyBackend]]:
    backend = FlakyBackend()
    store = TensorStore(backend, name="memory://flaky")
    yield store, backend
    runtime.run(store.close(), 5)


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def exists(runtime: Runtime, store: TensorStore) -> bool:
    try:
        runtime.run(store.exists(["k"]), 5)
    except BackendError:
        return False
    return True


def test_a_store_that_fails_then_recovers_logs_one_unreachable_and_one_back_line(
    runtime: Runtime, flaky: tuple[TensorStore, FlakyBackend], caplog: pytest.LogCaptureFixture
) -> None:
    store, backend = flaky
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert exists(runtime, store)
        backend.down = True
        for _ in range(50):  # every call fails while it is down: still one line
            assert not exists(runtime, store)
        assert not store.reachability.reachable
        backend.down = False
        for _ in range(5):
            assert exists(runtime, store)
    got = lines(caplog)
    assert len(got) == 2, got
    assert "store memory://flaky unreachable" in got[0] and "connection refused" in got[0]
    assert "outage 1 since start" in got[0]
    assert got[1].startswith("store memory://flaky is back after") and "outage 1 since start" in got[1]
    assert store.reachability.reachable and store.reachability.outages == 1
    assert store.stats.errors == 50


def test_an_error_the_store_answers_is_not_an_outage(
    runtime: Runtime, flaky: tuple[TensorStore, FlakyBackend], caplog: pytest.LogCaptureFixture
) -> None:
    store, backend = flaky
    backend.refuse = True
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not exists(runtime, store)
    assert lines(caplog) == [] and store.reachability.reachable and store.reachability.outages == 0


def test_closing_is_not_an_outage(runtime: Runtime, caplog: pytest.LogCaptureFixture) -> None:
    store = TensorStore(FlakyBackend(), name="memory://closing")
    runtime.run(store.close(), 5)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert not exists(runtime, store)  # the memory backend is closed: BackendUnavailable
    assert lines(caplog) == [] and store.reachability.outages == 0


def test_a_flapping_store_is_counted_but_not_a_flood(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    reach = Reachability("redis://:***@host", interval=30.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for _ in range(10):  # ten outages within the interval
            reach.failed("timed out")
            now[0] += 1.0
            reach.answered()
            now[0] += 1.0
        now[0] = 40.0
        reach.failed("timed out")
        reach.answered()
    got = lines(caplog)
    assert reach.outages == 11
    assert len(got) == 4, got  # the first pair, and the pair after the interval
    assert "outage 1 since start" in got[0] and "back" in got[1]
    assert "outage 11 since start" in got[2] and "9 shorter outages in the last 30s not logged" in got[2]
    assert "outage 11 since start" in got[3] and "back" in got[3]
