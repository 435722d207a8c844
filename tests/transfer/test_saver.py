"""SaveTracker on the CPU device: deferred puts, per-request completion, duplicates, failures, wait, leaks.

Every test runs twice: with the tracker's copy thread (the CPU default) and with synchronous snapshots
(``copy_thread=False``, the flow CUDA uses with events)."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from asyncconn_backends.memory import MemoryBackend

from asyncconn import codec
from asyncconn.exceptions import TransferError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, SaveTracker
from asyncconn.transfer.failures import RateLimitedLog
from asyncconn.transfer.lazy import Pieces, Shared
from tests.transfer.fakes import GatedBackend
from tests.transfer.helpers import SAVER_IDLE, drain_saves, same_bytes

_MODE = {"copy_thread": True}


@pytest.fixture(autouse=True, params=[True, False], ids=["copy-thread", "sync"])
def copy_thread(request: pytest.FixtureRequest) -> bool:
    _MODE["copy_thread"] = bool(request.param)
    return _MODE["copy_thread"]


def make_tracker(store: TensorStore, runtime: Runtime, capacity: int = 1 << 22, **kw: object) -> SaveTracker:
    return SaveTracker(
        store,
        runtime=runtime,
        device=CpuDevice(),
        pool=PinnedPool(capacity),
        copy_thread=_MODE["copy_thread"],
        **kw,  # type: ignore[arg-type]
    )


def assert_idle(tracker: SaveTracker) -> None:
    assert tracker.held() == SAVER_IDLE
    assert tracker.pool.buffers_out == 0


def stored(runtime: Runtime, store: TensorStore, key: str) -> torch.Tensor | None:
    return runtime.run(store.get([key]))[0]


def test_saves_are_deferred_and_reported_once_per_request(runtime: Runtime, gated: GatedBackend) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    a, b, c = torch.randn(8, 4), torch.randn(3).to(torch.bfloat16), torch.arange(5)
    assert tracker.submit("r1", "ka", a)
    assert tracker.submit("r1", "kb", b)
    assert tracker.submit("r2", "kc", c)
    assert not gated.entered.is_set()  # submit never reaches the loop: flush() hands saves over
    assert tracker.pending("r1") == 2 and tracker.pending("r2") == 1  # pending() flushes
    assert gated.entered.wait(5)  # the puts are running, and the store acknowledges nothing yet
    assert tracker.poll() == set()
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}
    for key, value in (("ka", a), ("kb", b), ("kc", c)):
        back = stored(runtime, store, key)
        assert back is not None and same_bytes(back, value)
    assert tracker.poll() == set()  # reported once
    assert tracker.pending("r1") == 0
    assert tracker.saved == 3 and tracker.saved_bytes == 8 * 4 * 4 + 3 * 2 + 5 * 8
    assert_idle(tracker)


def test_submit_snapshots_the_tensor(runtime: Runtime, gated: GatedBackend, copy_thread: bool) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    value = torch.ones(16)
    tracker.submit("r", "k", value)
    if copy_thread:  # the copy runs later, on the copy thread: the caller may write once it has run
        assert tracker.wait_snapshots(["r"], timeout=5.0)
    else:
        assert tracker.wait_snapshots(["r"], timeout=0.0)  # synchronous: copied inside submit
    value.fill_(-1.0)  # the caller reuses its memory
    runtime.call_soon(gated.gate.set)
    drain_saves(tracker, {"r"})
    back = stored(runtime, store, "k")
    assert back is not None and torch.equal(back, torch.ones(16))
    assert_idle(tracker)


def test_non_contiguous_tensor_is_saved_as_its_values(runtime: Runtime, store: TensorStore) -> None:
    tracker = make_tracker(store, runtime)
    base = torch.randn(6, 8)
    view = base[:, ::2].t()  # strided
    tracker.submit("r", "k", view)
    drain_saves(tracker, {"r"})
    back = stored(runtime, store, "k")
    assert back is not None and torch.equal(back, view)


def test_duplicate_keys_are_not_resent(runtime: Runtime, gated: GatedBackend) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    value = torch.randn(4)
    assert tracker.submit("r1", "shared", value)
    assert not tracker.submit("r2", "shared", value)  # in flight for r1
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}
    assert not tracker.submit("r3", "shared", value)  # saved recently
    assert tracker.poll() == {"r3"}  # a request whose only save was skipped is done at once
    assert gated.puts == 1 and tracker.skipped == 2
    assert_idle(tracker)


def test_keys_already_in_the_store_are_checked_not_rewritten(runtime: Runtime, gated: GatedBackend) -> None:
    runtime.call_soon(gated.gate.set)
    store = TensorStore(gated)
    runtime.run(store.put([("old", torch.zeros(4))]))
    tracker = make_tracker(store, runtime)  # a fresh tracker: its recent set does not know "old"
    assert tracker.submit("r", "old", torch.ones(4))
    drain_saves(tracker, {"r"})
    assert gated.puts == 1 and tracker.skipped_existing == 1 and tracker.saved == 0
    back = stored(runtime, store, "old")
    assert back is not None and torch.equal(back, torch.zeros(4))
    assert_idle(tracker)


def test_recent_set_is_bounded(runtime: Runtime, store: TensorStore) -> None:
    tracker = make_tracker(store, runtime, recent_keys=4, skip_existing=False)
    for i in range(10):
        tracker.submit(f"r{i}", f"k{i}", torch.tensor([i]))
    drain_saves(tracker, {f"r{i}" for i in range(10)})
    assert len(tracker._recent) == 4
    assert tracker.submit("again", "k0", torch.tensor([0]))  # forgotten, so sent again (exists is off)
    drain_saves(tracker, {"again"})
    assert tracker.saved == 11


def test_store_failure_mid_save_is_counted_and_the_request_still_finishes(
    runtime: Runtime, gated: GatedBackend
) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    tracker.submit("r", "k1", torch.randn(4))
    tracker.submit("r", "k2", torch.randn(4))
    tracker.flush()
    assert gated.entered.wait(5)
    gated.fail_puts = True  # the store goes away while both puts are in flight
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r"}) == {"r"}
    assert tracker.failures[Failure.STORE_ERROR] == 2
    assert tracker.requests_failed == 1 and tracker.saved == 0
    assert store.stats.errors == 1  # both saves went out in one batch put
    # A failed key is not remembered as saved: a later request may try again.
    gated.fail_puts = False
    assert tracker.submit("r-retry", "k1", torch.randn(4))
    drain_saves(tracker, {"r-retry"})
    assert tracker.saved == 1
    assert_idle(tracker)


def test_a_store_that_is_down_logs_one_line_not_one_per_batch(
    runtime: Runtime, gated: GatedBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """Thirty failed batches within the log interval: one warning, the rest counted (all still failed)."""
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    gated.fail_puts = True
    runtime.call_soon(gated.gate.set)
    with caplog.at_level(logging.WARNING, logger="asyncconn.transfer.saver"):
        for i in range(30):
            tracker.submit(f"r{i}", f"k{i}", torch.randn(4))
            assert drain_saves(tracker, {f"r{i}"}) == {f"r{i}"}
    lines = [r for r in caplog.records if r.name == "asyncconn.transfer.saver"]
    assert len(lines) == 1 and "saves failed" in lines[0].getMessage()
    assert tracker.failures[Failure.STORE_ERROR] == 30 and tracker.requests_failed == 30
    assert tracker._failure_log.suppressed == 29
    assert_idle(tracker)


def test_rate_limited_log_reports_what_it_held_back(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("test.ratelog"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="test.ratelog"):
        assert limited.warning("a", "first %s", "x")
        assert not limited.warning("a", "again %s", "x")
        assert limited.warning("b", "another kind")  # kinds are limited separately
        now[0] = 10.5
        assert limited.warning("a", "later %s", "y")
    assert [r.getMessage() for r in caplog.records] == [
        "first x",
        "another kind",
        "later y (and 1 more like it in the last 10s, not logged)",
    ]
    assert limited.suppressed == 1


def test_saves_are_batched_into_one_exists_and_one_put(runtime: Runtime, gated: GatedBackend) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime, put_batch=4)
    for i in range(10):
        tracker.submit(f"r{i % 3}", f"k{i}", torch.tensor([i]))
    runtime.call_soon(gated.gate.set)
    drain_saves(tracker, {"r0", "r1", "r2"})
    assert gated.puts == 3  # 10 saves in batches of 4
    assert tracker.saved == 10 and len(gated.data) == 10
    assert_idle(tracker)


def test_store_timeout_is_counted(runtime: Runtime) -> None:
    store = TensorStore(MemoryBackend(latency=5.0), timeout=0.05)
    tracker = make_tracker(store, runtime)
    tracker.submit("r", "k", torch.randn(4))
    drain_saves(tracker, {"r"})
    assert tracker.failures[Failure.TIMEOUT] == 1
    assert_idle(tracker)


def test_tensor_larger_than_the_pool_fails_that_save_only(runtime: Runtime, store: TensorStore) -> None:
    tracker = make_tracker(store, runtime, capacity=8192)
    tracker.submit("r", "huge", torch.zeros(1 << 16))
    tracker.submit("r", "small", torch.zeros(4))
    drain_saves(tracker, {"r"})
    assert tracker.failures[Failure.TOO_LARGE] == 1 and tracker.saved == 1
    assert_idle(tracker)


def test_pool_exhaustion_queues_snapshots_then_progresses(runtime: Runtime, gated: GatedBackend) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime, capacity=8192)  # two 4 KiB staging buffers
    values = {f"k{i}": torch.full((1024,), float(i)) for i in range(5)}
    for i, (key, value) in enumerate(values.items()):
        tracker.submit(f"r{i}", key, value)
    assert tracker.held()["queued"] == 3 and tracker.held()["buffers_out"] == 2
    runtime.call_soon(gated.gate.set)
    drain_saves(tracker, {f"r{i}" for i in range(5)})
    for key, value in values.items():
        back = stored(runtime, store, key)
        assert back is not None and torch.equal(back, value)
    assert tracker.pool.allocations == 2
    assert_idle(tracker)


def test_wait_blocks_for_the_given_request_only(runtime: Runtime) -> None:
    fast = GatedBackend()
    fast.only_keys = {"k2"}  # k2's put hangs until the gate opens, k1's goes through
    store = TensorStore(fast)
    tracker = make_tracker(store, runtime, put_batch=1)  # one put per save: k1 is not held up by k2
    tracker.submit("preempted", "k1", torch.randn(4))
    tracker.submit("other", "k2", torch.randn(4))
    assert tracker.wait(["preempted"], timeout=5.0) == {"preempted"}
    assert tracker.wait(["other", "unknown"], timeout=0.05) == set()  # gated: not done, not hung either
    assert tracker.pending("other") == 1
    runtime.call_soon(fast.gate.set)
    assert drain_saves(tracker, {"other"}) == {"other"}  # "preempted" was consumed by wait()
    assert_idle(tracker)


def test_close_cancels_hung_saves_and_returns_buffers(runtime: Runtime, gated: GatedBackend) -> None:
    tracker = make_tracker(TensorStore(gated), runtime, capacity=4096)
    tracker.submit("r1", "k1", torch.zeros(1024))
    tracker.submit("r2", "k2", torch.zeros(1024))  # queued: the only buffer is taken
    report = tracker.close(timeout=0.05)
    assert tracker.failures[Failure.STORE_ERROR] == 2
    assert (report.in_flight, report.finished, report.abandoned) == (2, 0, 2)
    assert_idle(tracker)
    with pytest.raises(TransferError, match="closed"):
        tracker.submit("r3", "k3", torch.zeros(1))
    assert tracker.close() == type(report)()  # a second close reports nothing


def test_close_lets_saves_finish_within_the_grace_period_and_counts_them(
    runtime: Runtime, gated: GatedBackend
) -> None:
    """Saves the store confirms during the grace period are finished, not abandoned; only the one whose
    put is still hung when it ends is abandoned (cancelled, its value missing from the store)."""
    gated.only_keys = {"hung"}
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime, put_batch=1)  # one put per save: the hung one holds only itself
    tracker.submit("r1", "k1", torch.ones(256))
    tracker.submit("r2", "k2", torch.ones(256))
    tracker.submit("r3", "hung", torch.ones(256))
    report = tracker.close(timeout=0.5)
    assert (report.in_flight, report.finished, report.abandoned) == (3, 2, 1)
    assert "k1" in gated.data and "k2" in gated.data and "hung" not in gated.data
    assert_idle(tracker)


def test_closed_runtime_fails_saves_without_raising(store: TensorStore) -> None:
    rt = Runtime(name="closed").start()
    rt.close()
    tracker = make_tracker(store, rt, capacity=1 << 16)
    tracker.submit("r", "k", torch.zeros(4))
    assert drain_saves(tracker, {"r"}) == {"r"}
    assert tracker.failures[Failure.STORE_ERROR] == 1
    assert_idle(tracker)


def test_runtime_closing_mid_put_fails_the_saves_and_returns_buffers(gated: GatedBackend) -> None:
    rt = Runtime(name="closing").start()
    tracker = make_tracker(TensorStore(gated), rt, capacity=1 << 16)
    tracker.submit("r", "k1", torch.zeros(4))
    tracker.submit("r", "k2", torch.zeros(4))
    tracker.flush()
    assert gated.entered.wait(5)
    rt.close()
    assert drain_saves(tracker, {"r"}) == {"r"}
    assert tracker.failures[Failure.STORE_ERROR] == 2 and tracker.requests_failed == 1
    assert_idle(tracker)


def rows(cache: torch.Tensor, order: list[int]) -> Pieces:
    """A step's values as lazy pieces: rows ``order`` of ``cache`` gathered once, one row per piece."""
    index = torch.tensor(order)
    return Pieces(
        Shared(lambda: cache.index_select(0, index)), 0, 1, len(order), (1, cache.shape[1]), cache.dtype
    )


