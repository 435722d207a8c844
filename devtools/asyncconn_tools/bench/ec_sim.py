"""``asyncconn bench ec-sim``: the EC connector's costs on vLLM's scheduler thread, inside real sim runs.

Two measurements, each repeated ``rounds`` times, interleaved, in one process:

* **per call**: every ``ensure_cache_available`` and ``has_cache_item`` call vLLM's scheduler makes on the
  PD connector during a stream of multimodal requests (half their images stored, half not) is timed around
  the call (the facade included), on the scheduler thread; p50/p99 over all calls.
* **per step**: PD decoding a batch of text requests, without and with a request whose stored 7 MiB
  embedding (1792 x 1024 float32) is being prefetched while the request waits; ``schedule()`` and runner
  time per step (p50) for plain decode steps, decode steps with the prefetch in flight, and the step that
  installs the embedding (which also prefills the new request's 1824 tokens, so it is reported apart).

On a CPU-only machine the loader's "device" copy is a synchronous host copy made while polling on the
worker thread, so the runner figures there include that copy; on CUDA it is a side-stream copy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes
from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn.vllm.ec.scheduler import ItemState

__all__ = ["add_arguments", "run", "run_ec_bench"]

_CLASS, _MODULE = "AsyncConnECConnector", "asyncconn.vllm"
_BIG_ROWS, _BIG_HIDDEN = 1792, 1024  # 7 MiB of float32
_PHASES = (
    ("decode", "decode steps, no prefetch"),
    ("prefetch", "decode steps, 7 MiB prefetch in flight"),
    ("install", "install step (+1824-token prefill)"),
)


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] if ordered else float("nan")


def _timed(target: Any, name: str, sink: list[float]) -> None:
    """Replace ``target.name`` (an instance attribute) with a wrapper recording each call's ns."""
    original: Callable[..., Any] = getattr(target, name)
    clock = time.perf_counter_ns

    def wrapper(*args: Any) -> Any:
        start = clock()
        result = original(*args)
        sink.append(clock() - start)
        return result

    setattr(target, name, wrapper)


