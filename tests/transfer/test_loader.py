"""StreamLoader on the CPU device: new tensors, failures as values, cancel, back-pressure."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch
from asyncconn_backends.memory import MemoryBackend

from asyncconn import codec
from asyncconn.exceptions import ConfigError, DuplicateTransfer, TransferError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, StreamLoader, TensorSpec
from tests.transfer.fakes import GatedBackend
from tests.transfer.helpers import drain_loads, same_bytes, wait_until


def make_loader(store: TensorStore, runtime: Runtime, capacity: int = 1 << 22, **kw: int) -> StreamLoader:
    return StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(capacity), **kw)


def assert_idle(loader: StreamLoader) -> None:
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    assert loader.pool.buffers_out == 0
    assert loader.pending() == 0


# -- happy paths ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_load_into_new_tensor_with_declared_shape(
    runtime: Runtime, store: TensorStore, dtype: torch.dtype
) -> None:
    value = (torch.randn(17, 33) * 100).to(dtype)
    runtime.run(store.put([("emb", value)]))
    loader = make_loader(store, runtime)
    loader.submit("emb", TensorSpec(tuple(value.shape), dtype))
    (result,) = drain_loads(loader, 1).values()
    assert result.ok and result.failure is None
    assert result.tensor is not None and same_bytes(result.tensor, value)
    assert result.tensor.data_ptr() != 0
    assert loader.loaded == 1 and loader.loaded_bytes == value.numel() * value.element_size()
    assert_idle(loader)


def test_load_into_new_tensor_takes_dtype_and_shape_from_the_frame(
    runtime: Runtime, store: TensorStore
) -> None:
    value = torch.arange(24, dtype=torch.int16).reshape(2, 3, 4)
    runtime.run(store.put([("frame", value)]))
    loader = make_loader(store, runtime)
    loader.submit("frame", TensorSpec(max_nbytes=1024))
    (result,) = drain_loads(loader, 1).values()
    assert result.tensor is not None and same_bytes(result.tensor, value)
    assert_idle(loader)


def test_the_returned_tensor_does_not_alias_the_staging_buffer(runtime: Runtime, store: TensorStore) -> None:
    a, b = torch.full((64,), 1.0), torch.full((64,), 2.0)
    runtime.run(store.put([("a", a), ("b", b)]))
    loader = make_loader(store, runtime, capacity=4096)  # one buffer: b reuses a's staging memory
    loader.submit("a", TensorSpec((64,), torch.float32))
    first = drain_loads(loader, 1)["a"].tensor
    loader.submit("b", TensorSpec((64,), torch.float32))
    second = drain_loads(loader, 1)["b"].tensor
    assert first is not None and second is not None
    assert torch.equal(first, a) and torch.equal(second, b)
    assert loader.pool.allocations == 1


class _NoTensorSpecs(CpuDevice):
    """A host device that fails any load needing a tensor of its own (the staging copy ``consume`` skips)."""

    def empty(self, shape, dtype):  # type: ignore[no-untyped-def]
        raise AssertionError("a load handed to consume made a new tensor")


def test_consume_reads_the_staging_buffer_itself_and_gives_it_back_after_the_call(
    runtime: Runtime, store: TensorStore
) -> None:
    a, b = torch.full((64,), 1.0), torch.full((64,), 2.0)
    runtime.run(store.put([("a", a), ("b", b)]))
    loader = StreamLoader(store, runtime=runtime, device=_NoTensorSpecs(), pool=PinnedPool(1 << 16))
    loader.submit_many([("a", TensorSpec((64,), torch.float32)), ("b", TensorSpec((64,), torch.float32))])
    loader.submit("gone", TensorSpec((64,), torch.float32))
    seen: dict[str, object] = {}

    def consume(result) -> None:  # type: ignore[no-untyped-def]
        if result.tensor is None:
            seen[result.key] = result.failure
            return
        assert loader.pool.buffers_out >= 1  # lent: still out during the call
        seen[result.key] = result.tensor.clone()

    wait_until(lambda: loader.poll(consume) == [] and len(seen) == 3, "3 results")
    assert torch.equal(seen["a"], a) and torch.equal(seen["b"], b)  # type: ignore[arg-type]
    assert seen["gone"] is Failure.MISS
    assert loader.loaded == 2 and loader.loaded_bytes == 2 * 64 * 4
    assert_idle(loader)


def test_a_consumer_that_raises_still_gets_the_buffer_back(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("a", torch.ones(8))]))
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 16))
    loader.submit("a", TensorSpec((8,), torch.float32))

    def consume(result) -> None:  # type: ignore[no-untyped-def]
        raise RuntimeError("scatter failed")

    def step() -> bool:
        try:
            loader.poll(consume)
        except RuntimeError:
            return True
        return False

    wait_until(step, "the consumer's error")
    assert_idle(loader)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: TensorSpec((3,), None), "both"),
        (lambda: TensorSpec(), "max_nbytes"),
        (lambda: TensorSpec((-1,), torch.float32), "negative"),
    ],
)
def test_bad_destinations_are_refused_when_built(make: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()  # type: ignore[operator]


# -- failures come back as values ----------------------------------------------------------------------
def test_miss_is_a_failure_result(runtime: Runtime, store: TensorStore) -> None:
    loader = make_loader(store, runtime)
    loader.submit("absent", TensorSpec((4,), torch.float32))
    loader.submit("absent-any", TensorSpec(max_nbytes=64))
    results = drain_loads(loader, 2)
    assert {r.failure for r in results.values()} == {Failure.MISS}
    assert all(r.tensor is None for r in results.values())
    assert loader.failures[Failure.MISS] == 2
    assert_idle(loader)


def test_corrupt_value_is_a_failure_and_never_reaches_the_destination(
    runtime: Runtime, store: TensorStore
) -> None:
    good = torch.randn(8, 4)
    frame = bytearray(codec.encode(good, key="flipped"))
    frame[-1] ^= 0xFF  # flip a payload bit: checksum mismatch
    runtime.run(store.backend.put([("flipped", bytes(frame)), ("garbage", b"not a frame at all")]))
    runtime.run(store.put([("wrong-dtype", good.to(torch.float16))]))
    loader = make_loader(store, runtime)
    loader.submit("flipped", TensorSpec((8, 4), torch.float32))
    loader.submit("garbage", TensorSpec((8, 4), torch.float32))
    loader.submit("wrong-dtype", TensorSpec((8, 4), torch.float32))
    results = drain_loads(loader, 3)
    assert {k: r.failure for k, r in results.items()} == dict.fromkeys(results, Failure.CORRUPT)
    assert all(r.tensor is None for r in results.values())  # no corrupt payload is ever handed out
    assert store.stats.corrupt == 3
    assert_idle(loader)


@pytest.mark.parametrize("cancelled", [False, True], ids=["wanted", "cancelled-after-the-read"])
def test_every_damaged_value_a_fetch_finds_is_handed_to_on_corrupt(
    runtime: Runtime, store: TensorStore, cancelled: bool
) -> None:
    """Its owner deletes such values (savers skip keys the store has): a load cancelled once its read had
    found the damage must still report the key, or the value stays unreadable for good."""
    frame = bytearray(codec.encode(torch.randn(8, 4), key="flipped"))
    frame[-1] ^= 0xFF
    runtime.run(store.backend.put([("flipped", bytes(frame))]))
    runtime.run(store.put([("good", torch.randn(8, 4))]))
    seen: list[str] = []
    loader = make_loader(store, runtime)
    loader.on_corrupt = seen.append
    loader.submit_many([(k, TensorSpec((8, 4), torch.float32)) for k in ("flipped", "good", "absent")])
    deadline = time.monotonic() + 5
    while loader.futures_pending > len(loader._fetched) and time.monotonic() < deadline:
        loader.wait(0.1)  # every read has ended, none polled yet
    if cancelled:
        assert all(loader.cancel(k) for k in ("flipped", "good", "absent"))
        assert loader.poll() == []
    else:
        assert {r.key: r.failure for r in loader.poll()} == {
            "flipped": Failure.CORRUPT,
            "good": None,
            "absent": Failure.MISS,
        }
    assert seen == ["flipped"]
    assert_idle(loader)


def test_value_over_max_nbytes_is_too_large(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("big", torch.zeros(1024))]))
    loader = make_loader(store, runtime)
    loader.submit("big", TensorSpec(max_nbytes=100))
    assert drain_loads(loader, 1)["big"].failure is Failure.TOO_LARGE
    assert_idle(loader)


def test_value_larger_than_the_pool_is_too_large_not_queued_forever(
    runtime: Runtime, store: TensorStore
) -> None:
    loader = make_loader(store, runtime, capacity=8192)
    loader.submit("huge", TensorSpec((1 << 20,), torch.uint8))
    assert drain_loads(loader, 1)["huge"].failure is Failure.TOO_LARGE
    assert_idle(loader)


def test_store_timeout_is_a_timeout_failure(runtime: Runtime) -> None:
    slow = TensorStore(MemoryBackend(latency=5.0), timeout=0.05)
    loader = make_loader(slow, runtime)
    loader.submit("k", TensorSpec((4,), torch.float32))
    result = drain_loads(loader, 1)["k"]
    assert result.failure is Failure.TIMEOUT and "BackendTimeout" in result.detail
    assert_idle(loader)


def test_store_error_is_a_store_error_failure(runtime: Runtime) -> None:
    backend = MemoryBackend()
    closed = TensorStore(backend)
    runtime.run(closed.close())
    loader = make_loader(closed, runtime)
    loader.submit("k", TensorSpec((4,), torch.float32))
    result = drain_loads(loader, 1)["k"]
    assert result.failure is Failure.STORE_ERROR and "closed" in result.detail
    assert_idle(loader)


def test_closed_runtime_is_a_store_error_not_an_exception(store: TensorStore) -> None:
    rt = Runtime(name="closed").start()
    rt.close()
    loader = StreamLoader(store, runtime=rt, device=CpuDevice(), pool=PinnedPool(1 << 16))
    loader.submit("k", TensorSpec((4,), torch.float32))
    assert loader.poll()[0].failure is Failure.STORE_ERROR
    assert_idle(loader)


# -- misuse --------------------------------------------------------------------------------------------
def test_duplicate_key_in_flight_is_refused_until_cancelled(
    runtime: Runtime, gated_store: TensorStore
) -> None:
    loader = make_loader(gated_store, runtime)
    loader.submit("k", TensorSpec((4,), torch.float32))
    with pytest.raises(DuplicateTransfer):
        loader.submit("k", TensorSpec((4,), torch.float32))
    assert loader.cancel("k")
    loader.submit("k", TensorSpec((4,), torch.float32))  # a fresh load of the same key is fine now
    loader.close()
    assert_idle(loader)
    with pytest.raises(TransferError, match="closed"):
        loader.submit("k", TensorSpec((4,), torch.float32))


def test_a_destination_other_than_new_tensor_is_refused(runtime: Runtime, store: TensorStore) -> None:
    loader = make_loader(store, runtime)
    with pytest.raises(TransferError, match="TensorSpec"):
        loader.submit("k", torch.zeros(4, 2))  # type: ignore[arg-type]
    assert_idle(loader)


# -- cancellation --------------------------------------------------------------------------------------
def test_cancel_while_queued_releases_nothing_and_reports_nothing(
    runtime: Runtime, gated_store: TensorStore
) -> None:
    loader = make_loader(gated_store, runtime, capacity=4096)
    loader.submit("first", TensorSpec((1024,), torch.float32))  # takes the only buffer
    loader.submit("second", TensorSpec((1024,), torch.float32))  # queued behind it
    assert loader.held()["queued"] == 1
    assert loader.cancel("second")
    assert not loader.cancel("second")
    assert loader.held()["queued"] == 0
    loader.close()
    assert_idle(loader)


def test_cancel_mid_fetch_keeps_the_buffer_until_the_fetch_really_stopped(
    runtime: Runtime, gated: GatedBackend, gated_store: TensorStore
) -> None:
    gated.write_after_cancel = True  # the client keeps writing into the staging buffer after the cancel
    gated.data["k"] = codec.encode(torch.ones(1024), key="k")
    gated.data["other"] = codec.encode(torch.full((1024,), 7.0), key="other")
    loader = make_loader(gated_store, runtime, capacity=4096)  # exactly one staging buffer
    loader.submit("k", TensorSpec((1024,), torch.float32))
    assert gated.entered.wait(5)
    assert loader.cancel("k")
    assert gated.cancel_seen.wait(5)  # the task got the cancel ... but is still writing
    loader.submit("other", TensorSpec((1024,), torch.float32))
    for _ in range(20):
        assert loader.poll() == []
    # The buffer is still on loan to the cancelled fetch: the new load waits instead of sharing it.
    assert loader.held() == {"queued": 1, "buffers_out": 1, "events_out": 0, "futures_pending": 1}
    runtime.call_soon(gated.gate.set)
    results = drain_loads(loader, 1)
    assert gated.late_writes == 1
    assert list(results) == ["other"]  # nothing is reported for the cancelled key
    other = results["other"].tensor
    assert other is not None and torch.equal(other, torch.full((1024,), 7.0))  # no 0xEE bytes leaked in
    assert_idle(loader)
    assert loader.cancelled == 1


def test_cancel_before_the_fetch_task_starts(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("k", torch.ones(4))]))
    loader = make_loader(store, runtime)
    for i in range(200):  # some of these cancels land before the loop has started the task
        loader.submit("k", TensorSpec((4,), torch.float32))
        assert loader.cancel("k")
        if i % 50 == 0:
            loader.poll()
    wait_until(lambda: (loader.poll(), loader.held()["futures_pending"] == 0)[1], "cancelled fetches")
    assert loader.poll() == []
    assert_idle(loader)


def test_close_cancels_in_flight_loads_and_returns_buffers(
    runtime: Runtime, gated_store: TensorStore
) -> None:
    loader = make_loader(gated_store, runtime)
    for i in range(5):
        loader.submit(f"k{i}", TensorSpec((16,), torch.float32))
    assert loader.held()["futures_pending"] == 5
    loader.close()
    assert_idle(loader)
    loader.close()  # idempotent


# -- back-pressure -------------------------------------------------------------------------------------
def test_pool_exhaustion_queues_loads_in_order_then_all_complete(
    runtime: Runtime, gated: GatedBackend
) -> None:
    store = TensorStore(gated)
    values = {f"k{i}": torch.full((1024,), float(i)) for i in range(6)}
    gated.data.update({k: codec.encode(v, key=k) for k, v in values.items()})
    loader = make_loader(store, runtime, capacity=8192)  # two 4 KiB buffers for six loads
    for key in values:
        loader.submit(key, TensorSpec((1024,), torch.float32))
    assert loader.held() == {"queued": 4, "buffers_out": 2, "events_out": 0, "futures_pending": 2}
    assert loader.pool.refusals >= 1
    assert loader.pool.bytes_reserved <= 8192
    runtime.call_soon(gated.gate.set)
    results = drain_loads(loader, 6)
    assert sorted(results) == sorted(values)
    for key, value in values.items():
        tensor = results[key].tensor
        assert tensor is not None and torch.equal(tensor, value)
    assert loader.pool.allocations == 2  # steady state reuses the two buffers
    assert_idle(loader)


class _CountingBackend(GatedBackend):
    """A gated store that counts the reads running at once."""

    def __init__(self, *, gated: bool = True) -> None:
        super().__init__(gated=gated)
        self.active = self.peak = self.calls = 0

    async def get_into(self, key, dests, sink=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            return await super().get_into(key, dests, sink)
        finally:
            self.active -= 1


def test_max_inflight_bounds_store_calls_on_the_loop(runtime: Runtime) -> None:
    """Every load with a buffer is handed to the loop; only ``max_inflight`` of them are in the store at
    once, and the others wait for a call slot there (not in the worker's queue)."""
    backend = _CountingBackend()
    store = TensorStore(backend, timeout=5.0, name="counting")
    values = {f"k{i}": torch.full((4,), float(i)) for i in range(10)}
    backend.data.update({k: codec.encode(v, key=k) for k, v in values.items()})
    loader = make_loader(store, runtime, max_inflight=3)
    loader.submit_many((key, TensorSpec((4,), torch.float32)) for key in values)
    assert loader.held()["futures_pending"] == 10 and loader.held()["queued"] == 0
    wait_until(lambda: backend.calls == 3, "three store calls")
    time.sleep(0.05)
    assert backend.calls == 3  # the other seven wait for a slot
    now = time.monotonic()
    assert sum(loader.fetching_for(key, now) > 0 for key in values) == 3  # waiting for a slot reads 0
    runtime.call_soon(backend.gate.set)
    results = drain_loads(loader, 10)
    assert all(results[k].tensor is not None and torch.equal(results[k].tensor, v) for k, v in values.items())
    assert backend.peak == 3 and backend.calls == 10
    assert_idle(loader)


def test_queued_loads_start_when_a_slot_frees_without_a_poll(runtime: Runtime) -> None:
    """The loop starts the next load as soon as a store call ends: one ``wait`` (no ``poll``, as while vLLM's
    thread runs a long step) sees every load land, with one call slot."""
    backend = _CountingBackend(gated=False)
    store = TensorStore(backend, timeout=5.0, name="counting")
    values = {f"k{i}": torch.full((4,), float(i)) for i in range(5)}
    backend.data.update({k: codec.encode(v, key=k) for k, v in values.items()})
    loader = make_loader(store, runtime, max_inflight=1)
    before = loader.last_progress
    loader.submit_many((key, TensorSpec((4,), torch.float32)) for key in values)
    deadline = time.monotonic() + 10
    while loader.wait(0.5) is False or backend.calls < 5:
        assert time.monotonic() < deadline, "loads did not progress without a poll"
    assert len(loader.poll()) == 5
    assert backend.peak == 1
    assert loader.last_progress > before
    assert_idle(loader)


class _BrokenDevice(CpuDevice):
    """A device whose copies fail the way torch reports CUDA errors (RuntimeError, e.g. out of memory)."""

    def copy(self, pairs, *, after=None):  # type: ignore[no-untyped-def]
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")


def test_device_error_is_a_failure_and_frees_the_staging_buffer(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("k", torch.ones(4))]))
    loader = StreamLoader(store, runtime=runtime, device=_BrokenDevice(), pool=PinnedPool(1 << 16))
    loader.submit("k", TensorSpec((4,), torch.float32))
    result = drain_loads(loader, 1)["k"]
    assert result.failure is Failure.DEVICE_ERROR and "out of memory" in result.detail
    assert_idle(loader)


