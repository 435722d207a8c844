"""The save tracker's copy thread (CPU): lazy sources, failures inside a copy, close with copies pending,
waiting for the copies of preempted requests, and the thread's lifetime.

A lazy source that waits on a ``threading.Event`` holds a copy "in flight" for as long as the test wants,
which makes every ordering here deterministic (no sleeps, no timed assertions)."""

from __future__ import annotations

import gc
import os
import threading
import weakref
from collections.abc import Sequence

import pytest
import torch

from asyncconn.exceptions import TransferError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, SaveTracker, TransferDevice
from asyncconn.transfer._device import DONE, CopyPairs, Event
from asyncconn.transfer.copythread import CopyThread
from asyncconn.transfer.lazy import Pieces, Shared, Slice
from tests.transfer.fakes import GatedBackend
from tests.transfer.helpers import SAVER_IDLE, drain_saves, wait_until

IDLE = SAVER_IDLE


def make_tracker(store: TensorStore, runtime: Runtime, capacity: int = 1 << 20, **kw: object) -> SaveTracker:
    return SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(capacity), **kw)  # type: ignore[arg-type]


def stored(runtime: Runtime, store: TensorStore, key: str) -> torch.Tensor | None:
    return runtime.run(store.get([key]))[0]


def held_gather(
    source: torch.Tensor, gate: threading.Event, started: threading.Event | None = None
) -> Shared:
    """A shared gather that runs on the copy thread only once ``gate`` is set (then clones ``source``)."""

    def gather() -> torch.Tensor:
        if started is not None:
            started.set()
        assert gate.wait(10), "test gate never opened"
        return source.clone()

    return Shared(gather)


def slices(shared: Shared, rows: int, cols: int) -> list[Slice]:
    return [Slice(shared, 0, i, 1, (1, cols), torch.float32) for i in range(rows)]


def test_cpu_default_is_a_copy_thread_and_cuda_refuses_one(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = make_tracker(store, runtime)
    # Started with the tracker (engine start-up), not in the first step's flush: Thread.start waits for it.
    assert tracker.copy_thread is not None and tracker.copy_thread.alive
    assert make_tracker(store, runtime, copy_thread=False).copy_thread is None

    with pytest.raises(TransferError, match="copy_thread"):
        SaveTracker(store, runtime=runtime, device=_OtherDevice(), copy_thread=True)
    tracker.close()


class _OtherDevice(TransferDevice):
    """Stands for CUDA: any device that is not the CPU one (never asked to copy here). It cannot subclass
    ``CpuDevice``: the tracker recognises the CPU by that class."""

    device = torch.device("cpu")

    @property
    def pinned(self) -> bool:
        return True

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype)

    def mark(self) -> Event:
        return DONE

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        raise AssertionError("not used")

    def hand_over(self, tensor: torch.Tensor) -> None:
        return None


def test_lazy_slices_are_gathered_once_on_the_copy_thread(runtime: Runtime) -> None:
    backend = GatedBackend(gated=False)
    store = TensorStore(backend)
    tracker = make_tracker(store, runtime)
    cache = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    threads: list[str] = []

    def gather() -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return cache.index_select(0, torch.tensor([5, 1, 3]))

    shared = Shared(gather)
    for i, value in enumerate(slices(shared, 3, 4)):
        assert tracker.submit("r", f"k{i}", value)
    assert threads == []  # submit never evaluates a lazy source when there is a copy thread
    tracker.flush()
    drain_saves(tracker, {"r"})
    assert threads == ["asyncconn-save-copy"]  # once, for the three slices, on the copy thread
    for i, row in enumerate((5, 1, 3)):
        back = stored(runtime, store, f"k{i}")
        assert back is not None and torch.equal(back, cache[row : row + 1])
    assert tracker.held() == IDLE
    tracker.close()


class _FailingCopies(CpuDevice):
    """A device whose copies into staging fail for tensors holding a negative first value."""

    def copy(self, pairs, *, after=None):  # type: ignore[no-untyped-def]
        for _, src in pairs:
            if src.flatten()[0] < 0:
                raise RuntimeError("device lost")
        return super().copy(pairs, after=after)