def test_submit_many_is_submit_per_value_with_one_staging_buffer(
    runtime: Runtime, gated: GatedBackend, copy_thread: bool
) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    cache = torch.arange(40, dtype=torch.float32).reshape(10, 4)
    pieces = rows(cache, [5, 1, 3, 7, 2, 9])
    assert tracker.submit_many("r1", ["a", "b", "a", "c"], pieces.part(0, 4)) == 3  # "a" twice: once
    assert tracker.submit_many("r2", ["b", "d"], pieces.part(4, 2)) == 1  # "b" is in flight for r1
    assert tracker.submit_many("r3", [], pieces.part(6, 0)) == 0  # nothing: not even a request
    assert tracker.skipped == 2 and tracker.held()["requests"] == 2
    assert tracker.pending("r1") == 3 and tracker.pending("r2") == 1  # pending() hands them over
    if copy_thread:  # the step's four accepted values share one buffer: one pool acquire, not four
        assert tracker.pool.allocations == 1 and tracker.held()["buffers_out"] == 1
    else:  # synchronous snapshots: one per value, as submit does
        assert tracker.pool.allocations == 4
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}
    for key, row in (("a", 5), ("b", 1), ("c", 7), ("d", 9)):
        back = stored(runtime, store, key)
        assert back is not None and torch.equal(back, cache[row : row + 1])
    assert tracker.saved == 4 and tracker.saved_bytes == 4 * 16
    assert tracker.submit_many("r4", ["c", "a"], pieces.part(0, 2)) == 0  # saved recently
    assert tracker.poll() == {"r4"}  # nothing accepted: done at once
    assert_idle(tracker)
    with pytest.raises(TransferError, match="2 keys for 1 values"):
        tracker.submit_many("r5", ["x", "y"], pieces.part(0, 1))


