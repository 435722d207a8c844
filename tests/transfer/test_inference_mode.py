"""Loads and saves driven from a thread under ``torch.inference_mode()``, as vLLM's worker thread runs.

vLLM's real engine showed the trap the simulator hid: host staging allocated on an inference-mode thread is
an inference tensor, and the loop's in-place read into it raised, so every load failed (and the EC consumer
encoded every item itself). These tests run the engines exactly that way and fail without the fix.
"""

from __future__ import annotations

import pytest
import torch

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import (
    CpuDevice,
    PinnedPool,
    SaveTracker,
    StreamLoader,
    TensorSpec,
    engine_devices,
)
from tests.transfer.helpers import drain_loads, drain_saves, same_bytes


def test_host_buffers_made_under_inference_mode_are_normal_tensors() -> None:
    device = CpuDevice()
    with torch.inference_mode():
        host = device.alloc_host(64)
        out = device.empty((2, 3), torch.float32)
    assert not host.is_inference() and not out.is_inference()
    host.fill_(1)  # outside inference mode: raises for an inference tensor
    out.zero_()


def test_a_load_submitted_and_polled_under_inference_mode_lands(runtime: Runtime, store: TensorStore) -> None:
    value = torch.randn(5, 7)
    runtime.run(store.put([("emb", value)]))
    loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20))
    with torch.inference_mode():
        loader.submit("emb", TensorSpec(tuple(value.shape), value.dtype))
        loader.submit("any", TensorSpec(max_nbytes=4096))
        runtime.run(store.put([("any", value[:2])]))
        results = drain_loads(loader, 2)
    assert results["emb"].ok, results["emb"].detail
    assert results["emb"].tensor is not None and same_bytes(results["emb"].tensor, value)
    assert results["any"].ok, results["any"].detail
    assert results["any"].tensor is not None and same_bytes(results["any"].tensor, value[:2])
    loader.close()


def test_a_save_submitted_under_inference_mode_is_stored(runtime: Runtime, store: TensorStore) -> None:
    for copy_thread in (True, False):
        tracker = SaveTracker(
            store, runtime=runtime, device=CpuDevice(), pool=PinnedPool(1 << 20), copy_thread=copy_thread
        )
        with torch.inference_mode():
            value = torch.randn(4, 8)  # an inference tensor, like vLLM's encoder outputs
            assert tracker.submit("req", f"k{copy_thread}", value)
            tracker.flush()
            done = drain_saves(tracker, ["req"])
        assert done == {"req"}
        (back,) = runtime.run(store.get([f"k{copy_thread}"]))
        assert back is not None and same_bytes(back, value)
        tracker.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (torch.cuda unavailable)")
def test_the_cuda_path_under_inference_mode(runtime: Runtime, store: TensorStore) -> None:
    """The same trap on CUDA: pinned staging and loaded tensors are normal tensors, and loads and saves
    issued from an inference-mode thread land."""
    load_device, save_device = engine_devices("cuda")
    with torch.inference_mode():
        host = load_device.alloc_host(64)
        out = load_device.empty((2, 3), torch.float32)
    assert host.is_pinned() and not host.is_inference() and not out.is_inference()
    host.fill_(1)
    out.zero_()

    emb = torch.randn(5, 7)
    runtime.run(store.put([("emb", emb), ("any", emb[:2])]))
    loader = StreamLoader(
        store, runtime=runtime, device=load_device, pool=PinnedPool(1 << 20, device=load_device)
    )
    tracker = SaveTracker(
        store, runtime=runtime, device=save_device, pool=PinnedPool(1 << 20, device=save_device)
    )
    with torch.inference_mode():
        loader.submit("emb", TensorSpec(tuple(emb.shape), emb.dtype))
        loader.submit("any", TensorSpec(max_nbytes=4096))
        results = drain_loads(loader, 2)
        value = torch.randn(4, 8, device="cuda")  # an inference tensor, like vLLM's encoder outputs
        assert tracker.submit("req", "saved", value)
        tracker.flush()
        drain_saves(tracker, ["req"])
    for key, expected in (("emb", emb), ("any", emb[:2])):
        tensor = results[key].tensor
        assert results[key].ok and tensor is not None, results[key].detail
        assert tensor.is_cuda and not tensor.is_inference()
        assert same_bytes(tensor.cpu(), expected)
    (back,) = runtime.run(store.get(["saved"]))
    assert back is not None and same_bytes(back, value.cpu())
    loader.close()
    tracker.close()
