"""The classic CUDA stream hazards, each made likely with spin kernels (``torch.cuda._sleep``).

Each test opens a race window -- one stream busy for ``SPIN_MS`` while another goes on -- and checks bytes
after ``torch.cuda.synchronize()``. Each one names the mistake it catches:

* a loaded tensor freed by its user while the default stream still reads it: without ``record_stream`` on
  the consumer's stream the caching allocator hands the block to the next side-stream load at once;
* a loaded tensor handed over before its copy's event fired: the default stream reads unwritten memory;
* a cancelled load's device tensor reused by the default stream while its copy is still queued;
* a save's snapshot taken before the kernel producing the tensor has run;
* a saved tensor freed right after ``submit`` and its block reused by the default stream before the
  queued snapshot read it;
* a load queued behind a save's copies (the loader and the save tracker sharing one side stream).

A test whose window closed before the hazard could happen fails, saying so, rather than passing on luck.
Skipped where ``torch.cuda.is_available()`` is False.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch

from asyncconn.config import Settings
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import (
    CudaDevice,
    PinnedPool,
    SaveTracker,
    StreamLoader,
    TensorSpec,
    engine_devices,
)
from tests.transfer.helpers import drain_loads, drain_saves, wait_until

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda unavailable)"),
]

SPIN_MS = 300.0  # the race window: far longer than a few-MiB load or save takes
NBYTES = 4 << 20


@functools.cache
def _cycles_per_ms() -> float:
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    cycles = 20_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()  # type: ignore[no-untyped-call]
    return cycles / max(start.elapsed_time(end), 1e-3)


def spin(stream: torch.cuda.Stream | None = None, ms: float = SPIN_MS) -> None:
    """Queue a kernel that keeps ``stream`` (default: the current one) busy for about ``ms``."""
    cycles = int(ms * _cycles_per_ms())
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        torch.cuda._sleep(cycles)


def busy(stream: torch.cuda.Stream) -> bool:
    return not stream.query()


def window_held(stream: torch.cuda.Stream, what: str) -> None:
    """The race window was still open at this point; otherwise the test could not have caught anything."""
    if not busy(stream):
        pytest.fail(f"the spin on {what} ended before the hazard could happen: raise SPIN_MS")


def uint8_value(fill: int) -> torch.Tensor:
    return torch.full((NBYTES,), fill, dtype=torch.uint8)


def make_loader(runtime: Runtime, store: TensorStore) -> tuple[StreamLoader, CudaDevice]:
    device, _ = engine_devices("cuda")
    assert isinstance(device, CudaDevice)
    loader = StreamLoader(store, runtime=runtime, device=device, pool=PinnedPool(64 << 20, device=device))
    return loader, device


def make_tracker(runtime: Runtime, store: TensorStore) -> tuple[SaveTracker, CudaDevice]:
    _, device = engine_devices("cuda")
    assert isinstance(device, CudaDevice)
    tracker = SaveTracker(store, runtime=runtime, device=device, pool=PinnedPool(64 << 20, device=device))
    return tracker, device


def load_one(loader: StreamLoader, key: str) -> torch.Tensor:
    loader.submit(key, TensorSpec((NBYTES,), torch.uint8))
    result = drain_loads(loader, 1)[key]
    assert result.ok, result.detail
    assert result.tensor is not None
    return result.tensor


@pytest.fixture(autouse=True)
def _idle_gpu() -> None:
    torch.cuda.synchronize()


def test_a_freed_loaded_tensor_is_not_reused_while_the_default_stream_reads_it(
    runtime: Runtime, store: TensorStore
) -> None:
    runtime.run(store.put([("a", uint8_value(0x11)), ("b", uint8_value(0x22))]))
    loader, _ = make_loader(runtime, store)
    a = load_one(loader, "a")
    default = torch.cuda.current_stream()
    spin()
    read_later = a.clone()  # queued behind the spin: reads ``a`` only after SPIN_MS
    del a  # the user frees it at once (vLLM drops an embedding after the forward that read it)
    b = load_one(loader, "b")  # same size, allocated on the side stream: must not get a's block yet
    window_held(default, "the default stream")
    torch.cuda.synchronize()
    assert torch.all(read_later == 0x11), "a's memory was overwritten by the next load before it was read"
    assert torch.all(b == 0x22)
    loader.close()


def test_a_loaded_tensor_is_handed_over_only_after_its_copy(runtime: Runtime, store: TensorStore) -> None:
    runtime.run(store.put([("a", uint8_value(0x5A))]))
    loader, device = make_loader(runtime, store)
    with torch.cuda.stream(device.stream):  # leave garbage where the next side-stream allocation lands
        junk = torch.full((NBYTES,), 0xEE, dtype=torch.uint8, device="cuda")
        del junk
    spin(device.stream)  # the load's copy is queued behind this
    loader.submit("a", TensorSpec((NBYTES,), torch.uint8))
    result = drain_loads(loader, 1)["a"]
    assert result.ok and result.tensor is not None
    seen = result.tensor.clone()  # the default stream reads it at once, as the forward would
    assert not busy(device.stream), "handed over while the side stream had not reached the copy"
    torch.cuda.synchronize()
    assert torch.all(seen == 0x5A)
    loader.close()


def test_a_cancelled_loads_memory_is_not_reused_while_its_copy_is_queued(
    runtime: Runtime, store: TensorStore
) -> None:
    runtime.run(store.put([("big", uint8_value(0x77))]))
    loader, device = make_loader(runtime, store)
    spin(device.stream)
    loader.submit("big", TensorSpec((NBYTES,), torch.uint8))
    wait_until(lambda: (loader.poll(), loader.events_out == 1)[1], "the copy to be issued")
    loader.cancel("big")  # its device tensor is dropped while the copy is queued behind the spin
    others = [torch.full((NBYTES,), 0x33, dtype=torch.uint8, device="cuda") for _ in range(4)]
    window_held(device.stream, "the loader's side stream")
    torch.cuda.synchronize()
    for other in others:
        assert torch.all(other == 0x33), "a cancelled copy landed in memory handed out again"
    wait_until(lambda: (loader.poll(), loader.events_out == 0)[1], "the cancelled copy's event")
    assert loader.held() == {"queued": 0, "buffers_out": 0, "events_out": 0, "futures_pending": 0}
    loader.close()


def test_a_snapshot_sees_what_the_producing_kernel_wrote(runtime: Runtime, store: TensorStore) -> None:
    tracker, _ = make_tracker(runtime, store)
    produced = torch.zeros(NBYTES // 4, dtype=torch.float32, device="cuda")
    default = torch.cuda.current_stream()
    spin()
    produced.fill_(3.0)  # the producing kernel runs only after the spin
    assert tracker.submit("r", "k", produced)
    tracker.flush()
    window_held(default, "the default stream")
    drain_saves(tracker, ["r"])
    (back,) = runtime.run(store.get(["k"]))
    assert back is not None and torch.all(back == 3.0), "the snapshot ran before the producing kernel"
    tracker.close()


def test_a_saved_tensor_freed_at_once_is_not_reused_before_its_snapshot(
    runtime: Runtime, store: TensorStore
) -> None:
    tracker, device = make_tracker(runtime, store)
    spin(device.stream)  # the snapshot is queued behind this
    produced = torch.full((NBYTES // 4,), 5.0, dtype=torch.float32, device="cuda")
    assert tracker.submit("r", "k", produced)
    tracker.flush()
    del produced  # freed (a finished request's activations) while the snapshot is queued
    others = [torch.full((NBYTES // 4,), -1.0, dtype=torch.float32, device="cuda") for _ in range(4)]
    window_held(device.stream, "the save tracker's side stream")
    drain_saves(tracker, ["r"])
    (back,) = runtime.run(store.get(["k"]))
    assert back is not None and torch.all(back == 5.0), "the block was reused before the snapshot read it"
    torch.cuda.synchronize()
    assert all(torch.all(o == -1.0) for o in others)
    tracker.close()


def test_a_load_does_not_wait_for_the_save_trackers_copies(runtime: Runtime, store: TensorStore) -> None:
    """At the EC worker, where both engines are built from one device: its loader and save tracker must
    not share a stream. The save tracker's stream is kept busy; a prefetch must land meanwhile."""
    from asyncconn.vllm.ec.metadata import ECStepMetadata, ItemRef
    from asyncconn.vllm.ec.worker import ECWorkerSide

    settings = Settings.from_extra_config(
        {"backend_url": "memory://", "pinned_pool_bytes": "64MiB", "ec_max_row_bytes": "8KiB"}
    )
    worker = ECWorkerSide(
        settings, producer=True, consumer=True, runtime=runtime, device=CudaDevice(), store=store
    )
    assert worker.loader is not None and worker.saver is not None
    saver_device, loader_device = worker.saver.device, worker.loader.device
    assert isinstance(saver_device, CudaDevice) and isinstance(loader_device, CudaDevice)
    assert loader_device.priority <= saver_device.priority
    runtime.run(store.put([("img", torch.randn(64, 2048))]))
    spin(saver_device.stream)  # a long save copy in flight
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img", 64)]))

    def staged() -> bool:
        worker.poll()
        return "img" in worker._staged

    wait_until(staged, "the prefetch")
    window_held(saver_device.stream, "the save tracker's side stream")
    torch.cuda.synchronize()
    worker.close()
