"""``asyncconn bench gpu``'s *kv_scatter* part: writing landed KV values into a paged cache, two ways.

A 4k-token prefix of a 32-layer model at one block per value is 256 values; each must be written into every
layer at its request's block ids, from vLLM's thread, on the forward's stream. For ``--scatter-values``
values of one block on ``--scatter-layers`` layers (``[2, num_blocks, 16, 8, 128]`` fp16 caches, scattered
block ids): :meth:`CacheLayout.scatter` once per value (one copy per value and layer) against
:meth:`CacheLayout.scatter_batch` (what a poll does with the values it hands over on CUDA: one stack, one
indexed write per layer). Host time is the call's wall time on the calling thread after a device sync;
device time is the span of CUDA events around the call with the stream kept busy before it, so that every
launch is queued before the GPU gets there. Medians over ``--repeat`` (at most 5 for device times).
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import PinnedPool, SaveTracker, StreamLoader, engine_devices

if TYPE_CHECKING:  # imported when run: the KV modules import vLLM's base classes where it is installed
    from asyncconn.vllm.kv.metadata import ValueRef
    from asyncconn.vllm.kv.worker import KVWorkerSide

__all__ = ["bench_scatter"]

#: GPU cycles of the spin before a device-time span: long enough for every launch of the slowest way.
_SPIN_CYCLES = 400_000_000


def _host_us(call: Callable[[], object], repeat: int, cuda: bool) -> float:
    samples = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        samples.append((time.perf_counter() - t0) * 1e6)
    return round(statistics.median(samples), 1)


def _device_us(call: Callable[[], object], repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        torch.cuda._sleep(_SPIN_CYCLES)  # type: ignore[no-untyped-call]
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        call()
        end.record()
        end.synchronize()  # type: ignore[no-untyped-call]
        samples.append(float(start.elapsed_time(end)) * 1e3)
    return round(statistics.median(samples), 1)


def _both_ways(
    worker: KVWorkerSide, values: list[torch.Tensor], refs: list[ValueRef], repeat: int, cuda: bool
) -> dict[str, Any]:
    layout = worker.layout
    assert layout is not None  # set by register_kv_caches

    def per_value() -> None:
        for value, ref in zip(values, refs, strict=True):
            layout.scatter(value, ref)

    def batched() -> None:
        layout.scatter_batch(list(zip(values, refs, strict=True)))

    row: dict[str, Any] = {}
    for name, call in (("per_value", per_value), ("batched", batched)):
        row[f"{name}_host_us"] = _host_us(call, repeat, cuda)
        row[f"{name}_device_us"] = _device_us(call, min(repeat, 5)) if cuda else None  # each spins ~0.2 s
    row["host_ratio"] = round(row["per_value_host_us"] / row["batched_host_us"], 1)
    return row


def bench_scatter(runtime: Runtime, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
    from asyncconn.vllm.kv.metadata import ValueRef
    from asyncconn.vllm.kv.worker import KVWorkerSide

    where = "cuda" if cuda else "cpu"
    layers = [f"layer.{i}" for i in range(args.scatter_layers)]
    identity = KVIdentity("bench-scatter", "", "float16", "default", 16, 8, 128, tuple(layers), 1, 1)
    rows = []
    for nvalues in args.scatter_values:
        num_blocks = 2 * nvalues
        store = runtime.run(TensorStore.open(f"memory://bench-scatter-{uuid.uuid4().hex[:8]}"), 60)
        load_device, save_device = engine_devices(where)
        pool = PinnedPool(16 << 20, device=load_device)
        worker = KVWorkerSide(
            KeySpace(identity),
            store=store,
            loader=StreamLoader(store, runtime=runtime, device=load_device, pool=pool),
            saver=SaveTracker(store, runtime=runtime, device=save_device, pool=pool),
            runtime=runtime,
            layers=layers,
            group_of_layer=dict.fromkeys(layers, 0),
            num_blocks=num_blocks,
        )
        try:
            caches = {n: torch.randn(2, num_blocks, 16, 8, 128, device=where).half() for n in layers}
            worker.register_kv_caches(caches)
            shape = (len(layers), 2, 1, 16, 8, 128)
            values = [torch.randn(shape, device=where).half() for _ in range(nvalues)]
            order = torch.randperm(num_blocks).tolist()[:nvalues]  # scattered, as a busy pool hands them out
            refs = [ValueRef(uuid.uuid4().bytes * 2, (0,), ((b,),)) for b in order]

            row = {"values": nvalues, **_both_ways(worker, values, refs, args.repeat, cuda)}
            rows.append(row)
        finally:
            worker.close()
    return {"kv_scatter": {"layers": len(layers), "blocks_per_value": 1, "rows": rows}}
