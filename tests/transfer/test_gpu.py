"""The CUDA path: bytes on the device equal the stored bytes across streams, under allocator reuse.

Skipped where ``torch.cuda.is_available()`` is False (the only allowed skip). Each test keeps the default
stream busy with matmuls and churns the caching allocator (free, allocate, overwrite) while side-stream
copies are in flight, which is what breaks a missing ``record_stream`` or a missing event wait.
"""

from __future__ import annotations

import pytest
import torch
from asyncconn_backends.memory import MemoryBackend

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CudaDevice, PinnedPool, SaveTracker, StreamLoader, TensorSpec
from tests.transfer.helpers import drain_loads, drain_saves, same_bytes, wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda unavailable)"),
]


def busy_default_stream(n: int = 2048, reps: int = 4) -> torch.Tensor:
    """Queue a few milliseconds of matmuls on the default stream (not waited for)."""
    a = torch.randn(n, n, device="cuda")
    for _ in range(reps):
        a = a @ a
        a = a / a.norm()
    return a


def churn_allocator(nbytes: int, count: int = 8) -> list[torch.Tensor]:
    """Allocate and overwrite freed memory on the default stream: a reused block shows up as 0xAB bytes."""
    junk = []
    for _ in range(count):
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t.fill_(0xAB)
        junk.append(t)
    return junk


@pytest.fixture
def cuda_store(runtime: Runtime) -> TensorStore:
    return TensorStore(MemoryBackend(), timeout=10.0)


def test_device_and_pool_are_pinned_on_cuda() -> None:
    device = CudaDevice()
    pool = PinnedPool(1 << 20, device=device)
    buf = pool.acquire(4096)
    assert buf is not None and buf.storage.is_pinned()
    pool.release(buf)


def test_loaded_tensors_equal_stored_bytes_under_default_stream_work(
    runtime: Runtime, cuda_store: TensorStore
) -> None:
    values = {f"emb{i}": torch.randn(256, 1024).to(torch.bfloat16) for i in range(16)}  # 512 KiB each
    runtime.run(cuda_store.put(values.items()))
    device = CudaDevice()
    loader = StreamLoader(cuda_store, runtime=runtime, device=device, pool=PinnedPool(4 << 20, device=device))
    for _round in range(4):
        busy = busy_default_stream()
        for key in values:
            loader.submit(key, TensorSpec((256, 1024), torch.bfloat16))
        results = drain_loads(loader, len(values))
        # Use the results on the default stream while more work is queued, then free half of them and let
        # the allocator hand their memory out again before the other half is checked.
        sums = {k: r.tensor.float().sum() for k, r in results.items() if r.tensor is not None}
        keys = sorted(results)
        for key in keys[::2]:
            results[key].tensor = None
        junk = churn_allocator(256 * 1024 * 2)
        for key in keys:
            tensor = results[key].tensor
            if tensor is not None:
                assert tensor.device.type == "cuda"
                assert same_bytes(tensor.cpu(), values[key])
            assert torch.allclose(sums[key].cpu(), values[key].float().sum(), rtol=1e-3, atol=1e-2)
        del junk, busy
    torch.cuda.synchronize()
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    loader.close()


def test_cancel_during_the_copy_frees_everything(runtime: Runtime, cuda_store: TensorStore) -> None:
    value = torch.randn(4096, 1024)  # 16 MiB: the copy is still running when we cancel
    runtime.run(cuda_store.put([("big", value)]))
    device = CudaDevice()
    loader = StreamLoader(
        cuda_store, runtime=runtime, device=device, pool=PinnedPool(64 << 20, device=device)
    )
    loader.submit("big", TensorSpec((4096, 1024), torch.float32))
    wait_until(lambda: (loader.poll(), loader.futures_pending == 0)[1], "the fetch")
    loader.cancel("big")
    churn_allocator(16 << 20)
    wait_until(lambda: (loader.poll(), loader.events_out == 0)[1], "the cancelled copy's event")
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    loader.close()


def test_saves_snapshot_after_the_producing_kernel_and_survive_the_free(
    runtime: Runtime, cuda_store: TensorStore
) -> None:
    device = CudaDevice()
    tracker = SaveTracker(
        cuda_store, runtime=runtime, device=device, pool=PinnedPool(64 << 20, device=device)
    )
    expected = {}
    for i in range(8):
        produced = busy_default_stream(1024, reps=2) * (i + 1)  # still being computed when we submit
        tracker.submit(f"r{i}", f"k{i}", produced)
        expected[f"k{i}"] = produced.cpu()  # waits on the default stream: the value the save must see
        del produced  # freed while the D2H may still be queued: record_stream keeps the memory
        churn_allocator(1024 * 1024 * 4)
    drain_saves(tracker, {f"r{i}" for i in range(8)})
    for key, value in expected.items():
        (back,) = runtime.run(cuda_store.get([key]))
        assert back is not None and same_bytes(back, value)
    assert tracker.held()["buffers_out"] == 0 and tracker.held()["events_out"] == 0
    tracker.close()


def test_a_polls_loads_land_as_rows_of_one_tensor(runtime: Runtime, cuda_store: TensorStore) -> None:
    """``rows=True``: the loads of one shape that one poll copies share one device tensor, row after row,
    with the stored bytes, under default-stream work and allocator churn; a load of another shape and a
    load cancelled while its row is copied are apart; everything is returned."""
    values = {f"v{i}": torch.randn(512, 1024).half() for i in range(5)}  # 1 MiB each
    odd = torch.randn(100, 7)
    runtime.run(cuda_store.put([*values.items(), ("odd", odd)]))
    device = CudaDevice()
    loader = StreamLoader(
        cuda_store, runtime=runtime, device=device, pool=PinnedPool(64 << 20, device=device), rows=True
    )
    loader.submit_many([(key, TensorSpec((512, 1024), torch.float16)) for key in values])
    loader.submit("odd", TensorSpec((100, 7), torch.float32))
    assert loader.wait(10)  # all six in staging; none copied yet
    busy_default_stream()
    assert loader.poll() == []  # issues the copies: one tensor for the five values of one shape
    assert loader.cancel("v4")
    churn_allocator(8 << 20)
    results = drain_loads(loader, 5)
    got = {key: r.tensor for key, r in results.items()}
    assert set(got) == {"v0", "v1", "v2", "v3", "odd"} and all(r.ok for r in results.values())
    rows = [got[f"v{i}"] for i in range(4)]
    assert rows[0] is not None
    base = rows[0].untyped_storage().data_ptr()
    for i, row in enumerate(rows):
        assert row is not None and row.untyped_storage().data_ptr() == base  # one tensor, row after row
        assert row.storage_offset() == rows[0].storage_offset() + i * row.numel()
        assert same_bytes(row.cpu(), values[f"v{i}"])
    assert got["odd"] is not None and got["odd"].untyped_storage().data_ptr() != base
    assert same_bytes(got["odd"].cpu(), odd)
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    loader.close()
