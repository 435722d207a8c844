"""StreamLoader's in-place loads from a store whose reads can be abandoned (``redis://``), with a real server.

What must hold on top of the page-cache kind (``test_loader_groups.py``): each value is a store call of its
own, in a call slot like a staged read (``max_inflight`` bounds them); a read hung on a stopped store is
stopped by ``interrupt`` -- its result comes at once, a failure, and nothing lands in the caller's memory
afterwards, even once the store answers again; every count comes back to zero.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from asyncconn import codec
from asyncconn.exceptions import TransferError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, RemoteScattered, StreamLoader
from tests.servers import RedisServer
from tests.transfer.helpers import drain_loads, wait_until

SHAPE = (2, 4, 256)  # 32 KiB of float32 per value, in pieces of 4 KiB (as a KV block's layers are)


def _pieces(rows: torch.Tensor) -> RemoteScattered:
    """The value's bytes spread over the rows of ``rows`` (one piece each, in order)."""
    return RemoteScattered(torch.float32, SHAPE, tuple(codec.tensor_bytes(row) for row in rows))


def _blank() -> torch.Tensor:
    return torch.zeros(SHAPE[0] * SHAPE[1], SHAPE[2])


@pytest.fixture
def stopped_redis(fresh_redis: RedisServer) -> Iterator[RedisServer]:
    yield fresh_redis
    fresh_redis.resume()


def _store(runtime: Runtime, server: RedisServer) -> TensorStore:
    # Both bounds far beyond the test: only an interrupt can end a read on a stopped server.
    url = f"{server.url}?timeout=60s&prefix=rip-{uuid.uuid4().hex[:8]}:"
    return runtime.run(TensorStore.open(url, timeout=60.0))


def test_redis_reads_in_place_value_by_value_and_lands_byte_for_byte(
    runtime: Runtime, redis_server: RedisServer
) -> None:
    store = _store(runtime, redis_server)
    values = {f"v{i}": torch.randn(SHAPE) for i in range(12)}
    runtime.run(store.put(values.items()))
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    rows = {k: _blank() for k in values}
    loader.submit_many((k, _pieces(rows[k])) for k in values)
    results = drain_loads(loader, len(values))
    assert all(r.ok and r.in_place for r in results.values())
    for key, want in values.items():
        assert torch.equal(rows[key].reshape(SHAPE), want), key
    assert loader.totals()["loaded_in_place"] == loader.totals()["reads_in_place"] == len(values)
    assert loader.pool.buffers_out == 0 and loader.pending() == 0
    runtime.run(store.close())


def test_a_store_whose_reads_cannot_be_stopped_refuses_them(runtime: Runtime, tmp_path: object) -> None:
    """``file://`` reads on threads: a read into the caller's memory there cannot be abandoned."""
    store = runtime.run(TensorStore.open(f"file://{tmp_path}/store"))
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    with pytest.raises(TransferError, match="stop when cancelled"):
        loader.submit("k", _pieces(_blank()))
    assert loader.pending() == 0
    runtime.run(store.close())


def test_in_place_reads_wait_for_a_call_slot_and_an_interrupt_stops_a_hung_one(
    runtime: Runtime, stopped_redis: RedisServer
) -> None:
    store = _store(runtime, stopped_redis)
    values = {f"v{i}": torch.randn(SHAPE) for i in range(5)}
    runtime.run(store.put(values.items()))
    loader = StreamLoader(
        store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20), max_inflight=2
    )
    rows = {k: _blank() for k in values}
    stopped_redis.pause()
    loader.submit_many((k, _pieces(rows[k])) for k in values)

    def reading() -> list[str]:
        now = time.monotonic()
        return [k for k in values if loader.fetching_for(k, now) > 0]

    wait_until(lambda: len(reading()) == 2, "two reads in their call slots")
    time.sleep(0.2)
    assert len(reading()) == 2  # the other three wait for a slot, not in a store call
    assert not loader.cancel("v0")  # a read may be writing the caller's memory: not dropped
    started = time.monotonic()
    for key in values:
        loader.interrupt(key)
    results = drain_loads(loader, len(values))
    assert time.monotonic() - started < 5  # the store's and the connection's bounds are 60 s
    assert all(r.failure is Failure.STORE_ERROR and not r.in_place for r in results.values())
    stopped_redis.resume()
    # The store answers again: nothing lands in the caller's memory any more.
    runtime.run(store.exists(list(values)))
    time.sleep(0.2)
    assert all(torch.equal(row, _blank()) for row in rows.values())
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    assert loader.pending() == 0
    # And the loader reads on: the same values land whole.
    loader.submit_many((k, _pieces(rows[k])) for k in values)
    again = drain_loads(loader, len(values))
    assert all(r.ok and r.in_place for r in again.values())
    assert all(torch.equal(rows[k].reshape(SHAPE), v) for k, v in values.items())
    runtime.run(store.close())