@pytest.mark.parametrize("shape", [(3, 32), (5, 3)], ids=["packed", "padded"])
def test_submit_stacked_is_submit_per_row_with_one_snapshot(
    runtime: Runtime, gated: GatedBackend, copy_thread: bool, shape: tuple[int, int]
) -> None:
    """Rows of 192 bytes pack into the span with no padding (one copy per run of consecutive rows); rows of
    30 bytes are padded to 64 (one copy per row). Either way: the rows' bytes under their keys, duplicates
    skipped, one staging span for the call, and the stack may be rewritten as soon as the call returns."""
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    stacked = torch.randn(6, *shape).to(torch.float16)
    original = stacked.clone()
    assert tracker.submit("r0", "e", torch.zeros(1))  # in flight: its row is a duplicate
    items = [("r1", "a"), ("r1", "b"), ("r1", "a"), ("r2", "c"), ("r2", "e"), ("r2", "d")]
    assert tracker.submit_stacked(items, stacked) == [0, 1, 3, 5]
    assert tracker.submit_stacked([], stacked[:0]) == []
    assert tracker.skipped == 2 and tracker.pending("r1") == 2 and tracker.pending("r2") == 2
    if not copy_thread:  # the path taken: one span for the four rows (and one buffer for "e")
        assert tracker.pool.allocations == 2
        stacked.zero_()  # snapshotted inside the call (synchronous device)
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r0", "r1", "r2"}) == {"r0", "r1", "r2"}
    for key, row in (("a", 0), ("b", 1), ("c", 3), ("d", 5)):
        back = stored(runtime, store, key)
        assert back is not None and torch.equal(back, original[row]), key
    assert tracker.submit_stacked([("r3", "b")], original[:1]) == []  # saved recently
    assert tracker.poll() == {"r3"}
    assert_idle(tracker)
    with pytest.raises(TransferError, match="1 items for 2 values"):
        tracker.submit_stacked([("r4", "x")], original[:2])