def test_submit_many_hands_a_whole_step_over_at_once(runtime: Runtime, store: TensorStore) -> None:
    values = {f"k{i}": torch.full((8,), float(i)) for i in range(10)}
    runtime.run(store.put(values.items()))
    loader = make_loader(store, runtime)
    loader.submit_many((key, TensorSpec((8,), torch.float32)) for key in values)
    results = drain_loads(loader, 10)
    for key, value in values.items():
        tensor = results[key].tensor
        assert tensor is not None and torch.equal(tensor, value)
    assert_idle(loader)


def test_submit_many_is_all_or_nothing(runtime: Runtime, store: TensorStore) -> None:
    loader = make_loader(store, runtime)
    with pytest.raises(DuplicateTransfer):
        loader.submit_many([("a", TensorSpec((1,), torch.float32)), ("a", TensorSpec((1,), torch.float32))])
    assert loader.pending() == 0
    assert_idle(loader)


def test_runtime_closing_mid_fetch_fails_the_loads_and_returns_buffers(
    gated: GatedBackend, gated_store: TensorStore
) -> None:
    rt = Runtime(name="closing").start()
    loader = StreamLoader(gated_store, runtime=rt, device=CpuDevice(), pool=PinnedPool(1 << 16))
    loader.submit_many((f"k{i}", TensorSpec((4,), torch.float32)) for i in range(3))
    assert gated.entered.wait(5)  # the fetches are running on the loop
    rt.close()  # cancels the batch task, which cancels and awaits its fetches
    results = drain_loads(loader, 3)
    assert {r.failure for r in results.values()} == {Failure.STORE_ERROR}
    assert all("cancelled" in r.detail for r in results.values())
    assert_idle(loader)


