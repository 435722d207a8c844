"""``asyncconn bench transfer``: the stream loader's and the save tracker's costs, beside baselines.

CPU (always):

- *loader*: ``--loads`` values of ``--load-size`` from ``memory://`` through :class:`StreamLoader`
  (submit all, poll until done), against the same values fetched with one ``runtime.run`` of a gather of
  ``TensorStore.get_into`` calls plus a copy (the least work the same result needs) and against the naive
  blocking way (one ``runtime.run`` per value). Also the worker-thread time per ``submit`` and per result
  of ``poll`` -- the cost vLLM's worker pays.
- *saver*: ``SaveTracker.submit`` latency (p50/p99/max) with a store that takes ``--put-latency`` (100 ms)
  per put, in steps of ``--save-batch`` submits followed by ``flush`` (what the adapter's
  ``wait_for_save`` calls), ``poll`` and a 1 ms pause, as a worker would; the latency of those two
  calls beside a bare ``runtime.submit`` of an empty coroutine at the same moment (the floor of any
  hand-off to the loop); and saves/s through the tracker against one ``runtime.run`` of a batch put. Both
  snapshot modes, alternating round by round: the copy thread (``saver_cpu``, the CPU default) and the
  synchronous copy inside ``submit`` (``saver_cpu_sync``, the flow CUDA uses).

- *prefix*: a KV prefix load as the KV connector issues it -- ``--prefix-values`` values of
  ``--prefix-value-size`` (default 128 x 896 KiB: a 4,096-token prefix of ``text-100m``) from a page-cached
  ``file://`` store in a temporary directory, all submitted at once, each value copied out of its staging
  buffer as it is handed over (``poll`` with a consumer) -- read in groups of about ``GROUP_BYTES`` per
  store call (``file://``'s ``batch_reads``) against one read per value on the same store, alternating run
  by run.

CUDA (only when ``torch.cuda.is_available()``):

- *h2d*: for each of ``--gpu-sizes``, the H2D copy the loader issues (timed with CUDA events on its side
  stream) against a raw pinned ``copy_`` of the same size in the same run (target >= 0.9x); both streams
  are kept busy just before the start event (``spin``), so each span is the copy's device time and not
  the host's time to issue it (the loader's host costs are the ``loader_cpu`` figures);
- *overlap*: a load of the largest size issued while ``--matmuls`` are queued on the default stream: step
  time against ``max(compute, copy)`` (target <= 1.1x) and the serial sum.

Figures are medians over ``--repeat`` runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncconn.cli import argtypes
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import (
    CpuDevice,
    CudaDevice,
    LoadResult,
    PinnedPool,
    SaveTracker,
    StreamLoader,
    TensorSpec,
)
from asyncconn.transfer._device import CopyPairs, Event
from asyncconn_tools.bench.gpu import spin

__all__ = ["add_arguments", "bench", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--loads", type=argtypes.count, default=2000, help="values per loader run")
    parser.add_argument(
        "--load-size", type=argtypes.positive_size, default=64 * 1024, help="bytes per loaded value"
    )
    parser.add_argument("--prefix-values", type=argtypes.count, default=128, help="values of the prefix load")
    parser.add_argument(
        "--prefix-value-size", type=argtypes.positive_size, default=896 << 10, help="bytes per prefix value"
    )
    parser.add_argument("--saves", type=argtypes.count, default=2000, help="submits per save-tracker run")
    parser.add_argument(
        "--save-size", type=argtypes.positive_size, default=64 * 1024, help="bytes per saved tensor"
    )
    parser.add_argument("--save-batch", type=argtypes.count, default=32, help="submits per simulated step")
    parser.add_argument("--put-latency", type=argtypes.duration, default=0.1, help="store latency per put")
    parser.add_argument("--pool", type=argtypes.positive_size, default=1 << 30, help="staging pool capacity")
    parser.add_argument(
        "--repeat", type=argtypes.count, default=5, help="runs per figure (medians are reported)"
    )
    parser.add_argument(
        "--gpu-sizes", type=argtypes.size_list, default="16MiB,64MiB,256MiB", help="H2D sizes"
    )
    parser.add_argument(
        "--matmuls", type=argtypes.count, default=20, help="4096^2 matmuls queued in the overlap test"
    )
    parser.add_argument(
        "--switch-interval",
        type=argtypes.positive_duration,
        default=None,
        help="sys.setswitchinterval for the run (default: Python's 5ms): how long a thread waits for the GIL",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


# -- helpers -------------------------------------------------------------------------------------------
def _pct(samples: Sequence[float], p: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 2)


def _poll_until(cond: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError("benchmark step did not finish")
        time.sleep(0.0001)


def _next_results(loader: StreamLoader) -> list[LoadResult]:
    """Poll until at least one load result comes back."""
    results: list[LoadResult] = []

    def step() -> bool:
        results.extend(loader.poll())
        return bool(results)

    _poll_until(step)
    return results


def _drain_saves(
    tracker: SaveTracker,
    seen: set[str],
    started: dict[str, float] | None = None,
    lag: list[float] | None = None,
) -> None:
    """Poll until every request is reported, adding the ids to ``seen`` (and report lags to ``lag``)."""

    def step() -> bool:
        done = tracker.poll()
        now = time.perf_counter()
        seen.update(done)
        if started is not None and lag is not None:
            lag.extend(now - started[r] for r in done)
        time.sleep(0.001)
        return tracker.held()["requests"] == 0

    _poll_until(step)


def _open(runtime: Runtime, url: str) -> TensorStore:
    return runtime.run(TensorStore.open(url, timeout=60.0), timeout=60.0)


# -- CPU: loader ---------------------------------------------------------------------------------------
def _bench_loader(runtime: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    store = _open(runtime, "memory://")
    numel = max(args.load_size // 4, 1)
    keys = [f"load{i}" for i in range(args.loads)]
    runtime.run(store.put([(k, torch.randn(numel)) for k in keys]))
    device = CpuDevice()
    pool = PinnedPool(args.pool, device=device)
    staging = [torch.empty(numel) for _ in keys]
    loader_s, batch_s, naive_s, submit_s, poll_s = [], [], [], [], []
    for _ in range(args.repeat):
        loader = StreamLoader(store, runtime=runtime, device=device, pool=pool)
        got = 0
        t0 = time.perf_counter()
        for key in keys:
            t = time.perf_counter()
            loader.submit(key, TensorSpec((numel,), torch.float32))
            submit_s.append(time.perf_counter() - t)
        while got < len(keys):
            t = time.perf_counter()
            results = loader.poll()
            if results:
                poll_s.append((time.perf_counter() - t) / len(results))
                got += len(results)
            else:
                time.sleep(0.0001)
        loader_s.append(time.perf_counter() - t0)
        loader.close()

        async def gather() -> list[bool]:
            return await asyncio.gather(*(store.get_into(k, s) for k, s in zip(keys, staging, strict=True)))

        t0 = time.perf_counter()
        runtime.run(gather())
        _ = [s.clone() for s in staging]
        batch_s.append(time.perf_counter() - t0)

        t0 = time.perf_counter()
        for key, buf in zip(keys, staging, strict=True):
            runtime.run(store.get_into(key, buf))
            buf.clone()
        naive_s.append(time.perf_counter() - t0)
    n = len(keys)
    loader_med, batch_med, naive_med = (statistics.median(x) for x in (loader_s, batch_s, naive_s))
    return {
        "loads": n,
        "value_bytes": numel * 4,
        "loader_loads_per_s": round(n / loader_med),
        "gather_loads_per_s": round(n / batch_med),
        "naive_loads_per_s": round(n / naive_med),
        "loader_vs_gather": round(batch_med / loader_med, 3),
        "loader_overhead_us_per_load": _us((loader_med - batch_med) / n),
        "submit_p50_us": _us(_pct(submit_s, 50)),
        "submit_p99_us": _us(_pct(submit_s, 99)),
        "poll_us_per_result_p50": _us(_pct(poll_s, 50)),
    }


def _bench_prefix(runtime: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    numel = max(args.prefix_value_size // 4, 1)
    keys = [f"prefix{i}" for i in range(args.prefix_values)]
    with tempfile.TemporaryDirectory(prefix="asyncconn-bench-") as root:
        store = _open(runtime, f"file://{root}/store")
        try:
            runtime.run(store.put([(k, torch.randn(numel)) for k in keys]), timeout=120.0)
            pool = PinnedPool(max(args.pool, 2 * len(keys) * numel * 4))
            loader = StreamLoader(store, runtime=runtime, device=CpuDevice(), pool=pool)  # 64 in flight
            cache = torch.empty(len(keys), numel)
            where = {k: i for i, k in enumerate(keys)}

            landed = [0]

            def scatter(result: LoadResult) -> None:
                if result.tensor is None:
                    raise RuntimeError(f"benchmark load failed: {result.failure}: {result.detail}")
                cache[where[result.key]].copy_(result.tensor)
                landed[0] += 1

            times: dict[bool, list[float]] = {True: [], False: []}
            for run_no in range(2 * (args.repeat + 1)):
                grouped = run_no % 2 == 0
                store.backend.batch_reads = grouped  # type: ignore[misc]  # this instance only
                landed[0] = 0
                t0 = time.perf_counter()
                loader.submit_many((k, TensorSpec((numel,), torch.float32)) for k in keys)
                while landed[0] < len(keys):
                    loader.wait(1.0, landed=1)
                    loader.poll(scatter)
                if run_no >= 2:  # the first pair warms the page cache and the pool
                    times[grouped].append(time.perf_counter() - t0)
            loader.close()
        finally:
            runtime.run(store.close())
    grouped_s, single_s = statistics.median(times[True]), statistics.median(times[False])
    return {
        "values": len(keys),
        "value_bytes": numel * 4,
        "grouped_ms": round(grouped_s * 1e3, 1),
        "one_read_per_value_ms": round(single_s * 1e3, 1),
        "grouped_vs_one_per_value": round(single_s / grouped_s, 3),
    }


async def _noop() -> None:
    return None


def _bare_submit(runtime: Runtime) -> Callable[[], object]:
    """The floor of any hand-off to the loop: ``runtime.submit`` of an empty coroutine."""
    return lambda: runtime.submit(_noop())


# -- CPU: saver ----------------------------------------------------------------------------------------
class _SaverSamples:
    """Everything measured for one snapshot mode, over all rounds."""

    def __init__(self) -> None:
        self.submit: list[float] = []
        self.flush: list[float] = []
        self.bare: list[float] = []
        self.poll: list[float] = []
        self.p99_per_run: list[float] = []
        self.report: list[float] = []
        self.tracker_s: list[float] = []


def _saver_round(
    runtime: Runtime,
    args: argparse.Namespace,
    slow: TensorStore,
    pool: PinnedPool,
    tensors: list[torch.Tensor],
    rep: str,
    copy_thread: bool,
    out: _SaverSamples,
) -> None:
    """One round of the stepped workload against the slow store, as a worker would drive it."""
    tracker = SaveTracker(slow, runtime=runtime, device=CpuDevice(), pool=pool, copy_thread=copy_thread)
    run_samples: list[float] = []
    started: dict[str, float] = {}
    finished: set[str] = set()
    for i in range(args.saves):
        request = f"{rep}-req{i // args.save_batch}"
        started.setdefault(request, time.perf_counter())
        t = time.perf_counter()
        tracker.submit(request, f"{rep}-save{i}", tensors[i % len(tensors)])
        run_samples.append(time.perf_counter() - t)
        if i % args.save_batch == args.save_batch - 1:
            # End of a step: the adapter's wait_for_save() flushes, get_finished() polls.
            # The first hand-off of a step wakes a loop that may have work queued (puts started by
            # earlier steps) and can wait for the GIL behind it; alternate which call goes first so
            # both are measured in both positions.
            calls = [(tracker.flush, out.flush), (_bare_submit(runtime), out.bare)]
            if (i // args.save_batch) % 2:
                calls.reverse()
            for call, samples in calls:
                t = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t)
            t = time.perf_counter()
            done = tracker.poll()
            now = time.perf_counter()
            out.poll.append(now - t)
            out.report.extend(now - started[r] for r in done)
            finished |= done
            time.sleep(0.001)  # the rest of a forward step
    _drain_saves(tracker, finished, started, out.report)
    tracker.close()
    out.submit += run_samples
    out.p99_per_run.append(_pct(run_samples, 99))


def _bench_saver(runtime: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    """Both snapshot modes on the CPU device, alternating round by round in this one run: the copy thread
    (the default, ``saver_cpu``) and the synchronous copy inside ``submit`` (``saver_cpu_sync``)."""
    numel = max(args.save_size // 4, 1)
    tensors = [torch.randn(numel) for _ in range(64)]
    latency_ms = args.put_latency * 1e3
    slow = _open(runtime, f"memory://?latency={latency_ms:g}ms")
    # One pool for every run, prefilled as an operator would at start-up: what is measured is the steady
    # state, not first-touch page faults of fresh staging memory.
    pool = PinnedPool(args.pool, device=CpuDevice())
    pool.prefill(numel * 4, args.saves)
    modes = {True: _SaverSamples(), False: _SaverSamples()}
    for rep in range(args.repeat):
        for copy_thread in (True, False) if rep % 2 == 0 else (False, True):
            name = f"rep{rep}-{'thread' if copy_thread else 'sync'}"
            _saver_round(runtime, args, slow, pool, tensors, name, copy_thread, modes[copy_thread])

    fast = _open(runtime, "memory://")
    direct_s = []
    for rep in range(args.repeat):
        for copy_thread, samples in modes.items():
            tracker = SaveTracker(
                fast, runtime=runtime, device=CpuDevice(), pool=pool, copy_thread=copy_thread
            )
            t0 = time.perf_counter()
            for i in range(args.saves):
                tracker.submit(f"r{i}", f"fast{rep}-{copy_thread}-{i}", tensors[i % len(tensors)])
            _drain_saves(tracker, set())
            samples.tracker_s.append(time.perf_counter() - t0)
            tracker.close()
        items = [(f"direct{rep}-{i}", tensors[i % len(tensors)].clone()) for i in range(args.saves)]
        t0 = time.perf_counter()
        runtime.run(fast.put(items))
        direct_s.append(time.perf_counter() - t0)
    n = args.saves
    direct_med = statistics.median(direct_s)
    out: dict[str, Any] = {}
    for copy_thread, m in modes.items():
        out["saver_cpu" if copy_thread else "saver_cpu_sync"] = {
            "copy_thread": copy_thread,
            "saves": n,
            "value_bytes": numel * 4,
            "put_latency_ms": latency_ms,
            "submit_p50_us": _us(_pct(m.submit, 50)),
            "submit_p99_us": _us(_pct(m.submit, 99)),
            "submit_max_us": _us(max(m.submit)),
            "submit_p99_us_median_of_runs": _us(statistics.median(m.p99_per_run)),
            "flush_p50_us": _us(_pct(m.flush, 50)),
            "flush_p99_us": _us(_pct(m.flush, 99)),
            "bare_runtime_submit_p50_us": _us(_pct(m.bare, 50)),
            "bare_runtime_submit_p99_us": _us(_pct(m.bare, 99)),
            "poll_p50_us": _us(_pct(m.poll, 50)),
            "poll_p99_us": _us(_pct(m.poll, 99)),
            "request_reported_after_ms_p50": round(_pct(m.report, 50) * 1e3, 1) if m.report else None,
            "tracker_saves_per_s_no_latency": round(n / statistics.median(m.tracker_s)),
            "batch_put_saves_per_s_no_latency": round(n / direct_med),
        }
    return out


# -- CUDA ----------------------------------------------------------------------------------------------
class _TimedCuda(CudaDevice):
    """The loader's device with CUDA events around each copy it issues on its side stream."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def copy(self, pairs: CopyPairs, *, after: Event | None = None) -> Event:
        spin(self.stream)  # the span is the copy's device time, not the host's time to issue it
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(self.stream)
        event = super().copy(pairs, after=after)
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self.stream)
        self.spans.append((start, end))
        return event


