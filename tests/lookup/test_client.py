"""LookupClient logic against a transport the test controls (real runtime thread, fake store)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError, LoopThreadBlocked, RuntimeClosed
from asyncconn.lookup import EXISTS, PREFIX, LookupClient, LookupConfig
from asyncconn.runtime import Runtime
from tests.lookup.fakes import FakeTransport, noop, wait_until


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-test-loop").start()
    try:
        yield runtime
    finally:
        runtime.close()


def make(rt: Runtime, *, timeout: float = 60.0, mode=PREFIX, **kw) -> tuple[LookupClient, FakeTransport]:
    fake = FakeTransport()
    return LookupClient(fake, mode, runtime=rt, timeout=timeout, **kw), fake


def keys_for(gen: int) -> list[bytes]:
    return [bytes([gen % 256, i]) for i in range(gen + 1)]


def test_submit_poll_consumes_exactly_once(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("r1", keys_for(3))
    assert client.poll("r1") is None  # not yet
    rt.run(noop())
    assert list(fake.pending.values()) == [tuple(keys_for(3))]
    (wid,) = fake.pending
    rt.run(fake.answer(wid))
    assert client.poll("r1") == 4
    assert client.poll("r1") is None  # consumed
    assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    snap = client.metrics.snapshot()
    assert (snap["submitted"], snap["completed"], snap["hits"], snap["keys_hit"]) == (1, 1, 1, 4)
    client.close()
    assert fake.closed


def test_second_submit_while_pending_is_a_noop(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("r", keys_for(1))
    client.submit("r", keys_for(5))
    rt.run(noop())
    assert fake.sent == 1 and client.metrics.submitted == 1
    rt.run(fake.answer_all())
    assert client.lookup("r", keys_for(5)) == 2  # the first submission's answer
    client.close()


def test_discarded_answer_is_never_returned_and_resubmit_is_fresh(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("r", keys_for(1))
    rt.run(noop())
    (old,) = fake.pending
    assert client.discard("r") is True
    assert client.discard("r") is False
    client.submit("r", keys_for(2))
    rt.run(noop())
    new = max(fake.pending)
    rt.run(fake.answer(old))  # late answer for the discarded submission
    assert client.poll("r") is None
    assert client.metrics.stale == 1
    rt.run(fake.answer(new))
    assert client.poll("r") == 3
    client.close()


def test_discard_before_the_loop_drains(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("r", keys_for(0))
    client.discard("r")
    rt.run(noop())
    assert fake.sent == 0
    assert client.held()["inflight"] == 0
    client.close()


def test_duplicate_and_garbage_answers(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("a", keys_for(1))
    client.submit("b", keys_for(1))
    rt.run(noop())
    wa, wb = sorted(fake.pending)
    rt.run(fake.answer(wa, keep=True))
    rt.run(fake.answer(wa))  # a duplicate reply is dropped as stale
    rt.run(fake.answer(wb, 99))  # more leading keys than were asked: garbage -> error -> miss
    assert client.poll("a") == 2
    assert client.poll("b") == 0
    snap = client.metrics.snapshot()
    assert (snap["stale"], snap["errors"]) == (1, 1)
    client.close()


def test_timeout_resolves_as_miss_and_late_answer_is_dropped(rt: Runtime) -> None:
    client, fake = make(rt, timeout=0.2)
    client.submit("r", keys_for(2))
    assert client.poll("r") is None
    wait_until(lambda: client.metrics.timeouts == 1)
    assert client.poll("r") == 0
    rt.run(fake.answer_all())
    assert client.metrics.stale == 1
    assert client.poll("r") is None
    assert client.held()["inflight"] == 0
    client.close()


def test_exists_mode(rt: Runtime) -> None:
    client, fake = make(rt, mode=EXISTS, timeout=0.2)
    client.submit("r", ["mm-a", "mm-b"])
    rt.run(noop())
    (wid,) = fake.pending
    rt.run(fake.answer(wid, (True, False)))
    assert client.poll("r") == (True, False)
    assert client.lookup_sync("t", ["x", "y", "z"]) == (False, False, False)  # never answered: timeout miss
    assert client.metrics.timeouts == 1
    client.close()


def test_sync_mode_returns_the_answer(rt: Runtime) -> None:
    client, fake = make(rt)

    def answer_soon() -> None:
        wait_until(lambda: bool(fake.pending))
        rt.run(fake.answer_all())

    import threading

    t = threading.Thread(target=answer_soon)
    t.start()
    assert client.lookup_sync("r", keys_for(4)) == 5
    t.join()
    assert client.held()["entries"] == 0
    client.close()


def test_sync_mode_refuses_the_loop_thread(rt: Runtime) -> None:
    client, _ = make(rt)

    async def on_loop() -> None:
        client.lookup_sync("r", [b"k"])

    with pytest.raises(LoopThreadBlocked):
        rt.run(on_loop())
    client.close()


def test_poll_answer_says_whether_the_store_gave_the_answer(rt: Runtime) -> None:
    """A real answer, a garbage reply, a timeout and a refusal: only the first is the store's."""
    client, fake = make(rt, timeout=0.2, max_pending=3)
    for rid in ("real", "garbage", "late"):
        client.submit(rid, keys_for(2))
    client.submit("refused", keys_for(2))  # past max_pending: a miss at once
    rt.run(noop())
    wreal, wgarbage, _ = sorted(fake.pending)
    rt.run(fake.answer(wreal, 1, keep=True))
    rt.run(fake.answer(wgarbage, 99, keep=True))
    wait_until(lambda: client.metrics.timeouts == 1)
    assert client.poll_answer("real") == (1, True)
    assert client.poll_answer("garbage") == (0, False)
    assert client.poll_answer("late") == (0, False)
    assert client.poll_answer("refused") == (0, False)
    assert client.poll_answer("real") is None  # consumed
    client.close()


