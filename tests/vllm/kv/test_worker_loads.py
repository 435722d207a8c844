"""The KV worker side's load path on CPU, without an engine: values land straight from the loader's staging
buffer into the cache (no new tensor per value, no gather of a whole value first), partial values still
land only their positions, and landings are scattered while the others are still being read."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, PinnedPool, SaveTracker, StreamLoader
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, ValueRef
from asyncconn.vllm.kv.worker import KVWorkerSide

LAYERS = [f"layer.{i}" for i in range(3)]
NUM_BLOCKS = 32


class _NoNewTensors(CpuDevice):
    """Refuses the per-value tensor a load used to be copied into before its scatter."""

    def empty(self, shape: Any, dtype: torch.dtype) -> torch.Tensor:
        raise AssertionError("a KV load made a new tensor for its value")


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(name="kv-worker-loads").start()
    yield rt
    rt.close()


def _worker(
    runtime: Runtime, blocks_per_value: int
) -> tuple[KVWorkerSide, KeySpace, dict[str, torch.Tensor]]:
    identity = KVIdentity(
        "worker-loads", "", "float32", "default", 16, 2, 8, tuple(LAYERS), 1, blocks_per_value
    )
    keys = KeySpace(identity)
    store = runtime.run(TensorStore.open(f"memory://kv-loads-{uuid.uuid4().hex[:8]}"), timeout=10)
    pool = PinnedPool(8 << 20)
    worker = KVWorkerSide(
        keys,
        store=store,
        loader=StreamLoader(store, runtime=runtime, device=_NoNewTensors(), pool=pool),
        saver=SaveTracker(store, runtime=runtime, device=CpuDevice(), pool=pool),
        runtime=runtime,
        layers=LAYERS,
        group_of_layer=dict.fromkeys(LAYERS, 0),
        num_blocks=NUM_BLOCKS,
    )
    caches = {n: torch.zeros(NUM_BLOCKS, 2, 16, 8) for n in LAYERS}
    worker.register_kv_caches(caches)
    return worker, keys, caches


def _receive(worker: KVWorkerSide, rid: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        _, got = worker.get_finished(set(), step_tokens=0)
        if got and rid in got:
            return
        time.sleep(0.001)
    raise AssertionError(f"{rid} was not reported received")


@pytest.mark.parametrize("ascending", [True, False])
@pytest.mark.parametrize("bpv", [1, 2])
def test_loaded_values_land_bytes_exact_from_staging(
    runtime: Runtime, bpv: int, ascending: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, keys, caches = _worker(runtime, bpv)
    values = [torch.randn(len(LAYERS), bpv, 2, 16, 8) for _ in range(3)]
    hashes = [bytes([v + 1]) * 32 for v in range(3)]
    runtime.run(
        worker.store.put([(keys.store_key(h, 0), val) for h, val in zip(hashes, values, strict=True)])
    )
    gathers = index_tensors = 0
    index_select, make_tensor = torch.Tensor.index_select, torch.tensor

    def counted(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal gathers
        gathers += 1
        return index_select(self, *args, **kwargs)

    def counted_tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal index_tensors
        index_tensors += 1
        return make_tensor(*args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_select", counted)
    whole = tuple(range(bpv))

    def block(v: int, j: int) -> int:  # consecutive ids (a plain slice of the cache), or a reversed run
        return 10 + v * bpv + j if ascending else 20 - v * bpv - j

    refs = [ValueRef(hashes[v], whole, (tuple(block(v, j) for j in whole),)) for v in range(2)]
    if bpv > 1:  # a value of which only the last position is loaded (a local prefix hit covers the rest)
        refs.append(ValueRef(hashes[2], (bpv - 1,), ((3,),)))
    monkeypatch.setattr(torch, "tensor", counted_tensor)
    worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec("r", tuple(refs))]))
    _receive(worker, "r")
    monkeypatch.setattr(torch, "tensor", make_tensor)
    assert worker.get_block_ids_with_load_errors() == set()
    for i, name in enumerate(LAYERS):
        for v in range(2):
            for j in whole:
                assert torch.equal(caches[name][block(v, j)], values[v][i, j]), (name, v, j)
        if bpv > 1:
            assert torch.equal(caches[name][3], values[2][i, bpv - 1])
    # whole values are copied as they are; only the partial value gathers its positions (once per layer);
    # an index tensor only for its positions and for runs of block ids that are not consecutive
    assert gathers == (len(LAYERS) if bpv > 1 else 0)
    assert index_tensors == (0 if bpv == 1 else 1 if ascending else 3)
    worker.shutdown()
    assert not any(worker.counters().values()), worker.counters()
