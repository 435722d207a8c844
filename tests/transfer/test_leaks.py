"""10,000 mixed load/save cycles, then every buffer, event, future and loop task is counted back to zero."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from asyncconn_backends.memory import MemoryBackend

from asyncconn import codec
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, SaveTracker, StreamLoader, TensorSpec
from asyncconn.transfer.lazy import Pieces, Shared
from tests.transfer.helpers import SAVER_IDLE, wait_until

CYCLES = 10_000
BATCH = 100


async def _other_tasks() -> int:
    current = asyncio.current_task()
    return sum(1 for t in asyncio.all_tasks() if t is not current)


@pytest.mark.parametrize("copy_thread", [True, False], ids=["copy-thread", "sync"])
def test_ten_thousand_mixed_cycles_leave_nothing_behind(runtime: Runtime, copy_thread: bool) -> None:
    rng = random.Random(4)
    store = TensorStore(MemoryBackend(), timeout=5.0)
    values = {f"v{i}": torch.randn(8, 4) for i in range(8)}
    blocks = {f"kv{i}": torch.randn(2, 8, 4) for i in range(8)}
    runtime.run(store.put([*values.items(), *blocks.items()]))
    runtime.run(
        store.backend.put([("bad", b"\x00" * 40), ("bad-frame", codec.encode(torch.zeros(8, 4))[:-1])])
    )
    # One pool, small enough that back-pressure happens: both engines draw from it, as on a worker.
    pool = PinnedPool(16 * 4096, device=CpuDevice())
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=pool, max_inflight=32)
    tracker = SaveTracker(
        store, runtime=runtime, device=CpuDevice(), pool=pool, recent_keys=256, copy_thread=copy_thread
    )
    outcomes: dict[str, int] = {}
    reported: set[str] = set()
    submitted_requests: set[str] = set()

    def note(name: str) -> None:
        outcomes[name] = outcomes.get(name, 0) + 1

    def poll_loads() -> None:
        for result in loader.poll():
            if result.failure is Failure.CORRUPT:
                assert result.key in ("bad", "bad-frame"), result  # never a good value
            else:
                assert result.ok or result.failure is Failure.MISS, result

    def loads_drained() -> bool:
        # Both engines are polled, as a worker polls them every step: with one pool, a load can be queued
        # for a buffer that only the tracker's poll gives back (a finished put's staging).
        poll_loads()
        reported.update(tracker.poll())
        return loader.pending() == 0 and loader.futures_pending == 0

    def saves_drained() -> bool:
        reported.update(tracker.poll())
        return tracker.held()["requests"] == 0

    def load(key: str, dest: TensorSpec) -> None:
        if key in loader._loads:  # the same value asked for again while in flight: replace the load
            loader.cancel(key)
        loader.submit(key, dest)

    for start in range(0, CYCLES, BATCH):
        for i in range(start, start + BATCH):
            kind = rng.randrange(8)
            if kind == 0:
                loader.submit(f"abandoned{i}", TensorSpec((8, 4), torch.float32))
                loader.cancel(f"abandoned{i}")  # cancelled while queued or fetching
                note("cancel")
            elif kind == 1:
                loader.submit(f"absent{i}", TensorSpec((8, 4), torch.float32))
                note("miss")
            elif kind == 2:
                load(rng.choice(["bad", "bad-frame"]), TensorSpec((8, 4), torch.float32))
                note("corrupt")
            elif kind == 3:
                request = f"req{i}"
                submitted_requests.add(request)
                tracker.submit(request, f"save{i % 300}", torch.full((8, 4), float(i)))  # many duplicates
                note("save")
            elif kind == 4 and i % 2:
                request = f"req{i}"
                submitted_requests.add(request)
                tracker.submit(request, f"save{i}", torch.full((8, 4), float(i)))
                tracker.submit(request, f"save{i}-b", torch.full((2,), float(i)))
                note("save2")
            elif kind == 4:  # a step's values as lazy pieces of one gather, some of them duplicates
                request = f"req{i}"
                submitted_requests.add(request)
                block = torch.full((3, 8, 4), float(i))
                pieces = Pieces(Shared(block.clone), 0, 1, 3, (1, 8, 4), torch.float32)
                tracker.submit_many(request, [f"many{i}", f"save{i % 300}", f"many{i}-c"], pieces)
                note("save-many")
            elif kind == 5:
                load(f"v{i % 8}", TensorSpec((8, 4), torch.float32))
                note("hit")
            elif kind == 6:
                load(f"v{i % 8}", TensorSpec(max_nbytes=4096))
                note("hit-any")
            else:
                load(f"kv{i % 8}", TensorSpec((2, 8, 4), torch.float32))
                note("blocks")
            if i % 7 == 0:
                poll_loads()
                reported |= tracker.poll()
        # Drain the batch completely every few batches, the rest of the time let work overlap batches.
        if (start // BATCH) % 5 == 4:
            wait_until(loads_drained, "loads to drain")
            wait_until(saves_drained, "saves to drain")

    wait_until(loads_drained, "loads")
    wait_until(saves_drained, "saves")
    assert reported == submitted_requests
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    assert tracker.held() == SAVER_IDLE
    assert pool.buffers_out == 0 and pool.bytes_out == 0
    assert pool.bytes_reserved <= pool.capacity
    assert runtime.run(_other_tasks()) == 0
    assert len(tracker._recent) <= 256
    assert sum(outcomes.values()) == CYCLES
    assert loader.loaded > 0 and tracker.saved > 0 and loader.cancelled > 0 and tracker.skipped > 0
    assert loader.failures[Failure.MISS] > 0 and loader.failures[Failure.CORRUPT] > 0
    assert pool.refusals > 0  # back-pressure happened along the way
    loader.close()
    tracker.close()
    assert tracker.copy_thread is None or not tracker.copy_thread.alive
