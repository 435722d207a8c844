"""``asyncconn bench gpu``: the connectors' worker sides on a GPU, beside raw pinned copies of the same bytes.

What ``asyncconn bench transfer`` measures on CUDA (H2D through the loader, a load overlapped with compute)
is the engines alone; this is the worker sides vLLM drives, with no vLLM needed:

- *kv_load*: ``--kv-values`` KV values (``--kv-layers`` layers, ``--kv-blocks-per-value`` blocks of a
  ``[2, num_blocks, 16, 8, 128]`` fp16 paged cache each) loaded by :class:`KVWorkerSide` into other blocks
  of the cache: device time of the loader's H2D copies plus the scatters into the blocks, against a raw
  pinned ``copy_`` of the same bytes (target >= 0.8x). The store fetch (host memory) is not part of it.
- *kv_save*: the same values saved by :class:`KVWorkerSide`: device time of the save tracker's D2H
  snapshots against a raw pinned ``copy_`` to the host of the same bytes (target >= 0.9x).
- *kv_scatter*: landed values written into a 32-layer cache one copy per value and layer against one
  batch per poll (host and device time; see :mod:`asyncconn_tools.bench.gpu_scatter`).
- *ec_install*: host time of the forward-path call that installs a prefetched ``--ec-rows`` x
  ``--ec-width`` bf16 embedding (7 MiB by default) into ``encoder_cache`` (``ECWorkerSide.start_load_caches``
  with one install), p50/p99 over ``--repeat`` items (target <= 20 us).

Device times come from CUDA events on the streams that ran the work, each stream kept busy just before its
start event (``spin``) so that a span is the work's device time, not the host's time to launch it; the
host's side is reported beside it: ``scatter_host_us`` (vLLM's thread writing a load's values into the
cache, per load) and ``wait_for_save_host_*`` (``KVWorkerSide.save``, what ``wait_for_save`` runs; it
includes the timing events' own launches). Loads are collected the way vLLM drives them, once per
``--kv-step``. Without CUDA nothing is measured
(each part says so), unless ``--allow-cpu`` runs the same code on the CPU device with wall-clock spans: a
check that the benchmark runs, not a figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from asyncconn.cli import argtypes
from asyncconn.config import Settings
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import (
    LOAD_PRIORITY,
    SAVE_PRIORITY,
    CpuDevice,
    CudaDevice,
    PinnedPool,
    SaveTracker,
    StreamLoader,
    TransferDevice,
)
from asyncconn.transfer._device import CopyPairs, Event
from asyncconn_tools.bench.gpu_scatter import bench_scatter

__all__ = ["add_arguments", "bench", "run"]

NOT_MEASURED = "not measured: no CUDA device"


Mark = float | torch.cuda.Event
Span = tuple[Mark, Mark]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-values", type=argtypes.count, default=8, help="KV values per run")
    parser.add_argument("--kv-layers", type=argtypes.count, default=8, help="layers per KV value")
    parser.add_argument("--kv-blocks-per-value", type=argtypes.count, default=16, help="blocks per KV value")
    parser.add_argument(
        "--kv-step",
        type=argtypes.positive_duration,
        default=0.005,
        help="time between the worker's polls during a load, one engine step (default 5ms)",
    )
    parser.add_argument(
        "--scatter-values",
        type=argtypes.count_list,
        default=[8, 64, 256],
        help="values per kv_scatter row (comma-separated)",
    )
    parser.add_argument("--scatter-layers", type=argtypes.count, default=32, help="layers in kv_scatter")
    parser.add_argument("--ec-rows", type=argtypes.count, default=1792, help="rows of the EC embedding")
    parser.add_argument(
        "--ec-width", type=argtypes.count, default=2048, help="bf16 columns of the EC embedding"
    )
    parser.add_argument(
        "--repeat", type=argtypes.count, default=20, help="runs per figure (medians reported)"
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="without CUDA, run on the CPU device (a smoke test, no figures)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


# -- timing ----------------------------------------------------------------------------------------------
def _mark(stream: torch.cuda.Stream | None) -> Mark:
    """Now, on ``stream`` (a timing event) or on the host clock (CPU)."""
    if stream is None:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record(stream)
    return event


#: GPU cycles a stream spins for before a timed copy or kernel starts (~2 ms on an H100/H200 clock).
SPIN_CYCLES = 4_000_000


def spin(stream: torch.cuda.Stream) -> None:
    """Keep ``stream`` busy for a while, so that what the host queues next -- a start event, then the work
    it brackets -- is queued before the GPU gets there: the span between the events is then the work's
    device time, not the host's time to launch it (which the host-side figures report)."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SPIN_CYCLES)  # type: ignore[no-untyped-call]