def _matmuls(a: torch.Tensor, count: int) -> torch.Tensor:
    for _ in range(count):
        a = torch.mm(a, a)
        a = a / a.norm()
    return a


def _bench_gpu(runtime: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    store = _open(runtime, "memory://")
    device = _TimedCuda()
    pool = PinnedPool(max(args.pool, 2 * max(args.gpu_sizes)), device=device)
    loader = StreamLoader(store, runtime=runtime, device=device, pool=pool)
    h2d: list[dict[str, Any]] = []
    for size in args.gpu_sizes:
        value = torch.randint(0, 255, (size,), dtype=torch.uint8)
        runtime.run(store.put([(f"gpu{size}", value)]))
        pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(value)
        dst = torch.empty(size, dtype=torch.uint8, device=device.device)
        raw_ms, loader_ms = [], []
        for _ in range(args.repeat):
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            spin(torch.cuda.current_stream())  # as for the loader's copy: device time only
            start.record()
            dst.copy_(pinned, non_blocking=True)
            end.record()
            end.synchronize()  # type: ignore[no-untyped-call]
            raw_ms.append(start.elapsed_time(end))
            device.spans.clear()
            loader.submit(f"gpu{size}", TensorSpec((size,), torch.uint8))
            (result,) = _next_results(loader)
            if not result.ok:
                raise RuntimeError(f"benchmark load failed: {result.failure}: {result.detail}")
            s, e = device.spans[-1]
            loader_ms.append(s.elapsed_time(e))
            del result
        raw, through = statistics.median(raw_ms), statistics.median(loader_ms)
        h2d.append(
            {
                "bytes": size,
                "raw_pinned_GBps": round(size / raw / 1e6, 2),
                "loader_GBps": round(size / through / 1e6, 2),
                "loader_vs_raw": round(raw / through, 3),
            }
        )

    # Overlap: a load's H2D issued while matmuls are queued on the default stream.
    size = max(args.gpu_sizes)
    a = torch.randn(4096, 4096, device=device.device)
    compute_ms, copy_ms, step_ms = [], [], []
    for _ in range(args.repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _matmuls(a, args.matmuls)
        torch.cuda.synchronize()
        compute_ms.append((time.perf_counter() - t0) * 1e3)

        loader.submit(f"gpu{size}", TensorSpec((size,), torch.uint8))
        _poll_until(lambda: bool(loader._fetched))  # fetched into staging; the copy is issued by poll()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _next_results(loader)
        torch.cuda.synchronize()
        copy_ms.append((time.perf_counter() - t0) * 1e3)

        loader.submit(f"gpu{size}", TensorSpec((size,), torch.uint8))
        _poll_until(lambda: bool(loader._fetched))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _matmuls(a, args.matmuls)
        _next_results(loader)
        torch.cuda.synchronize()
        step_ms.append((time.perf_counter() - t0) * 1e3)
    compute, copy, step = (statistics.median(x) for x in (compute_ms, copy_ms, step_ms))
    loader.close()
    return {
        "device": torch.cuda.get_device_name(device.device),
        "h2d": h2d,
        "overlap": {
            "bytes": size,
            "compute_ms": round(compute, 2),
            "copy_ms": round(copy, 2),
            "overlapped_step_ms": round(step, 2),
            "serial_ms": round(compute + copy, 2),
            "step_vs_max": round(step / max(compute, copy), 3),
        },
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    """Run every part that this machine can run; return the figures."""
    previous = sys.getswitchinterval()
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    runtime = Runtime(name="bench-transfer").start()
    try:
        out: dict[str, Any] = {
            "machine": {
                "cuda": torch.cuda.is_available(),
                "uvloop": runtime.uses_uvloop,
                "switch_interval_s": sys.getswitchinterval(),
            },
            "repeat": args.repeat,
            "loader_cpu": _bench_loader(runtime, args),
            "prefix_cpu": _bench_prefix(runtime, args),
            **_bench_saver(runtime, args),
        }
        out["gpu"] = _bench_gpu(runtime, args) if torch.cuda.is_available() else "not run: no CUDA device"
        return out
    finally:
        runtime.close()
        sys.setswitchinterval(previous)


def _print_human(result: dict[str, Any]) -> None:
    for section in ("loader_cpu", "prefix_cpu", "saver_cpu", "saver_cpu_sync"):
        print(f"{section}:")
        for key, value in result[section].items():
            print(f"  {key:<38} {value}")
    gpu = result["gpu"]
    if isinstance(gpu, str):
        print(f"gpu: {gpu}")
        return
    print(f"gpu ({gpu['device']}):")
    for row in gpu["h2d"]:
        print(
            f"  h2d {row['bytes'] >> 20:>5} MiB  raw {row['raw_pinned_GBps']:>7} GB/s  loader "
            f"{row['loader_GBps']:>7} GB/s  ratio {row['loader_vs_raw']}"
        )
    for key, value in gpu["overlap"].items():
        print(f"  overlap {key:<30} {value}")


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_human(result)
    return 0