class _StepClock:
    """Sums the time spent inside wrapped connector methods; read and reset once per engine step."""

    def __init__(self) -> None:
        self.ns = 0

    def wrap(self, target: Any, *names: str) -> None:
        clock = time.perf_counter_ns
        for name in names:
            original: Callable[..., Any] = getattr(target, name)

            def wrapper(*args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                start = clock()
                try:
                    return _original(*args, **kwargs)
                finally:
                    self.ns += clock() - start

            setattr(target, name, wrapper)

    def take(self) -> float:
        us, self.ns = self.ns / 1e3, 0
        return us


_SCHEDULER_HOOKS = (
    "ensure_cache_available",
    "has_cache_item",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "take_unavailable_requests",
    "request_finished",
    "get_ec_connector_stats",
)
_WORKER_HOOKS = ("start_load_caches", "save_caches", "get_finished", "build_connector_worker_meta")


def _put(url: str, items: dict[str, Any]) -> None:
    async def go() -> None:
        store = await TensorStore.open(url)
        try:
            await store.put(items.items())
        finally:
            await store.close()

    get_runtime().run(go(), 60)


def _call_costs(model: Path, shape: Any, url: str, extra: dict[str, Any]) -> tuple[list[float], list[float]]:
    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, MMItem, embedding_for

    tag = uuid.uuid4().hex[:6]
    prefix = extra["key_prefix"]
    stored = {
        prefix + f"c{tag}-{i}": embedding_for(f"c{tag}-{i}", 64, shape.hidden_size) for i in range(0, 64, 2)
    }
    _put(url, stored)
    sim = EngineSim(
        model,
        shape=shape,
        ec=ConnectorSpec(_CLASS, _MODULE, "ec_consumer", extra),
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        max_model_len=4096,
    )
    ensure: list[float] = []
    has: list[float] = []
    try:
        connector = sim.scheduler.ec_connector
        _timed(connector, "ensure_cache_available", ensure)
        _timed(connector, "has_cache_item", has)
        for i in range(64):
            items = [MMItem(f"c{tag}-{i}", 8, 64), MMItem(f"c{tag}-{(i + 1) % 64}", 100, 64)]
            sim.add_request(f"r{i}", [(i * 7 + j) % 1000 for j in range(200)], max_tokens=16, mm_items=items)
        while sim.scheduler.has_requests():
            sim.step()
            time.sleep(0.0002)
        if sim.leak_check():
            raise RuntimeError(f"bench run leaked: {sim.leak_check()}")
    finally:
        sim.close()
    return ensure, has


def _step_costs(
    model: Path, shape: Any, url: str, extra: dict[str, Any], with_prefetch: bool
) -> dict[str, list[float]]:
    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, MMItem, embedding_for

    big = f"big-{uuid.uuid4().hex[:8]}"
    if with_prefetch:
        _put(url, {extra["key_prefix"] + big: embedding_for(big, _BIG_ROWS, _BIG_HIDDEN)})
    sim = EngineSim(
        model,
        shape=shape,
        ec=ConnectorSpec(_CLASS, _MODULE, "ec_consumer", extra),
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        max_model_len=4096,
        encoder_cache_size=4096,
    )
    groups: dict[str, list[float]] = {
        f"{phase}_{what}": []
        for phase, _ in _PHASES
        for what in ("sched", "run", "conn_sched", "conn_worker")
    }
    try:
        for i in range(8):
            sim.add_request(f"t{i}", [(i * 11 + j) % 1000 for j in range(32)], max_tokens=120)
        for _ in range(3):  # prefill the text batch: decode steps from here on
            sim.step()
        scheduler = sim.scheduler.ec_connector.scheduler_side
        sched_clock, worker_clock = _StepClock(), _StepClock()
        sched_clock.wrap(sim.scheduler.ec_connector, *_SCHEDULER_HOOKS)
        for w in sim.workers:
            worker_clock.wrap(w.ec_connector, *_WORKER_HOOKS)
        if with_prefetch:
            sim.add_request(
                "big",
                [(5 + j) % 1000 for j in range(_BIG_ROWS + 32)],
                max_tokens=2,
                mm_items=[MMItem(big, 8, _BIG_ROWS)],
            )
        installed = False
        while sim.scheduler.has_requests():
            state = scheduler.item_state(big) if with_prefetch else None
            sched_clock.take()
            worker_clock.take()
            record = sim.step()
            figures = (
                record.schedule_ns / 1e3,
                record.runner_ns / 1e3,
                sched_clock.take(),
                worker_clock.take(),
            )
            if with_prefetch and not installed and "big" in record.num_scheduled_tokens:
                installed = True
                phase = "install"
            elif (
                state in (ItemState.LOOKUP, ItemState.FOUND, ItemState.ORDERED)
                and "big" not in record.running
            ):
                phase = "prefetch"
            elif not with_prefetch and len(record.running) == 8:
                phase = "decode"
            else:
                phase = ""
            if phase:
                for what, value in zip(("sched", "run", "conn_sched", "conn_worker"), figures, strict=True):
                    groups[f"{phase}_{what}"].append(value)
            time.sleep(0.0002)
        if with_prefetch and sim.encoder_runs():
            raise RuntimeError("the 7 MiB item was encoded instead of loaded")
        if sim.leak_check():
            raise RuntimeError(f"bench run leaked: {sim.leak_check()}")
    finally:
        sim.close()
    return groups


def run_ec_bench(backend_url: str, workdir: Path, *, rounds: int = 3) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from asyncconn_tools.sim.engine import SimShape, make_model_dir

    shape = SimShape(hidden_size=_BIG_HIDDEN, num_blocks=2048)
    model = make_model_dir(workdir / "bench-model", shape)
    extra = {"backend_url": backend_url, "key_prefix": f"bench-{uuid.uuid4().hex[:6]}:"}
    ensure: list[float] = []
    has: list[float] = []
    groups: dict[str, list[float]] = {}
    for _ in range(rounds):
        e, h = _call_costs(model, shape, backend_url, extra)
        ensure += e
        has += h
        for with_prefetch in (False, True):
            for name, values in _step_costs(model, shape, backend_url, extra, with_prefetch).items():
                groups.setdefault(name, []).extend(values)
    us = [v / 1e3 for v in ensure]
    hs = [v / 1e3 for v in has]
    med = {k: round(statistics.median(v), 1) if v else float("nan") for k, v in groups.items()}
    figures: dict[str, Any] = {
        "ensure_cache_available calls": len(us),
        "ensure_cache_available p50 / p99 (us)": f"{_pct(us, 0.5):.2f} / {_pct(us, 0.99):.2f}",
        "has_cache_item calls": len(hs),
        "has_cache_item p50 / p99 (us)": f"{_pct(hs, 0.5):.2f} / {_pct(hs, 0.99):.2f}",
        **{
            f"{label}: schedule() / runner p50 (us)": f"{med[p + '_sched']} / {med[p + '_run']}"
            for p, label in _PHASES
        },
        **{
            f"{label}: inside the connector, scheduler / workers p50 (us)": (
                f"{med[p + '_conn_sched']} / {med[p + '_conn_worker']}"
            )
            for p, label in _PHASES
        },
        "steps measured (decode / prefetch / install)": " / ".join(
            str(len(groups[p + "_sched"])) for p, _ in _PHASES
        ),
        "rounds": rounds,
    }
    checks = {
        "ensure_cache_available p99 < 20 us": _pct(us, 0.99) < 20,
        "has_cache_item p99 < 20 us": _pct(hs, 0.99) < 20,
    }
    return {
        "title": "EC bench: scheduler-thread costs (PD, vLLM's real scheduler)",
        "figures": figures,
        "checks": checks,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", metavar="URL", default=None, help="store URL (default: file:// in a temporary directory)"
    )
    parser.add_argument("--rounds", type=argtypes.count, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    from asyncconn_tools.demo.report import print_summary

    with tempfile.TemporaryDirectory(prefix="asyncconn-ec-bench-") as tmp:
        workdir = Path(tmp)
        summary = run_ec_bench(args.backend or f"file://{workdir / 'store'}", workdir, rounds=args.rounds)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_summary(summary)
    failed = [name for name, ok in summary["checks"].items() if not ok]
    if failed:
        print(f"asyncconn bench ec-sim: {len(failed)} check(s) failed", file=sys.stderr)
        return 1
    return 0