def test_submit_stacked_goes_one_by_one_when_the_pool_cannot_give_the_span(
    runtime: Runtime, store: TensorStore
) -> None:
    tracker = make_tracker(store, runtime, capacity=4096)  # one row fits, the span of three does not
    stacked = torch.randn(3, 1000)
    assert tracker.submit_stacked([("r", "x"), ("r", "y"), ("r", "z")], stacked) == [0, 1, 2]
    assert drain_saves(tracker, {"r"}) == {"r"}
    for key, row in (("x", 0), ("y", 1), ("z", 2)):
        back = stored(runtime, store, key)
        assert back is not None and torch.equal(back, stacked[row])
    assert_idle(tracker)


def test_submit_many_takes_plain_tensors_too(runtime: Runtime, store: TensorStore) -> None:
    tracker = make_tracker(store, runtime)
    values = [torch.full((3,), 1.0), torch.full((5,), 2.0, dtype=torch.float16)]
    assert tracker.submit_many("r", ["t1", "t2"], values) == 2
    drain_saves(tracker, {"r"})
    for key, value in zip(("t1", "t2"), values, strict=True):
        back = stored(runtime, store, key)
        assert back is not None and same_bytes(back, value)
    assert_idle(tracker)


def test_submit_many_stages_one_by_one_when_the_pool_cannot_give_one_buffer(
    runtime: Runtime, gated: GatedBackend
) -> None:
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime, capacity=8192)  # two 4 KiB buffers; 3 x 4 KiB never fits whole
    cache = torch.arange(3 * 1024, dtype=torch.float32).reshape(3, 1024)
    assert tracker.submit_many("r", ["k0", "k1", "k2"], rows(cache, [0, 1, 2])) == 3
    tracker.flush()
    assert tracker.held()["queued"] == 1 and tracker.held()["buffers_out"] == 2
    assert tracker.submit_many("s", ["k3"], rows(cache, [2])) == 1  # behind the queue: queued too
    tracker.flush()
    assert tracker.held()["queued"] == 2
    runtime.call_soon(gated.gate.set)
    drain_saves(tracker, {"r", "s"})
    for i, row in enumerate((0, 1, 2, 2)):
        back = stored(runtime, store, f"k{i}")
        assert back is not None and torch.equal(back, cache[row : row + 1])
    assert tracker.saved == 4 and not tracker.failures
    assert_idle(tracker)


