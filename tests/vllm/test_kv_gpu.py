"""KV blocks saved from a ``[2, num_blocks, ...]`` (flash-attention) KV cache and loaded back into other
blocks hold exactly the saved bytes, even though the source blocks are overwritten right after the save (and
vLLM's ``handle_preemptions``, which precedes any reuse of a preempted request's blocks).
On an NVIDIA GPU (``gpu`` marker, skipped without CUDA) through the side stream and pinned staging while the
default stream keeps computing; the same test runs on the CPU device everywhere."""

from __future__ import annotations

import time

import pytest
import torch
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("where", DEVICES)
def test_blocks_round_trip_through_the_store(where: str) -> None:
    from asyncconn.runtime import Runtime
    from asyncconn.store import TensorStore
    from asyncconn.transfer import PinnedPool, SaveTracker, StreamLoader, default_device
    from asyncconn.vllm.kv_keys import KeySpace, KVIdentity
    from asyncconn.vllm.kv_meta import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef
    from asyncconn.vllm.kv_worker import KVWorkerSide

    layers = [f"layer.{i}" for i in range(4)]
    identity = KVIdentity("gpu-test", "", "float16", "default", 16, 8, 128, tuple(layers), 1, 2)
    keys = KeySpace(identity)
    runtime = Runtime(name="kv-gpu").start()
    try:
        store = runtime.run(TensorStore.open(f"memory://kv-round-trip-{where}"), timeout=10)
        device = default_device(where)
        pool = PinnedPool(64 << 20, device=device)
        worker = KVWorkerSide(
            keys,
            store=store,
            loader=StreamLoader(store, runtime=runtime, device=device, pool=pool),
            saver=SaveTracker(store, runtime=runtime, device=device, pool=pool),
            runtime=runtime,
            layers=layers,
            group_of_layer=dict.fromkeys(layers, 0),
            num_blocks=64,
        )
        # vLLM's flash-attention layout: [2, num_blocks, block_size, heads, head_size]
        caches = {n: torch.randn(2, 64, 16, 8, 128, device=where, dtype=torch.float16) for n in layers}
        worker.register_kv_caches(caches)
        hashes = [bytes([i]) * 32 for i in range(2)]
        saved = {n: c[:, 4:8].clone() for n, c in caches.items()}
        refs = tuple(ValueRef(hashes[v], (0, 1), ((4 + 2 * v, 5 + 2 * v),)) for v in range(2))
        worker.save(AsyncConnKVMetadata(saves=[SaveSpec("r1", refs)]))
        # r1 is preempted: vLLM calls handle_preemptions before this step reuses its blocks (CUDA: waits for
        # the saves; CPU copy thread: for the pending snapshot copies only)
        worker.handle_preemptions(AsyncConnKVMetadata(preempted=frozenset({"r1"})))
        for n in layers:  # the blocks are rewritten right away: the snapshot must not see this
            caches[n][:, 4:8].zero_()
        sent: set[str] = set()
        deadline = time.monotonic() + 10
        while "r1" not in sent and time.monotonic() < deadline:
            done, _ = worker.get_finished({"r1"} if not sent else set())
            sent |= done or set()
            time.sleep(0.001)
        assert sent == {"r1"}

        a = torch.randn(4096 if where == "cuda" else 64, 4096 if where == "cuda" else 64, device=where)
        targets = tuple(ValueRef(hashes[v], (0, 1), ((40 + 2 * v, 41 + 2 * v),)) for v in range(2))
        worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r2", targets)]))
        for _ in range(10):
            a = a @ a  # default-stream work while the loads run on the side stream
        received: set[str] = set()
        deadline = time.monotonic() + 10
        while "r2" not in received and time.monotonic() < deadline:
            _, got = worker.get_finished(set())
            received |= got or set()
            time.sleep(0.001)
        assert received == {"r2"} and worker.get_block_ids_with_load_errors() == set()
        if where == "cuda":
            torch.cuda.synchronize()
        for n in layers:
            assert torch.equal(caches[n][:, 40:44], saved[n]), n
        worker.shutdown()
        assert not any(worker.counts().values())
        copier = worker.saver.copy_thread  # CPU: the snapshots ran there; shutdown joined it
        assert (copier is not None) == (where == "cpu") and (copier is None or not copier.alive)
    finally:
        runtime.close()