def _start(stream: torch.cuda.Stream | None) -> Mark:
    """:func:`_mark` after :func:`spin` (CUDA): the start of a device-time span."""
    if stream is not None:
        spin(stream)
    return _mark(stream)


def _ms(span: Span) -> float:
    start, end = span
    if isinstance(start, float) and isinstance(end, float):
        return (end - start) * 1e3
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    end.synchronize()  # type: ignore[no-untyped-call]
    return float(start.elapsed_time(end))


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class _TimedCuda(CudaDevice):
    """A side stream whose copies are bracketed by timing events."""

    def __init__(self, *, priority: int) -> None:
        super().__init__(priority=priority)
        self.spans: list[Span] = []

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        if isinstance(after, torch.cuda.Event):
            self.stream.wait_event(after)  # so the span times the copy, not the wait
        start = _start(self.stream)
        event = super().copy(pairs, after=after)
        self.spans.append((start, _mark(self.stream)))
        return event


class _TimedCpu(CpuDevice):
    def __init__(self) -> None:
        super().__init__()
        self.spans: list[Span] = []

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        start = _mark(None)
        event = super().copy(pairs, after=after)
        self.spans.append((start, _mark(None)))
        return event


def _timed(cuda: bool, priority: int) -> _TimedCuda | _TimedCpu:
    return _TimedCuda(priority=priority) if cuda else _TimedCpu()


def _raw_ms(cuda: bool, dst: torch.Tensor, src: torch.Tensor, repeat: int) -> float:
    """Median time of one ``dst.copy_(src)`` (pinned host <-> device) on the current stream."""
    stream = torch.cuda.current_stream() if cuda else None
    samples = []
    for _ in range(repeat):
        start = _start(stream)
        dst.copy_(src, non_blocking=cuda)
        samples.append(_ms((start, _mark(stream))))
    return statistics.median(samples)


def _poll(cond: Callable[[], bool], what: str, timeout: float = 60.0, interval: float = 0.0001) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"benchmark: {what} did not finish")
        time.sleep(interval)