def test_submit_many_with_name_dedupes_by_identity_and_names_on_the_copy_thread(
    runtime: Runtime, store: TensorStore, copy_thread: bool
) -> None:
    tracker = make_tracker(store, runtime, capacity=8192)
    threads: set[str] = set()

    def name(ident: bytes) -> str:
        threads.add(threading.current_thread().name)
        return "kv:" + ident.hex()

    cache = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    idents = [b"\x01", b"\x02", b"\x01"]
    assert tracker.submit_many("r1", idents, rows(cache, [0, 1, 2]), name=name) == 2
    assert tracker.submit_many("r2", [b"\x02"], rows(cache, [3]), name=name) == 0  # in flight
    if copy_thread:  # nothing named on the caller's thread: the copy thread derives the store keys
        assert threads == set()
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}
    assert threads == {"asyncconn-save-copy"} if copy_thread else threads == {threading.current_thread().name}
    for key, row in (("kv:01", 0), ("kv:02", 1)):
        back = stored(runtime, store, key)
        assert back is not None and torch.equal(back, cache[row : row + 1])
    assert tracker.submit_many("r3", [b"\x01"], rows(cache, [0]), name=name) == 0  # saved recently
    assert tracker.poll() == {"r3"}
    # queued behind saves waiting for buffers: named and staged one by one, same identities
    big = torch.zeros(2, 1024)
    assert tracker.submit_many("r4", [b"\x10", b"\x11"], rows(big, [0, 1]), name=name) == 2
    tracker.flush()
    assert tracker.submit_many("r5", [b"\x12", b"\x10"], rows(big, [0, 1]), name=name) == 1
    drain_saves(tracker, {"r4", "r5"})
    assert stored(runtime, store, "kv:12") is not None and tracker.saved == 5
    assert_idle(tracker)