# -- waiting on an idle engine ---------------------------------------------------------------------------
def test_wait_returns_at_once_when_nothing_is_being_fetched(runtime: Runtime, store: TensorStore) -> None:
    loader = make_loader(store, runtime)
    started = time.monotonic()
    assert loader.wait(5.0) is False
    assert time.monotonic() - started < 0.5


def test_wait_returns_when_a_fetch_lands_not_at_its_timeout(
    runtime: Runtime, gated: GatedBackend, gated_store: TensorStore
) -> None:
    gated.data["k"] = codec.encode(torch.ones(16), key="k")
    loader = make_loader(gated_store, runtime)
    loader.submit("k", TensorSpec((16,), torch.float32))
    assert gated.entered.wait(5)
    assert loader.wait(0.05) is False  # still gated: the wait is bounded
    timer = threading.Timer(0.1, runtime.call_soon, (gated.gate.set,))
    timer.start()
    started = time.monotonic()
    assert loader.wait(10.0) is True
    assert time.monotonic() - started < 5.0
    (result,) = drain_loads(loader, 1).values()
    assert result.ok
    assert_idle(loader)


def test_each_load_lands_as_soon_as_its_read_ends(
    runtime: Runtime, store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reads that finish without suspending (a page-cached file:// value is read inline) land one by one,
    not all together after the batch's last read (as a task's done-callback would hand them back)."""
    values = {f"k{i}": torch.full((16,), float(i)) for i in range(4)}
    runtime.run(store.put(list(values.items())))
    loader = make_loader(store, runtime)
    handed_back = 0
    seen: list[int] = []
    hand_back = loader._hand_back
    get = store.backend.get

    def counting(load, fetched) -> None:  # type: ignore[no-untyped-def]
        nonlocal handed_back
        handed_back += 1
        hand_back(load, fetched)

    async def recording(keys):  # type: ignore[no-untyped-def]
        seen.append(handed_back)  # loads handed back when this read starts
        return await get(keys)

    monkeypatch.setattr(loader, "_hand_back", counting)
    monkeypatch.setattr(store.backend, "get", recording)
    loader.submit_many([(k, TensorSpec((16,), torch.float32)) for k in values])
    results = drain_loads(loader, 4)
    assert seen == [0, 1, 2, 3]
    assert all(torch.equal(results[k].tensor, v) for k, v in values.items())  # type: ignore[arg-type]
    assert_idle(loader)


def test_wait_for_several_landings_is_woken_by_the_last_of_them_only(
    runtime: Runtime, store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wait(landed=2)``: the first value landing does not wake the waiting thread (the loop does not set
    the event); the second does, once, and the wait returns with both to poll."""
    runtime.run(store.put([(k, torch.full((16,), float(i))) for i, k in enumerate("abc")]))
    gates = {k: asyncio.Event() for k in "abc"}
    get = store.backend.get

    async def gated(keys):  # type: ignore[no-untyped-def]
        for key in keys:
            await gates[key].wait()
        return await get(keys)

    monkeypatch.setattr(store.backend, "get", gated)
    loader = make_loader(store, runtime)
    wakes: list[float] = []

    class Counted(threading.Event):
        def set(self) -> None:
            wakes.append(time.monotonic())
            super().set()

    loader._landed = Counted()
    loader.submit_many([(k, TensorSpec((16,), torch.float32)) for k in "abc"])
    returned: list[bool] = []
    waiter = threading.Thread(target=lambda: returned.append(loader.wait(10.0, landed=2)))
    waiter.start()
    runtime.call_soon(gates["a"].set)
    wait_until(lambda: len(loader._fetched) == 1, "the first value to land")
    time.sleep(0.1)
    assert waiter.is_alive() and not wakes  # one landing of the two: nobody woken
    runtime.call_soon(gates["b"].set)
    waiter.join(5.0)
    assert returned == [True] and len(wakes) == 1
    assert sorted(r.key for r in loader.poll()) == ["a", "b"]
    runtime.call_soon(gates["c"].set)
    assert drain_loads(loader, 1)["c"].ok
    assert_idle(loader)


def test_wait_for_one_landing_returns_when_one_fetch_lands_while_others_are_still_read(
    runtime: Runtime, store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    runtime.run(store.put([("fast", torch.ones(16)), ("slow", torch.zeros(16))]))
    gate = asyncio.Event()
    get = store.backend.get

    async def gated(keys):  # type: ignore[no-untyped-def]
        if "slow" in keys:
            await gate.wait()
        return await get(keys)

    monkeypatch.setattr(store.backend, "get", gated)
    loader = make_loader(store, runtime)
    loader.submit_many(
        [("slow", TensorSpec((16,), torch.float32)), ("fast", TensorSpec((16,), torch.float32))]
    )
    started = time.monotonic()
    assert loader.wait(10.0, landed=1) is True
    assert time.monotonic() - started < 5.0
    assert [r.key for r in loader.poll()] == ["fast"]
    assert loader.wait(0.05, landed=1) is False  # the slow one is still gated: bounded
    runtime.call_soon(gate.set)
    assert drain_loads(loader, 1)["slow"].ok
    assert_idle(loader)