# -- KV ----------------------------------------------------------------------------------------------------
def _bench_kv(runtime: Runtime, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
    from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, LoadSpec, SaveSpec, ValueRef
    from asyncconn.vllm.kv.worker import KVWorkerSide

    where = "cuda" if cuda else "cpu"
    bpv, nvalues = args.kv_blocks_per_value, args.kv_values
    layers = [f"layer.{i}" for i in range(args.kv_layers)]
    identity = KVIdentity("bench-gpu", "", "float16", "default", 16, 8, 128, tuple(layers), 1, bpv)
    num_blocks = 2 * nvalues * bpv
    caches = {n: torch.randn(2, num_blocks, 16, 8, 128, device=where).half() for n in layers}
    value_bytes = len(layers) * 2 * bpv * 16 * 8 * 128 * 2
    store = runtime.run(TensorStore.open(f"memory://bench-gpu-{uuid.uuid4().hex[:8]}"), 60)
    load_device, save_device = _timed(cuda, LOAD_PRIORITY), _timed(cuda, SAVE_PRIORITY)
    pool = PinnedPool(max(1 << 30, 4 * nvalues * value_bytes), device=load_device)
    scatter: list[Span] = []

    scatter_host: list[float] = []

    inside = False

    def timed(call: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args: Any) -> None:
            nonlocal inside
            if inside:  # a batch of one calls scatter: timed once
                call(*args)
                return
            inside = True
            stream = torch.cuda.current_stream() if cuda else None
            start = _start(stream)
            t1 = time.perf_counter()  # the spin's launch is not the scatter's host time
            try:
                call(*args)
            finally:
                inside = False
            scatter.append((start, _mark(stream)))
            scatter_host.append(time.perf_counter() - t1)

        return wrapper

    worker = KVWorkerSide(
        KeySpace(identity),
        store=store,
        loader=StreamLoader(store, runtime=runtime, device=load_device, pool=pool, rows=True),
        saver=SaveTracker(store, runtime=runtime, device=save_device, pool=pool, copy_thread=False),
        runtime=runtime,
        layers=layers,
        group_of_layer=dict.fromkeys(layers, 0),
        num_blocks=num_blocks,
    )
    worker.register_kv_caches(caches)
    # Time the cache writes of the loads: the layout's two ways, whichever the landing uses.
    layout = worker.layout
    assert layout is not None  # set by register_kv_caches
    layout.scatter = timed(layout.scatter)  # type: ignore[method-assign]
    layout.scatter_batch = timed(layout.scatter_batch)  # type: ignore[method-assign]
    save_ms, load_ms, scatter_ms, save_host = [], [], [], []
    scatter_host_us: list[float] = []
    try:
        for rep in range(args.repeat):
            hashes = [uuid.uuid4().bytes * 2 for _ in range(nvalues)]  # new keys: every save is stored
            blocks = [tuple(range(v * bpv, (v + 1) * bpv)) for v in range(nvalues)]
            refs = tuple(ValueRef(h, tuple(range(bpv)), (b,)) for h, b in zip(hashes, blocks, strict=True))
            rid = f"save{rep}"
            save_device.spans.clear()
            t0 = time.perf_counter()
            worker.save(AsyncConnKVMetadata(saves=[SaveSpec(rid, refs)]))
            save_host.append(time.perf_counter() - t0)
            sent: set[str] = set()

            def saved(rid: str = rid, sent: set[str] = sent) -> bool:
                done, _ = worker.get_finished({rid} if not sent else set())
                sent.update(done or ())
                return rid in sent

            _poll(saved, "KV saves")
            save_ms.append(sum(_ms(s) for s in save_device.spans))

            base = nvalues * bpv
            targets = tuple(
                ValueRef(h, tuple(range(bpv)), (tuple(range(base + v * bpv, base + (v + 1) * bpv)),))
                for v, h in enumerate(hashes)
            )
            rid = f"load{rep}"
            load_device.spans.clear()
            scatter.clear()
            scatter_host.clear()
            worker.start_load_kv(AsyncConnKVMetadata(loads=[LoadSpec(rid, targets)]))
            received: set[str] = set()

            def loaded(received: set[str] = received) -> bool:
                _, got = worker.get_finished(set())
                received.update(got or ())
                return bool(received)

            # vLLM polls once per step: the values in staging by then go to the device together, and those
            # whose copies have ended by the next step are scattered together.
            worker.loader.wait(60)
            _poll(loaded, "KV loads", interval=args.kv_step)
            if worker.get_block_ids_with_load_errors():
                raise RuntimeError("benchmark: a KV load failed")
            _sync(cuda)
            load_ms.append(sum(_ms(s) for s in load_device.spans))
            scatter_ms.append(sum(_ms(s) for s in scatter))
            scatter_host_us.append(sum(scatter_host) * 1e6)
    finally:
        worker.close()
    total = nvalues * value_bytes
    host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(total, dtype=torch.uint8, device=where)
    raw_h2d = _raw_ms(cuda, dev, host, args.repeat)
    raw_d2h = _raw_ms(cuda, host, dev, args.repeat)
    save, load, scat = (statistics.median(x) for x in (save_ms, load_ms, scatter_ms))

    def gbps(ms: float) -> float:
        return round(total / ms / 1e6, 2) if ms > 0 else float("inf")

    return {
        "kv_load": {
            "bytes": total,
            "values": nvalues,
            "raw_pinned_h2d_GBps": gbps(raw_h2d),
            "loader_h2d_ms": round(load, 3),
            "scatter_ms": round(scat, 3),
            "scatter_host_us": round(statistics.median(scatter_host_us), 1),
            "worker_GBps": gbps(load + scat),
            "worker_vs_raw": round(raw_h2d / (load + scat), 3),
        },
        "kv_save": {
            "bytes": total,
            "values": nvalues,
            "raw_pinned_d2h_GBps": gbps(raw_d2h),
            "snapshot_d2h_ms": round(save, 3),
            "snapshot_GBps": gbps(save),
            "snapshot_vs_raw": round(raw_d2h / save, 3),
            "wait_for_save_host_p50_us": round(statistics.median(save_host) * 1e6, 1),
            "wait_for_save_host_max_us": round(max(save_host) * 1e6, 1),
        },
    }


# -- EC ----------------------------------------------------------------------------------------------------
def _bench_ec(runtime: Runtime, args: argparse.Namespace, cuda: bool) -> dict[str, Any]:
    from asyncconn.vllm.ec.metadata import ECStepMetadata, ItemRef
    from asyncconn.vllm.ec.worker import ECWorkerSide

    where = "cuda" if cuda else "cpu"
    rows, width = args.ec_rows, args.ec_width
    nbytes = rows * width * 2
    url = f"memory://bench-ec-{uuid.uuid4().hex[:8]}"
    settings = Settings.from_extra_config(
        {
            "backend_url": url,
            "pinned_pool_bytes": max(1 << 30, 4 * nbytes),
            "ec_max_row_bytes": width * 2,
        }
    )
    device: TransferDevice = CudaDevice() if cuda else CpuDevice()
    worker = ECWorkerSide(settings, producer=False, consumer=True, runtime=runtime, device=device)
    store = worker.store
    install_s: list[float] = []
    try:
        items = [f"item{i}" for i in range(args.repeat + 1)]  # the first one learns the row shape
        emb = torch.randn(rows, width).to(torch.bfloat16)
        runtime.run(store.put([(worker.key(h), emb) for h in items]), 60)
        for mm_hash in items:
            cache: dict[str, torch.Tensor] = {}
            ref = ItemRef(mm_hash, rows)
            worker.start_load_caches(cache, ECStepMetadata(prefetch=[ref]))

            def staged(mm_hash: str = mm_hash) -> bool:
                worker.poll()
                return mm_hash in worker._staged

            _poll(staged, "EC prefetch")
            meta = ECStepMetadata(install=[ref])
            t0 = time.perf_counter()
            worker.start_load_caches(cache, meta)
            install_s.append(time.perf_counter() - t0)
            if mm_hash not in cache or cache[mm_hash].device.type != where:
                raise RuntimeError("benchmark: the EC item was not installed")
            worker.report()
    finally:
        worker.close()
    samples = sorted(install_s[1:])

    def pct(p: float) -> float:
        return round(samples[min(len(samples) - 1, round(p / 100 * (len(samples) - 1)))] * 1e6, 2)

    return {
        "ec_install": {"bytes": nbytes, "items": len(samples), "host_p50_us": pct(50), "host_p99_us": pct(99)}
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Every part, or each part marked not measured where there is no CUDA device (see ``--allow-cpu``)."""
    cuda = torch.cuda.is_available()
    out: dict[str, Any] = {"machine": {"cuda": cuda, "torch": torch.__version__}, "repeat": args.repeat}
    if cuda:
        out["machine"]["device"] = torch.cuda.get_device_name()
    if not cuda and not args.allow_cpu:
        out.update({part: NOT_MEASURED for part in ("kv_load", "kv_save", "kv_scatter", "ec_install")})
        return out
    if not cuda:
        out["machine"]["note"] = "CPU device (--allow-cpu): a smoke test of the benchmark, not figures"
    runtime = Runtime(name="bench-gpu").start()
    try:
        out.update(_bench_kv(runtime, args, cuda))
        out.update(bench_scatter(runtime, args, cuda))
        out.update(_bench_ec(runtime, args, cuda))
    finally:
        runtime.close()
    return out


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    for section, value in result.items():
        if isinstance(value, dict):
            print(f"{section}:")
            for key, item in value.items():
                print(f"  {key:<28} {item}")
        else:
            print(f"{section}: {value}")
    return 0
