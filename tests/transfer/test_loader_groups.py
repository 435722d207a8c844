"""StreamLoader over a store that reads batches in one call (``TensorStore.batch_reads``, e.g. ``file://``).

Loads of a known shape are read in groups of about ``GROUP_BYTES``, one store call each. What must hold on top
of the per-value path: each value of a group lands byte for byte; a bad value fails only itself; a store
error fails only its group; a cancelled load of a group keeps its buffer until the group's read has ended,
and nothing is reported for it; every count comes back to zero.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from asyncconn import codec
from asyncconn.exceptions import InvalidInput, TransferError
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, Failure, PinnedPool, Scattered, StreamLoader, TensorSpec
from asyncconn.transfer import in_place as in_place_module
from asyncconn.transfer import loader as loader_module
from tests.transfer.fakes import GatedBatchBackend
from tests.transfer.helpers import drain_loads, wait_until

SHAPE = (256,)  # 1 KiB of float32 per value
VALUE_BYTES = 1024


def make_loader(store: TensorStore, runtime: Runtime, capacity: int = 1 << 20) -> StreamLoader:
    return StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(capacity))


def assert_idle(loader: StreamLoader) -> None:
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    assert loader.pool.buffers_out == 0 and loader.pending() == 0


def value(i: int) -> torch.Tensor:
    return torch.full(SHAPE, float(i))


@pytest.fixture
def three_per_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """Groups of three 1 KiB values (staging buffers are 4 KiB: the pool's smallest class is a page)."""
    monkeypatch.setattr(loader_module, "GROUP_BYTES", 3 * VALUE_BYTES)


@pytest.fixture
def batch(runtime: Runtime) -> Iterator[GatedBatchBackend]:
    backend = GatedBatchBackend()
    for i in range(10):
        backend.data[f"k{i}"] = codec.encode(value(i), key=f"k{i}")
    yield backend
    runtime.call_soon(backend.gate.set)


def test_a_step_is_read_in_groups_each_value_landing_whole(
    runtime: Runtime, batch: GatedBatchBackend, three_per_group: None
) -> None:
    runtime.call_soon(batch.gate.set)
    loader = make_loader(TensorStore(batch, name="batch"), runtime)
    loader.submit_many((f"k{i}", TensorSpec(SHAPE, torch.float32)) for i in range(10))
    results = drain_loads(loader, 10)
    assert batch.batches == [["k0", "k1", "k2"], ["k3", "k4", "k5"], ["k6", "k7", "k8"], ["k9"]]
    for i in range(10):
        got = results[f"k{i}"].tensor
        assert got is not None and torch.equal(got, value(i)), i
    assert_idle(loader)


def test_loads_without_a_shape_are_read_one_by_one(runtime: Runtime, batch: GatedBatchBackend) -> None:
    runtime.call_soon(batch.gate.set)
    loader = make_loader(TensorStore(batch, name="batch"), runtime)
    loader.submit_many([("k1", TensorSpec(max_nbytes=4096)), ("k2", TensorSpec(SHAPE, torch.float32))])
    results = drain_loads(loader, 2)
    assert batch.batches == [["k2"]]  # k1's size is only known from its frame: the per-value path
    assert all(r.ok for r in results.values())
    assert_idle(loader)


def test_a_store_error_fails_its_group_only(
    runtime: Runtime, batch: GatedBatchBackend, three_per_group: None
) -> None:
    batch.fail_keys = {"k4"}
    runtime.call_soon(batch.gate.set)
    loader = make_loader(TensorStore(batch, name="batch"), runtime)
    loader.submit_many((f"k{i}", TensorSpec(SHAPE, torch.float32)) for i in range(9))
    results = drain_loads(loader, 9)
    failed = {k for k, r in results.items() if not r.ok}
    assert failed == {"k3", "k4", "k5"}
    assert {results[k].failure for k in failed} == {Failure.STORE_ERROR}
    assert all(torch.equal(results[f"k{i}"].tensor, value(i)) for i in (0, 1, 2, 6, 7, 8))  # type: ignore[arg-type]
    assert_idle(loader)


def test_a_cancelled_load_keeps_its_buffer_until_its_group_has_landed(
    runtime: Runtime, batch: GatedBatchBackend, three_per_group: None
) -> None:
    loader = make_loader(TensorStore(batch, name="batch"), runtime)
    loader.submit_many((f"k{i}", TensorSpec(SHAPE, torch.float32)) for i in range(3))
    assert batch.entered.wait(5)
    assert loader.cancel("k1")
    for _ in range(20):
        assert loader.poll() == []
    # The group's read may still write k1's buffer: it stays on loan.
    assert loader.held()["buffers_out"] == 3 and loader.held()["futures_pending"] == 3
    assert not batch.cancel_seen.is_set()  # the others' read goes on
    runtime.call_soon(batch.gate.set)
    results = drain_loads(loader, 2)
    wait_until(lambda: (loader.poll(), loader.held()["futures_pending"] == 0)[1], "the cancelled load")
    assert sorted(results) == ["k0", "k2"]  # nothing is reported for k1
    assert loader.cancelled == 1
    assert_idle(loader)


def test_runtime_closing_mid_group_fails_its_loads_and_returns_buffers(
    batch: GatedBatchBackend, three_per_group: None
) -> None:
    rt = Runtime(name="closing").start()
    loader = make_loader(TensorStore(batch, name="batch"), rt)
    loader.submit_many((f"k{i}", TensorSpec(SHAPE, torch.float32)) for i in range(5))
    assert batch.entered.wait(5)
    rt.close()
    results = drain_loads(loader, 5)
    assert {r.failure for r in results.values()} == {Failure.STORE_ERROR}
    assert all("cancelled" in r.detail for r in results.values())
    assert_idle(loader)


# -- on a real file:// store -----------------------------------------------------------------------------
@pytest.fixture
def file_store(runtime: Runtime, tmp_path: Path) -> Iterator[TensorStore]:
    store = runtime.run(TensorStore.open(f"file://{tmp_path}/store"))
    assert store.batch_reads
    yield store
    runtime.run(store.close())


def test_file_store_loads_a_prefix_in_groups_and_a_bad_value_fails_alone(
    runtime: Runtime, file_store: TensorStore
) -> None:
    shape = (14, 2, 32, 64)  # 229 KiB: a few per default group
    values = {f"v{i}": torch.randn(shape) for i in range(40)}
    runtime.run(file_store.put(values.items()))
    backend = file_store.backend
    bad = backend.path_for("v17")  # type: ignore[attr-defined]
    with open(bad, "r+b") as f:  # one flipped payload byte: the frame's checksum fails
        f.seek(os.path.getsize(bad) - 100)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.unlink(backend.path_for("v30"))  # type: ignore[attr-defined]
    loader = make_loader(file_store, runtime, capacity=64 << 20)
    loader.submit_many((k, TensorSpec(shape, torch.float32)) for k in values)
    results = drain_loads(loader, len(values))
    assert results["v17"].failure is Failure.CORRUPT
    assert results["v30"].failure is Failure.MISS
    for key, expected in values.items():
        if key not in ("v17", "v30"):
            got = results[key].tensor
            assert got is not None and torch.equal(got, expected), key
    assert file_store.stats.corrupt == 1 and file_store.stats.hits == 38
    assert_idle(loader)


# -- in place (Scattered): straight into the caller's host memory -------------------------------------------
def _in_place(rows: list[torch.Tensor], shape: tuple[int, ...]) -> Scattered:
    return Scattered(torch.float32, shape, tuple(codec.tensor_bytes(r) for r in rows))


def test_in_place_loads_land_in_the_callers_memory_and_a_bad_value_fails_alone(
    runtime: Runtime, file_store: TensorStore
) -> None:
    """Each value's bytes land across its pieces (no staging buffer taken); a corrupt value is CORRUPT and a
    missing one a MISS; the pieces of the others hold exactly the stored values."""
    shape = (14, 2, 1024)
    values = {f"p{i}": torch.randn(shape) for i in range(12)}
    runtime.run(file_store.put(values.items()))
    backend = file_store.backend
    bad = backend.path_for("p5")  # type: ignore[attr-defined]
    with open(bad, "r+b") as f:
        f.seek(os.path.getsize(bad) - 10)
        f.write(b"\xff\xfe")
    os.unlink(backend.path_for("p9"))  # type: ignore[attr-defined]
    loader = make_loader(file_store, runtime)
    rows = {k: [torch.empty(2, 1024) for _ in range(14)] for k in values}
    loader.submit_many((k, _in_place(rows[k], shape)) for k in values)
    assert loader.held()["buffers_out"] == 0  # nothing staged
    results = drain_loads(loader, len(values))
    assert results["p5"].failure is Failure.CORRUPT and results["p9"].failure is Failure.MISS
    for key, expected in values.items():
        if key in ("p5", "p9"):
            continue
        assert results[key].ok and results[key].in_place and results[key].tensor is None, key
        assert torch.equal(torch.stack(rows[key]), expected), key
    assert_idle(loader)


def test_a_batch_of_in_place_loads_is_read_in_as_few_even_groups_as_the_bound_allows(
    runtime: Runtime, file_store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """10 KiB of in-place loads under a 4 KiB bound: three store calls of 4, 4 and 2 values (not 4, 4, 1 and
    an empty one); under the default bound, one call. Each call's values land whole."""
    values = {f"g{i}": value(i) for i in range(10)}
    runtime.run(file_store.put(values.items()))
    calls: list[list[str]] = []
    real = type(file_store.backend)._read_many

    def recording(self: object, reads: list[tuple[str, object, object]], cached_only: bool = False) -> object:
        calls.append([key for key, _, _ in reads])
        return real(self, reads, cached_only)  # type: ignore[arg-type]

    monkeypatch.setattr(type(file_store.backend), "_read_many", recording)
    for bound, sizes in ((4 * VALUE_BYTES, [4, 4, 2]), (in_place_module.IN_PLACE_GROUP_BYTES, [10])):
        monkeypatch.setattr(in_place_module, "IN_PLACE_GROUP_BYTES", bound)
        calls.clear()
        loader = make_loader(file_store, runtime)
        rows = {k: [torch.zeros(SHAPE)] for k in values}
        loader.submit_many((k, _in_place(rows[k], SHAPE)) for k in values)
        results = drain_loads(loader, len(values))
        assert sorted(len(c) for c in calls) == sorted(sizes)
        assert all(r.in_place for r in results.values())
        assert all(torch.equal(rows[k][0], v) for k, v in values.items())
        assert_idle(loader)


def test_an_in_place_load_the_store_cannot_serve_from_memory_is_not_cached(
    runtime: Runtime, batch: GatedBatchBackend
) -> None:
    """A store without ``cached_reads`` serves no in-place read: NOT_CACHED, for the caller to load another
    way, and nothing written."""
    runtime.call_soon(batch.gate.set)
    loader = make_loader(TensorStore(batch, name="batch"), runtime)
    rows = [torch.zeros(SHAPE)]
    loader.submit("k1", _in_place(rows, SHAPE))
    result = drain_loads(loader, 1)["k1"]
    assert result.failure is Failure.NOT_CACHED and not result.in_place
    assert torch.equal(rows[0], torch.zeros(SHAPE))
    assert_idle(loader)


def test_an_in_place_load_being_read_cannot_be_cancelled(
    runtime: Runtime, file_store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its read may still write the caller's memory: cancel refuses, and the result comes as usual, which is
    how the caller learns that nothing writes any more. One still queued (behind a staged load waiting for
    a staging buffer; in-place loads themselves take none) is dropped: nothing was written."""
    runtime.run(file_store.put([("a", value(1)), ("s", value(2)), ("t", value(4)), ("b", value(3))]))
    started = threading.Event()
    release = threading.Event()
    real = type(file_store.backend)._read_many

    def slow(self: object, reads: object, cached_only: bool = False) -> object:
        started.set()
        assert release.wait(10)
        return real(self, reads, cached_only)  # type: ignore[arg-type]

    monkeypatch.setattr(type(file_store.backend), "_read_many", slow)
    loader = StreamLoader(  # one 4 KiB staging buffer: "t" waits for the one "s" holds
        file_store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(4096)
    )
    rows = {k: [torch.zeros(SHAPE)] for k in "ab"}
    loader.submit_many(
        [
            ("a", _in_place(rows["a"], SHAPE)),
            ("s", TensorSpec(SHAPE, torch.float32)),
            ("t", TensorSpec(SHAPE, torch.float32)),
            ("b", _in_place(rows["b"], SHAPE)),
        ]
    )
    assert started.wait(5)
    assert loader.held()["queued"] == 2  # "t" waits for a buffer, "b" behind it
    assert not loader.cancel("a")  # being read
    assert loader.cancel("b")  # still queued: dropped
    release.set()
    results = drain_loads(loader, 3)
    assert results["a"].in_place and torch.equal(rows["a"][0], value(1))
    assert results["s"].tensor is not None and torch.equal(results["s"].tensor, value(2))
    assert results["t"].tensor is not None and torch.equal(results["t"].tensor, value(4))
    assert torch.equal(rows["b"][0], torch.zeros(SHAPE))
    assert_idle(loader)


def test_in_place_loads_are_not_held_back_by_max_inflight(runtime: Runtime, file_store: TensorStore) -> None:
    runtime.run(file_store.put([(f"i{n}", value(n)) for n in range(6)]))
    loader = StreamLoader(
        file_store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20), max_inflight=2
    )
    rows = {n: [torch.zeros(SHAPE)] for n in range(6)}
    loader.submit_many((f"i{n}", _in_place(rows[n], SHAPE)) for n in range(6))
    assert loader.held()["queued"] == 0
    results = drain_loads(loader, 6)
    assert all(r.in_place for r in results.values())
    assert all(torch.equal(rows[n][0], value(n)) for n in range(6))
    assert_idle(loader)


def test_in_place_needs_a_host_device(runtime: Runtime, file_store: TensorStore) -> None:
    class NotHost(CpuDevice):
        synchronous = False

    loader = StreamLoader(file_store, runtime=runtime, device=NotHost(), pool=PinnedPool(1 << 20))
    with pytest.raises(TransferError, match="host device"):
        loader.submit("a", _in_place([torch.zeros(SHAPE)], SHAPE))
    with pytest.raises(InvalidInput):
        Scattered(torch.float32, (2, 256), (codec.tensor_bytes(torch.zeros(SHAPE)),))


def test_without_the_in_place_registration_staged_loads_work_and_a_scattered_dest_is_refused(
    runtime: Runtime, file_store: TensorStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-place loads are a plug-in (``asyncconn.transfer.direct``): a loader built with none registered
    -- as if ``asyncconn/transfer/in_place.py`` were deleted -- still loads staged values, has no in-place
    totals, and refuses a Scattered destination as an unknown one."""
    monkeypatch.setattr(loader_module, "DIRECT_LOADS", {})
    values = {f"p{i}": value(i) for i in range(4)}
    runtime.run(file_store.put(values.items()))
    loader = make_loader(file_store, runtime)
    with pytest.raises(TransferError, match="dest must be a TensorSpec, not Scattered"):
        loader.submit("p0", _in_place([torch.zeros(SHAPE)], SHAPE))
    loader.submit_many((k, TensorSpec(SHAPE, torch.float32)) for k in values)
    results = drain_loads(loader, len(values))
    assert all(r.ok and not r.in_place for r in results.values())
    assert all(torch.equal(results[k].tensor, v) for k, v in values.items())
    assert "loaded_in_place" not in loader.totals() and loader.totals()["loaded"] == len(values)
    assert_idle(loader)