def test_a_failure_inside_a_copy_fails_that_save_only(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = SaveTracker(store, runtime=runtime, device=_FailingCopies(), pool=PinnedPool(1 << 20))
    tracker.submit("r1", "good", torch.ones(4))
    tracker.submit("r1", "bad", -torch.ones(4))  # the device refuses this copy

    def broken() -> torch.Tensor:
        raise ValueError("gather failed")

    tracker.submit("r2", "lazy-bad", Slice(Shared(broken), 0, 0, 1, (1, 4), torch.float32))
    tracker.flush()
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}  # reported, not hung
    assert tracker.failures[Failure.DEVICE_ERROR] == 2 and tracker.saved == 1
    assert tracker.requests_failed == 2
    assert stored(runtime, store, "good") is not None and stored(runtime, store, "bad") is None
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    tracker.close()


def test_wait_snapshots_waits_for_the_pending_copy_of_a_preempted_request(runtime: Runtime) -> None:
    backend = GatedBackend(gated=True)  # puts hang: waiting for the snapshot must not wait for the store
    store = TensorStore(backend)
    tracker = make_tracker(store, runtime, capacity=8192)  # two 4 KiB buffers
    tracker.submit("other", "o1", torch.zeros(1024))
    tracker.submit("other", "o2", torch.zeros(1024))  # the pool is now empty
    gate, started = threading.Event(), threading.Event()
    blocks = torch.full((2, 1024), 7.0)
    for i, value in enumerate(slices(held_gather(blocks, gate, started), 2, 1024)):
        tracker.submit("preempted", f"k{i}", value)  # no buffer: queued, yet gathered by the step's job
    assert tracker.held()["queued"] == 2
    assert not tracker.wait_snapshots(["preempted"], timeout=0.0)  # posts the job; the gather is held
    assert started.wait(5)
    assert not tracker.wait_snapshots(["preempted"], timeout=0.01)
    gate.set()
    assert tracker.wait_snapshots(["preempted"], timeout=5.0)
    blocks.fill_(-1.0)  # vLLM reuses the preempted request's blocks right after
    assert backend.entered.wait(5) and tracker.pending("preempted") == 2  # no buffer yet: puts hang
    runtime.call_soon(backend.gate.set)
    drain_saves(tracker, {"preempted", "other"})
    for i in range(2):  # copied into staging later, from the gather taken before the blocks were reused
        back = stored(runtime, store, f"k{i}")
        assert back is not None and torch.equal(back, torch.full((1, 1024), 7.0))
    assert tracker.held() == IDLE
    tracker.close()