def test_the_copy_thread_frames_what_it_staged(
    runtime: Runtime, store: TensorStore, copy_thread: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a copy thread, each value's frame header (the checksum pass) is made on that thread right after
    the copy: the loop only writes (``put_frames``), and the stored frames read back exact. Without one, the
    loop encodes (``put``)."""
    framed_on: list[str] = []
    calls: list[str] = []
    encode = codec.encode_parts

    def spy_encode(tensor: torch.Tensor, *, key: str | bytes | None = None) -> tuple[bytes, memoryview]:
        framed_on.append(threading.current_thread().name)
        return encode(tensor, key=key)

    monkeypatch.setattr(codec, "encode_parts", spy_encode)
    for method in ("put", "put_frames"):
        original = getattr(store, method)

        async def spy(items: object, _original: object = original, _name: str = method) -> None:
            calls.append(_name)
            await _original(items)  # type: ignore[operator]

        monkeypatch.setattr(store, method, spy)
    tracker = make_tracker(store, runtime)
    values = {f"f{i}": torch.randn(64, 3) for i in range(5)}
    for key, value in values.items():
        assert tracker.submit("r", key, value)
    drain_saves(tracker, {"r"})
    for key, value in values.items():
        got = stored(runtime, store, key)
        assert got is not None and torch.equal(got, value)
    if copy_thread:
        assert calls == ["put_frames"] and framed_on[:5] == ["asyncconn-save-copy"] * 5
    else:
        assert calls == ["put", "put_frames"] and "asyncconn-save-copy" not in framed_on
    tracker.close()
    assert_idle(tracker)


def test_a_frame_stored_under_another_key_is_rejected(runtime: Runtime, store: TensorStore) -> None:
    """``put_frames`` trusts its caller to pair each header with its key; a mispaired one is not a silent
    wrong value: the key-bound checksum makes it a corrupt miss."""
    tensor = torch.arange(16, dtype=torch.float32)
    header, payload = codec.encode_parts(tensor, key="right")
    runtime.run(store.put_frames([("wrong", header, payload)]))
    assert stored(runtime, store, "wrong") is None and store.stats.corrupt == 1


def test_on_done_names_each_save_by_its_ident(runtime: Runtime, gated: GatedBackend) -> None:
    """``on_done`` reports every admitted save once, by ident, ok or not; ``submit_stacked`` rows given idents
    are known (and deduplicated) by them, whatever their keys (the KV adapter's value hashes)."""
    store = TensorStore(gated)
    tracker = make_tracker(store, runtime)
    done: list[tuple[object, bool]] = []
    tracker.on_done = lambda ident, ok: done.append((ident, ok))
    stacked = torch.randn(3, 8)
    items = [("r", "k-a"), ("r", "k-b"), ("r", "k-a2")]
    assert tracker.submit_stacked(items, stacked, [b"a", b"b", b"a"]) == [0, 1]  # b"a" twice: one save
    assert tracker.submit("q", "k-c", torch.ones(2), ident=b"c")
    assert not tracker.submit("q", "other-key", torch.ones(2), ident=b"b")  # in flight by ident
    # plain tensors with ``name``: one submit each, still known by the identity
    def hexed(ident: bytes) -> str:
        return "k-" + ident.hex()

    assert tracker.submit_many("p", [b"e", b"a"], [torch.ones(2), torch.ones(2)], name=hexed) == 1
    runtime.call_soon(gated.gate.set)
    assert drain_saves(tracker, {"r", "q", "p"}) == {"r", "q", "p"}
    assert sorted(done) == [(b"a", True), (b"b", True), (b"c", True), (b"e", True)]
    assert stored(runtime, store, "k-" + b"e".hex()) is not None
    back = stored(runtime, store, "k-b")
    assert back is not None and torch.equal(back, stacked[1])
    gated.fail_puts = True  # the store refuses: reported not ok
    done.clear()
    assert tracker.submit("s", "k-d", torch.ones(2), ident=b"d")
    assert drain_saves(tracker, {"s"}) == {"s"}
    assert done == [(b"d", False)]
    assert_idle(tracker)