def test_max_pending_rejects_as_miss(rt: Runtime) -> None:
    client, fake = make(rt, max_pending=2)
    for rid in ("a", "b", "c"):
        client.submit(rid, keys_for(1))
    assert client.poll("c") == 0  # resolved at once
    assert client.metrics.rejected == 1
    rt.run(noop())
    assert fake.sent == 2
    client.close()


def test_close_releases_everything_and_refuses_new_work(rt: Runtime) -> None:
    client, fake = make(rt)
    for i in range(10):
        client.submit(f"r{i}", keys_for(1))
    client.close()
    client.close()
    assert fake.closed
    assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    with pytest.raises(RuntimeClosed):
        client.submit("x", [b"k"])


def test_ten_thousand_outstanding_released_after_discard(rt: Runtime) -> None:
    client, fake = make(rt)
    for i in range(10_000):
        client.submit(f"r{i}", [b"a", b"b"])
    rt.run(noop())
    assert client.held()["inflight"] == 10_000
    for i in range(10_000):
        client.discard(f"r{i}")
    rt.run(noop())
    assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    rt.run(fake.answer_all())
    assert client.metrics.stale == 10_000
    client.close()


def test_metrics_take_reports_deltas(rt: Runtime) -> None:
    client, fake = make(rt)
    client.submit("a", keys_for(0))
    rt.run(noop())
    rt.run(fake.answer_all())
    first = client.metrics.take()
    assert first["submitted"] == 1 and sum(first["latency_buckets"]) == 1  # type: ignore[arg-type]
    second = client.metrics.take()
    assert second["submitted"] == 0 and sum(second["latency_buckets"]) == 0  # type: ignore[arg-type]
    assert client.metrics.snapshot()["submitted"] == 1
    client.close()


def test_config_chooses_transport() -> None:
    from asyncconn.lookup import DirectTransport, ZmqTransport

    assert isinstance(LookupConfig(backend_url="memory://").transport(), DirectTransport)
    assert isinstance(
        LookupConfig(backend_url="memory://", lookup_server="tcp://127.0.0.1:1").transport(), ZmqTransport
    )
    cfg = LookupConfig.from_settings(
        Settings.from_extra_config({"lookup_server": "ipc:///tmp/x", "lookup_timeout": "250ms"})
    )
    assert cfg.lookup_timeout == 0.25 and isinstance(cfg.transport(), ZmqTransport)
    with pytest.raises(ConfigError):
        LookupConfig()
    with pytest.raises(ConfigError, match="lookup_timeout"):
        Settings.from_extra_config({"backend_url": "memory://", "lookup_timeout": "soon"})
    with pytest.raises(ConfigError, match="endpoint"):
        ZmqTransport("127.0.0.1:5570")