def test_close_lets_pending_copies_finish_then_joins_the_thread(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = make_tracker(store, runtime)
    gate = threading.Event()
    tracker.submit("r1", "k1", slices(held_gather(torch.ones(1, 4), gate), 1, 4)[0])
    tracker.flush()
    tracker.submit("r2", "k2", torch.full((4,), 2.0))
    tracker.flush()  # a second job, queued behind the held one
    assert tracker.held()["copy_jobs"] == 2
    threading.Timer(0.05, gate.set).start()  # released while close() is waiting
    tracker.close(timeout=5.0)
    assert tracker.copy_thread is not None and not tracker.copy_thread.alive
    assert tracker.saved == 2 and not tracker.failures
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    with pytest.raises(TransferError, match="closed"):
        tracker.submit("r3", "k3", torch.zeros(1))


def test_close_with_hung_puts_cancels_them_returns_buffers_and_joins(runtime: Runtime) -> None:
    backend = GatedBackend(gated=True)
    tracker = make_tracker(TensorStore(backend), runtime, capacity=4096)
    tracker.submit("r1", "k1", torch.zeros(1024))
    tracker.submit("r2", "k2", torch.zeros(1024))  # queued: the only buffer is taken
    tracker.flush()
    assert backend.entered.wait(5)
    tracker.close(timeout=0.05)
    assert tracker.failures[Failure.STORE_ERROR] == 2
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    assert tracker.copy_thread is not None and not tracker.copy_thread.alive
    runtime.call_soon(backend.gate.set)


def test_copy_thread_stops_when_closed_or_dropped() -> None:
    ct = CopyThread("asyncconn-test-copy")
    ran = threading.Event()
    ct.post(ran.set)
    assert ran.wait(5) and ct.alive
    assert ct.close(timeout=5) and not ct.alive
    with pytest.raises(TransferError, match="closed"):
        ct.post(ran.set)

    dropped = CopyThread("asyncconn-test-dropped")
    dropped.post(lambda: None)
    thread = dropped._thread
    assert thread is not None
    ref = weakref.ref(dropped)
    del dropped
    gc.collect()
    assert ref() is None
    thread.join(5)  # the finalizer posted the stop marker
    assert not thread.is_alive()


def test_the_copy_thread_runs_as_a_batch_thread_so_its_wake_ups_do_not_preempt_the_poster() -> None:
    """Linux, where vLLM and this library run (elsewhere the policy is simply not set)."""
    ct = CopyThread("asyncconn-test-batch")
    ct.start()
    assert ct._thread is not None and ct._thread.native_id is not None
    seen = threading.Event()
    ct.post(seen.set)  # the policy is set before the first job runs
    assert seen.wait(5)
    assert os.sched_getscheduler(ct._thread.native_id) == os.SCHED_BATCH
    assert os.sched_getscheduler(0) != os.SCHED_BATCH  # the poster's own policy is untouched
    assert ct.close(5)


def test_a_raising_job_does_not_stop_later_jobs(caplog: pytest.LogCaptureFixture) -> None:
    ct = CopyThread("asyncconn-test-raise")
    ran = threading.Event()

    def bad() -> None:
        raise RuntimeError("bug in a job")

    ct.post(bad)
    ct.post(ran.set)
    assert ran.wait(5)
    assert ct.close(5)
    assert "copy job failed" in caplog.text


def test_the_thread_runs_from_the_trackers_start_until_close(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = make_tracker(store, runtime)
    tracker.submit("r", "k", torch.ones(4))
    tracker.flush()
    wait_until(lambda: bool(tracker.poll()), "the save")
    assert tracker.copy_thread is not None and tracker.copy_thread.alive
    names = {t.name for t in threading.enumerate()}
    assert "asyncconn-save-copy" in names
    tracker.close()
    assert not tracker.copy_thread.alive


def test_pieces_are_equal_slices_of_one_gather() -> None:
    calls: list[int] = []
    base = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)

    def gather() -> torch.Tensor:
        calls.append(1)
        return base

    pieces = Pieces(Shared(gather), 1, 2, 3, (2, 2, 3), torch.float32)
    part = pieces.part(1, 2)
    assert len(pieces) == 3 and len(part) == 2 and pieces.nbytes == 2 * 2 * 3 * 4
    assert torch.equal(part.tensor(1), base[:, 4:6])
    assert torch.equal(part[0](), base[:, 2:4]) and torch.equal(part[-1](), base[:, 4:6])  # as Slices
    assert [torch.equal(s(), base[:, 2 * i : 2 * i + 2]) for i, s in enumerate(pieces[0:3])] == [True] * 3
    assert calls == [1]  # one gather for every piece
    with pytest.raises(IndexError):
        part[2]
    with pytest.raises(ValueError):
        pieces.part(2, 2)
    wrong = Pieces(Shared(gather), 1, 2, 3, (2, 2, 4), torch.float32)
    with pytest.raises(RuntimeError, match="promised"):
        wrong.tensor(0)


def test_submit_many_makes_no_save_and_gathers_nothing_on_the_callers_thread(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = make_tracker(store, runtime)
    threads: list[str] = []
    cache = torch.arange(12, dtype=torch.float32).reshape(3, 4)

    def gather() -> torch.Tensor:
        threads.append(threading.current_thread().name)
        return cache.clone()

    assert tracker.submit_many(
        "r", ["k0", "k1", "k2"], Pieces(Shared(gather), 0, 1, 3, (1, 4), torch.float32)
    )
    tracker.flush()
    assert threads == [] or threads == ["asyncconn-save-copy"]
    drain_saves(tracker, {"r"})
    assert threads == ["asyncconn-save-copy"]
    for i in range(3):
        back = stored(runtime, store, f"k{i}")
        assert back is not None and torch.equal(back, cache[i : i + 1])
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    tracker.close()


class _ThreadRecordingDevice(CpuDevice):
    """A CPU device that notes which thread allocates each staging buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated_on: list[str] = []

    def alloc_host(self, nbytes: int) -> torch.Tensor:
        self.allocated_on.append(threading.current_thread().name)
        return super().alloc_host(nbytes)


def test_the_steps_staging_span_is_allocated_by_the_copy_thread(runtime: Runtime) -> None:
    """A fresh span (no idle buffer fits) costs vLLM's thread no allocation; the copy thread makes it."""
    store = TensorStore(GatedBackend(gated=False))
    device = _ThreadRecordingDevice()
    tracker = SaveTracker(store, runtime=runtime, device=device, pool=PinnedPool(1 << 20, device=device))
    cache = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tracker.submit_many(
        "r", ["k0", "k1", "k2"], Pieces(Shared(cache.clone), 0, 1, 3, (1, 4), torch.float32)
    )
    tracker.flush()
    drain_saves(tracker, {"r"})
    assert device.allocated_on == ["asyncconn-save-copy"]
    for i in range(3):
        back = stored(runtime, store, f"k{i}")
        assert back is not None and torch.equal(back, cache[i : i + 1])
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    tracker.close()


def test_a_failing_gather_fails_every_piece_and_returns_the_shared_buffer(runtime: Runtime) -> None:
    store = TensorStore(GatedBackend(gated=False))
    tracker = make_tracker(store, runtime)

    def broken() -> torch.Tensor:
        raise ValueError("gather failed")

    assert tracker.submit_many("r1", ["a", "b"], Pieces(Shared(broken), 0, 1, 2, (1, 4), torch.float32)) == 2
    assert tracker.submit_many("r2", ["c"], slices_of(torch.ones(1, 4))) == 1  # same step, a good gather
    tracker.flush()
    assert drain_saves(tracker, {"r1", "r2"}) == {"r1", "r2"}
    assert tracker.failures[Failure.DEVICE_ERROR] == 2 and tracker.saved == 1 and tracker.requests_failed == 1
    assert stored(runtime, store, "c") is not None and stored(runtime, store, "a") is None
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    # failed keys are not remembered: a later step saves them
    assert tracker.submit_many("r3", ["a"], slices_of(torch.ones(1, 4))) == 1
    drain_saves(tracker, {"r3"})
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    tracker.close()


def slices_of(value: torch.Tensor) -> Pieces:
    return Pieces(Shared(value.clone), 0, 1, value.shape[0], (1, *value.shape[1:]), value.dtype)


def test_wait_snapshots_covers_submit_many_and_close_joins(runtime: Runtime) -> None:
    backend = GatedBackend(gated=True)  # puts hang: waiting for the snapshot must not wait for the store
    store = TensorStore(backend)
    tracker = make_tracker(store, runtime)
    gate, started = threading.Event(), threading.Event()
    blocks = torch.full((2, 1024), 7.0)
    pieces = Pieces(held_gather(blocks, gate, started), 0, 1, 2, (1, 1024), torch.float32)
    assert tracker.submit_many("preempted", ["k0", "k1"], pieces) == 2
    assert not tracker.wait_snapshots(["preempted"], timeout=0.0)  # posts the job; the gather is held
    assert started.wait(5)
    assert tracker.wait_snapshots(["other"], timeout=0.0)  # only the preempted request's copies count
    gate.set()
    assert tracker.wait_snapshots(["preempted"], timeout=5.0)
    blocks.fill_(-1.0)  # vLLM reuses the preempted request's blocks right after
    assert backend.entered.wait(5) and tracker.pending("preempted") == 2
    tracker.close(timeout=0.05)  # the puts hang: cancelled, the shared buffer returned
    assert tracker.failures[Failure.STORE_ERROR] == 2
    assert tracker.held() == IDLE and tracker.pool.buffers_out == 0
    runtime.call_soon(backend.gate.set)
