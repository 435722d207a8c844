"""``asyncconn bench lookup``: what lookups cost the scheduler's thread, and what pipelining buys.

Four measurements, each side by side with its baseline in the same run:

1. ``caller``: submit and poll latency on the calling thread (per call, perf_counter_ns) with a store
   that takes ``--latency`` per call (``memory://?latency=2ms``, direct transport), in scheduler-like
   rounds of ``--waiting`` submits followed by polls until all are answered; the same rounds through
   the naive bridge (one ``run_coroutine_threadsafe`` per lookup, ``Future.done()`` polls) alongside.
2. ``scheduler``: a loop over ``--waiting`` waiting requests; each step asks every waiting request for its
   lookup, admits the answered ones and replaces them. ms per step with the async client (``lookup``,
   with ``--step-gap`` of simulated forward pass between steps) versus a blocking client (``lookup_sync``,
   every lookup waited for) on the same store.
3. ``throughput``: lookups/s through one ``asyncconn lookup-server`` subprocess whose store takes
   ``--service-latency`` per call: a one-at-a-time REQ/REP client speaking the Mooncake framing versus the
   pipelined client (``--window`` lookups in flight), alternating for ``--rounds`` rounds; medians and
   their ratio.
4. ``memory``: Python heap (tracemalloc) for ``--outstanding`` lookups in flight against a server whose
   store never answers in time, and what is left after discarding them all.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from asyncconn.cli import argtypes
from asyncconn.lookup import PREFIX, DirectTransport, LookupClient, ZmqTransport, store_key
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.url import parse_duration
from asyncconn_tools.bench.measure import summarize

__all__ = ["add_arguments", "bench", "run"]

_BLOCK_HASHES = 16  # keys per lookup: a 256-token prompt in 16-token blocks


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--latency",
        type=argtypes.duration_text,
        default="2ms",
        help="store latency per call for caller/scheduler",
    )
    parser.add_argument(
        "--service-latency",
        type=argtypes.duration_text,
        default="1ms",
        help="lookup server's store latency per call",
    )
    parser.add_argument(
        "--waiting", type=argtypes.count, default=256, help="waiting requests per scheduler step"
    )
    parser.add_argument(
        "--rounds", type=argtypes.count, default=40, help="submit/poll rounds for the caller figures"
    )
    parser.add_argument("--steps", type=argtypes.count, default=60, help="async scheduler steps")
    parser.add_argument("--blocking-steps", type=argtypes.count, default=2, help="blocking scheduler steps")
    parser.add_argument(
        "--step-gap", type=argtypes.duration_text, default="5ms", help="simulated forward pass between steps"
    )
    parser.add_argument("--window", type=argtypes.count, default=256, help="pipelined lookups in flight")
    parser.add_argument(
        "--duration",
        type=argtypes.positive_duration,
        default=1.0,
        help="seconds per throughput round and side",
    )
    parser.add_argument(
        "--throughput-rounds", type=argtypes.count, default=3, help="alternating throughput rounds"
    )
    parser.add_argument(
        "--outstanding", type=argtypes.count, default=10_000, help="lookups in flight for memory"
    )
    parser.add_argument("--no-uvloop", action="store_true", help="run the client loop on plain asyncio")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _hashes(i: int) -> list[bytes]:
    return [i.to_bytes(8, "big") + j.to_bytes(24, "big") for j in range(_BLOCK_HASHES)]


# -- 1. caller-thread cost -------------------------------------------------------------------------------
def bench_caller(rt: Runtime, url: str, waiting: int, rounds: int) -> dict[str, Any]:
    client = LookupClient(DirectTransport(url), PREFIX, runtime=rt)
    submits: list[float] = []
    polls: list[float] = []
    clock = time.perf_counter_ns
    try:
        for r in range(rounds):
            ids = [f"c{r}-{i}" for i in range(waiting)]
            keys = [_hashes(i) for i in range(waiting)]
            for rid, k in zip(ids, keys, strict=True):
                t = clock()
                client.submit(rid, k)
                submits.append(clock() - t)
            left = set(ids)
            while left:
                time.sleep(0.001)  # the rest of a scheduler step
                for rid in list(left):
                    t = clock()
                    got = client.poll(rid)
                    polls.append(clock() - t)
                    if got is not None:
                        left.discard(rid)
    finally:
        client.close()
    naive_submits, naive_polls = _naive_caller(rt, url, waiting, rounds)
    return {
        "submit": summarize([s / 1e9 for s in submits]),
        "poll": summarize([s / 1e9 for s in polls]),
        "naive_submit": summarize([s / 1e9 for s in naive_submits]),
        "naive_poll": summarize([s / 1e9 for s in naive_polls]),
        "metrics": client.metrics.snapshot(),
    }


def _naive_caller(rt: Runtime, url: str, waiting: int, rounds: int) -> tuple[list[int], list[int]]:
    """The published trap, same store, same rounds: one ``Runtime.submit`` (run_coroutine_threadsafe) per
    lookup, polled with ``Future.done()``."""
    store = rt.run(TensorStore.open(url))
    submits: list[int] = []
    polls: list[int] = []
    clock = time.perf_counter_ns
    try:
        for _ in range(rounds):
            futures = []
            for i in range(waiting):
                keys = [store_key("", h) for h in _hashes(i)]
                t = clock()
                futures.append(rt.submit(store.exists(keys)))
                submits.append(clock() - t)
            left = set(range(waiting))
            while left:
                time.sleep(0.001)
                for i in list(left):
                    t = clock()
                    done = futures[i].done() and futures[i].result() is not None
                    polls.append(clock() - t)
                    if done:
                        left.discard(i)
    finally:
        rt.run(store.close())
    return submits, polls


# -- 2. a scheduler-like loop ------------------------------------------------------------------------------
def _schedule(
    step: Callable[[str, list[bytes]], int | None], waiting: int, steps: int, gap: float, tag: str
) -> dict[str, Any]:
    queue = [f"{tag}-{i}" for i in range(waiting)]
    keys = {rid: _hashes(i) for i, rid in enumerate(queue)}
    fresh = waiting
    times: list[float] = []
    admitted = 0
    for _ in range(steps):
        t = time.perf_counter()
        still: list[str] = []
        for rid in queue:
            if step(rid, keys[rid]) is None:
                still.append(rid)
            else:
                admitted += 1
                del keys[rid]
                new = f"{tag}-{fresh}"
                keys[new] = _hashes(fresh)
                fresh += 1
                still.append(new)
        queue = still
        times.append(time.perf_counter() - t)
        if gap:
            time.sleep(gap)
    ordered = sorted(times)
    return {
        "steps": steps,
        "ms_per_step_p50": statistics.median(times) * 1e3,
        "ms_per_step_p99": ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))] * 1e3,
        "ms_per_step_max": ordered[-1] * 1e3,
        "admitted": admitted,
    }


def bench_scheduler(rt: Runtime, url: str, args: argparse.Namespace) -> dict[str, Any]:
    gap = parse_duration(args.step_gap)
    client = LookupClient(DirectTransport(url), PREFIX, runtime=rt)
    try:
        async_side = _schedule(client.lookup, args.waiting, args.steps, gap, "a")
        blocking_side = _schedule(client.lookup_sync, args.waiting, args.blocking_steps, 0.0, "b")
    finally:
        client.close()
    return {"async": async_side, "blocking": blocking_side, "step_gap_ms": gap * 1e3}


# -- 3. pipelined vs one-at-a-time through one server -----------------------------------------------------
@contextmanager
def lookup_server(backend: str) -> Iterator[str]:
    """An ``asyncconn lookup-server`` subprocess on a free loopback port; yields its endpoint."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            backend,
            "--bind",
            "tcp://127.0.0.1:*",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"lookup-server did not start (said {line!r}, rc={proc.poll()})")
        yield line.removeprefix("listening on ")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _req_rate(endpoint: str, duration: float) -> float:
    """One REQ socket, one Mooncake lookup at a time (what vLLM's MooncakeStoreConnector client does)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.connect(endpoint)
    frames = encode_mooncake_lookup(_BLOCK_HASHES * 16, _hashes(0))
    try:
        sock.send_multipart(frames)  # warm the connection
        sock.recv()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < duration:
            sock.send_multipart(frames)
            sock.recv()
            n += 1
        return n / (time.perf_counter() - t0)
    finally:
        sock.close(0)
        ctx.term()


def _pipelined_rate(client: LookupClient[int], window: int, duration: float, tag: str) -> float:
    keys = _hashes(1)
    live: list[str] = []
    issued = done = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < duration:
        while len(live) < window:
            rid = f"{tag}-{issued}"
            issued += 1
            client.submit(rid, keys)
            live.append(rid)
        still = []
        for rid in live:
            if client.poll(rid) is None:
                still.append(rid)
            else:
                done += 1
        live = still
        time.sleep(0.0002)  # a caller that spins would starve the loop thread of the GIL
    elapsed = time.perf_counter() - t0
    for rid in live:
        client.discard(rid)
    return done / elapsed


def bench_throughput(rt: Runtime, args: argparse.Namespace) -> dict[str, Any]:
    backend = f"memory://bench-{uuid.uuid4().hex}?latency={args.service_latency}"
    req_rates: list[float] = []
    pipe_rates: list[float] = []
    with lookup_server(backend) as endpoint:
        client = LookupClient(ZmqTransport(endpoint), PREFIX, runtime=rt, timeout=10.0)
        try:
            _pipelined_rate(client, args.window, min(0.3, args.duration), "warm")
            for r in range(args.throughput_rounds):
                req_rates.append(_req_rate(endpoint, args.duration))
                pipe_rates.append(_pipelined_rate(client, args.window, args.duration, f"p{r}"))
        finally:
            client.close()
    req, pipe = statistics.median(req_rates), statistics.median(pipe_rates)
    return {
        "service_latency": args.service_latency,
        "req_rep_lookups_per_s": req,
        "pipelined_lookups_per_s": pipe,
        "ratio": pipe / req if req else None,
        "req_rep_rounds": req_rates,
        "pipelined_rounds": pipe_rates,
        "window": args.window,
        "metrics": client.metrics.snapshot(),
    }


# -- 4. memory for many outstanding lookups ---------------------------------------------------------------
def bench_memory(rt: Runtime, outstanding: int) -> dict[str, Any]:
    with lookup_server(f"memory://hung-{uuid.uuid4().hex}?latency=600s") as endpoint:
        client = LookupClient(ZmqTransport(endpoint), PREFIX, runtime=rt, timeout=600.0)
        try:
            keys = [_hashes(i) for i in range(outstanding)]
            gc.collect()
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            for i in range(outstanding):
                client.submit(f"m{i}", keys[i])
            deadline = time.monotonic() + 30
            while client.held()["inflight"] < outstanding and time.monotonic() < deadline:
                time.sleep(0.01)
            held = tracemalloc.get_traced_memory()[0] - base
            for i in range(outstanding):
                client.discard(f"m{i}")
            while client.held()["inflight"] and time.monotonic() < deadline:
                time.sleep(0.01)
            gc.collect()
            left = tracemalloc.get_traced_memory()[0] - base
            tracemalloc.stop()
            counts = client.held()
        finally:
            client.close()
    return {
        "outstanding": outstanding,
        "keys_per_lookup": _BLOCK_HASHES,
        "heap_bytes_held": held,
        "bytes_per_lookup": held / outstanding if outstanding else 0,
        "heap_bytes_after_discard": left,
        "counts_after_discard": counts,
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    rt = Runtime(name="bench-lookup", use_uvloop=not args.no_uvloop).start()
    url = f"memory://bench-{uuid.uuid4().hex}?latency={args.latency}"
    try:
        out: dict[str, Any] = {
            "machine": f"{os.cpu_count()} CPUs",
            "uvloop": rt.uses_uvloop,
            "store_latency": args.latency,
            "keys_per_lookup": _BLOCK_HASHES,
            "waiting": args.waiting,
        }
        out["caller"] = bench_caller(rt, url, args.waiting, args.rounds)
        out["scheduler"] = bench_scheduler(rt, url, args)
        out["throughput"] = bench_throughput(rt, args)
        out["memory"] = bench_memory(rt, args.outstanding)
        return out
    finally:
        rt.close()


def _report(r: dict[str, Any]) -> str:
    c, s, t, m = r["caller"], r["scheduler"], r["throughput"], r["memory"]
    lines = [
        f"lookup bench ({r['machine']}, uvloop={r['uvloop']}, store latency {r['store_latency']}, "
        f"{r['keys_per_lookup']} keys/lookup)",
        f"  caller submit: p50 {c['submit']['p50_us']:.1f} us  p99 {c['submit']['p99_us']:.1f} us  "
        f"max {c['submit']['max_us']:.0f} us  (n={c['submit']['n']})",
        f"  caller poll:   p50 {c['poll']['p50_us']:.1f} us  p99 {c['poll']['p99_us']:.1f} us  "
        f"max {c['poll']['max_us']:.0f} us  (n={c['poll']['n']})",
        f"  naive bridge (one run_coroutine_threadsafe per lookup): submit p50 "
        f"{c['naive_submit']['p50_us']:.1f} us  p99 {c['naive_submit']['p99_us']:.1f} us  "
        f"max {c['naive_submit']['max_us']:.0f} us; poll p99 {c['naive_poll']['p99_us']:.1f} us",
        f"  scheduler, {r['waiting']} waiting: async {s['async']['ms_per_step_p50']:.2f} ms/step p50 "
        f"({s['async']['ms_per_step_p99']:.2f} p99)  vs blocking "
        f"{s['blocking']['ms_per_step_p50']:.0f} ms/step",
        f"  throughput @ {t['service_latency']} service: pipelined {t['pipelined_lookups_per_s']:.0f}/s vs "
        f"REQ/REP {t['req_rep_lookups_per_s']:.0f}/s = {t['ratio']:.1f}x",
        f"  memory: {m['outstanding']} outstanding hold {m['heap_bytes_held'] / 2**20:.1f} MiB "
        f"({m['bytes_per_lookup']:.0f} B each); after discard {m['heap_bytes_after_discard']} B, "
        f"{m['counts_after_discard']}",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    result = bench(args)
    print(json.dumps(result, indent=2) if args.json else _report(result))
    return 0