# -- the property: interleavings of submit / poll / discard / finish / answers -----------------------
RIDS = ["r0", "r1", "r2"]
op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(RIDS)),
    st.tuples(st.just("poll"), st.sampled_from(RIDS)),
    st.tuples(st.just("discard"), st.sampled_from(RIDS)),  # finish, abort and preemption all discard
    st.tuples(st.just("answer"), st.integers(0, 50)),  # the store answers some lookup, out of order
    st.tuples(st.just("dup"), st.integers(0, 50)),  # ... or answers one twice
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(op, max_size=40))
def test_no_stale_result_and_nothing_left_behind(rt: Runtime, ops: list[tuple[str, object]]) -> None:
    client, fake = make(rt)
    gen = dict.fromkeys(RIDS, 0)  # generation of each id's current submission
    outstanding: dict[str, bool] = dict.fromkeys(RIDS, False)
    answered: set[tuple[str, int]] = set()
    wid_of: dict[int, tuple[str, int]] = {}
    seen_wids: set[int] = set()
    for name, arg in ops:
        if name == "submit":
            rid = str(arg)
            client.submit(rid, [rid.encode(), *keys_for(gen[rid] + 1 if not outstanding[rid] else gen[rid])])
            if not outstanding[rid]:
                gen[rid] += 1
                outstanding[rid] = True
            rt.run(noop())
            for wid in fake.pending:
                if wid not in seen_wids:
                    seen_wids.add(wid)
                    wid_of[wid] = (rid, gen[rid])
        elif name == "poll":
            rid = str(arg)
            got = client.poll(rid)
            if outstanding[rid] and (rid, gen[rid]) in answered:
                assert got == 1 + gen[rid] + 1  # the rid key plus keys_for(gen): never an older generation
                outstanding[rid] = False
            else:
                assert got is None
        elif name == "discard":
            rid = str(arg)
            assert client.discard(rid) is outstanding[rid]
            outstanding[rid] = False
        elif fake.pending:
            wid = sorted(fake.pending)[int(str(arg)) % len(fake.pending)]
            rt.run(fake.answer(wid, keep=(name == "dup")))
            answered.add(wid_of[wid])
    for rid in RIDS:
        client.discard(rid)
    rt.run(noop())
    rt.run(fake.answer_all())  # every late answer arrives after its request is gone
    for rid in RIDS:
        assert client.poll(rid) is None
    assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
    assert not fake.pending
    client.close()


def test_runtime_closed_underneath_raises_library_error() -> None:
    runtime = Runtime(name="short-lived").start()
    client, _ = make(runtime)
    client.submit("a", [b"k"])
    runtime.close()
    with pytest.raises(RuntimeClosed):
        client.submit("b", [b"k"])
    assert not client.pending("b")
    assert client.discard("a") is True  # never raises
    client.close()  # nothing left to do, no error


def test_close_never_raises_for_a_hung_or_failing_transport(
    rt: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM shuts the connector down whatever state the store is in: a transport that hangs on close (a
    Mooncake client unmounting from a dead master) or fails must not turn shutdown into an exception."""
    import asyncio
    import time

    from asyncconn.exceptions import BackendUnavailable

    class Hanging(FakeTransport):
        async def close(self) -> None:
            await asyncio.sleep(30)

    class Failing(FakeTransport):
        async def close(self) -> None:
            raise BackendUnavailable("store is gone")

    for transport, said in ((Hanging(), "did not close within"), (Failing(), "store is gone")):
        client: LookupClient[int] = LookupClient(transport, mode=PREFIX, runtime=rt, timeout=60.0)
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="asyncconn.lookup.client"):
            client.close(timeout=0.2)
        assert time.monotonic() - t0 < 5
        assert said in caplog.text
        client.close()  # twice: a no-op
        caplog.clear()


def test_wait_returns_when_every_outstanding_lookup_is_answered(rt: Runtime) -> None:
    import threading
    import time

    client, fake = make(rt)
    assert client.wait(5.0) is True and not client.outstanding()  # nothing out: at once
    client.submit("a", keys_for(1))
    client.submit("b", keys_for(2))
    rt.run(noop())
    assert client.outstanding()
    started = time.monotonic()
    assert client.wait(0.02) is False  # unanswered: bounded, never longer than asked (plus slack)
    assert 0.015 < time.monotonic() - started < 2.0

    def answer_later() -> None:
        time.sleep(0.05)
        rt.run(fake.answer_all())

    answering = threading.Thread(target=answer_later)
    answering.start()
    started = time.monotonic()
    assert client.wait(30.0) is True  # woken by the answers, long before the bound
    assert time.monotonic() - started < 10.0
    answering.join()
    assert not client.outstanding()
    assert (client.poll("a"), client.poll("b")) == (2, 3)
    client.close()


def test_wait_refuses_the_loop_thread(rt: Runtime) -> None:
    client, _ = make(rt)

    async def on_loop() -> None:
        client.wait(0.01)

    with pytest.raises(LoopThreadBlocked):
        rt.run(on_loop())
    client.close()
