"""``asyncconn bench kv``: what the KV connector costs vLLM's scheduler and worker, on vLLM's real scheduler.

Everything runs in the offline engine (:mod:`asyncconn_tools.sim.engine`): vLLM 0.32's ``Scheduler`` with the
connector loaded by vLLM's factory, and simulated workers calling the worker-side methods in vLLM's order.

1. ``schedule``: ``--waiting`` requests waiting at once, a store whose every call takes ``--latency``
   (``memory://?latency=2ms``). ``schedule()`` wall time per step with the asynchronous lookup and with the
   blocking one (``sync_lookup``), alternating in the same run, plus the same admission with no connector.
2. ``save``: ``wait_for_save()`` wall time per step with a store taking ``--save-latency`` per call (the
   put itself takes two such calls: ``exists`` then ``put``), for a prefill-heavy workload.
3. ``bpv``: blocks per stored value. A first engine computes and saves prompts of varied lengths, a second
   one loads them: wall time of the second wave's loads, stored keys, tokens loaded and tokens recomputed
   because a partial value is never stored.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes
from asyncconn.url import redact
from asyncconn_tools.bench.measure import summarize

__all__ = ["add_arguments", "bench", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--what",
        type=argtypes.choice_list(("schedule", "save", "bpv")),
        default="schedule,save,bpv",
        help="comma-separated: schedule, save, bpv",
    )
    parser.add_argument("--waiting", type=argtypes.count, default=256, help="waiting requests (schedule)")
    parser.add_argument(
        "--latency", type=argtypes.duration_text, default="2ms", help="store latency per call (schedule)"
    )
    parser.add_argument("--rounds", type=argtypes.count, default=3, help="alternating rounds per comparison")
    parser.add_argument(
        "--save-latency", type=argtypes.duration_text, default="100ms", help="store latency per call (save)"
    )
    parser.add_argument(
        "--save-requests", type=argtypes.count, default=64, help="requests in the save workload"
    )
    parser.add_argument("--backend", default="memory://?latency=200us", help="store for the bpv comparison")
    parser.add_argument(
        "--bpv", type=argtypes.count_list, default="1,2,4,8,16", help="blocks per value to compare"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _sim_env() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


def _url(base: str) -> str:
    """A private store name per engine pair (memory:// shares by name within the process)."""
    if base.startswith("memory://"):
        rest = base.removeprefix("memory://")
        query = rest.partition("?")[2]
        return f"memory://bench-{uuid.uuid4().hex[:8]}" + (f"?{query}" if query else "")
    return base


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 1000 for i in range(length)]


def _spec(url: str, **extra: Any) -> Any:
    from asyncconn_tools.sim.engine import ConnectorSpec

    return ConnectorSpec("AsyncConnKVConnector", "asyncconn.vllm", "kv_both", {"backend_url": url, **extra})


# -- 1. schedule() with lookups -------------------------------------------------------------------------
def _admit(model: Path, waiting: int, kv: Any, gap: float) -> dict[str, Any]:
    """Steps until every request is admitted; schedule() time of each step (ms)."""
    from asyncconn_tools.sim.engine import EngineSim, SimShape

    sim = EngineSim(
        model,
        shape=SimShape(num_blocks=4 * waiting + 64),
        kv=kv,
        max_num_seqs=waiting,
        max_num_batched_tokens=64 * waiting,
        max_model_len=256,
    )
    try:
        for i in range(waiting):
            sim.add_request(f"r{i}", _prompt(i, 48), max_tokens=1)
        times: list[float] = []
        while len(sim.scheduler.running) + len(sim.finish_reasons) < waiting and len(times) < 200:
            record = sim.step()
            times.append(record.schedule_ns / 1e6)
            time.sleep(gap)  # the forward pass the scheduler would wait for
        return {"steps": len(times), "first_ms": times[0], "max_ms": max(times), "per_step_ms": times}
    finally:
        sim.close()


def bench_schedule(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    latency = args.latency
    rows: dict[str, list[dict[str, Any]]] = {"async": [], "blocking": [], "no_connector": []}
    for _ in range(args.rounds):
        # fresh stores: every lookup is a miss, so both sides admit the same way and only lookups differ
        url = _url(f"memory://?latency={latency}")
        rows["async"].append(_admit(model, args.waiting, _spec(url), 0.005))
        url = _url(f"memory://?latency={latency}")
        rows["blocking"].append(_admit(model, args.waiting, _spec(url, sync_lookup=True), 0.005))
        rows["no_connector"].append(_admit(model, args.waiting, None, 0.005))
    out: dict[str, Any] = {"waiting": args.waiting, "latency": latency}
    for name, runs in rows.items():
        every = [t for r in runs for t in r["per_step_ms"]]
        out[name] = {
            "steps_to_admit_all": statistics.median(r["steps"] for r in runs),
            "first_step_ms_median": statistics.median(r["first_ms"] for r in runs),
            "max_step_ms_median": statistics.median(r["max_ms"] for r in runs),
            "step_ms_p50": statistics.median(every),
            "first_step_ms_per_run": [round(r["first_ms"], 2) for r in runs],
        }
    return out


# -- 2. wait_for_save ----------------------------------------------------------------------------------
def bench_save(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from asyncconn_tools.sim.engine import EngineSim, SimShape

    results: dict[str, Any] = {}
    shapes = {
        "sim default (2 layers x 2 heads x 8 ch, 2 KiB/block)": SimShape(num_blocks=1024),
        "4 layers x 4 heads x 64 ch (64 KiB/block)": SimShape(
            num_layers=4, num_kv_heads=4, head_size=32, hidden_size=64, num_blocks=1024
        ),
    }
    # the same workload on a store that answers at once: wait_for_save must not depend on store latency
    cases = [
        (label, shape, latency) for label, shape in shapes.items() for latency in ("0ms", args.save_latency)
    ]
    for label, shape, latency in cases:
        all_calls: list[float] = []
        save_calls: list[float] = []
        blocks: list[int] = []
        for _ in range(args.rounds):
            url = _url(f"memory://?latency={latency}")
            sim = EngineSim(
                model,
                shape=shape,
                kv=_spec(url),
                max_num_seqs=32,
                max_num_batched_tokens=512,
                max_model_len=512,
            )
            connector = sim.workers[0].kv_connector
            original = connector.wait_for_save

            def timed(
                original: Any = original,
                connector: Any = connector,
                all_calls: list[float] = all_calls,
                save_calls: list[float] = save_calls,
                blocks: list[int] = blocks,
            ) -> None:
                meta = connector._get_connector_metadata()
                t0 = time.perf_counter()
                original()
                elapsed = time.perf_counter() - t0
                all_calls.append(elapsed)
                if meta.saves:
                    save_calls.append(elapsed)
                    blocks.append(sum(len(v.positions) for s in meta.saves for v in s.values))

            connector.wait_for_save = timed
            try:
                for i in range(args.save_requests):
                    sim.add_request(f"s{i}", _prompt(1000 + i, 256), max_tokens=8)
                while sim.scheduler.has_requests() or sim.scheduler.requests:
                    record = sim.step()
                    time.sleep(0.005 if record.num_scheduled_tokens else 0.002)
            finally:
                sim.close()
        results[f"{label}, store {latency}"] = {
            "all_steps": summarize(all_calls),
            "steps_with_saves": summarize(save_calls),
            "blocks_saved_per_step_median": statistics.median(blocks) if blocks else 0,
        }
    return results


# -- 3. blocks per value -------------------------------------------------------------------------------
def bench_bpv(model: Path, args: argparse.Namespace) -> dict[str, Any]:
    from asyncconn_tools.sim.engine import EngineSim, SimShape

    shape = SimShape(num_layers=4, num_kv_heads=4, head_size=32, hidden_size=64, num_blocks=2048)
    rng = random.Random(7)
    lengths = [rng.randint(64, 700) for _ in range(32)]
    choices = list(args.bpv)
    runs: dict[int, list[dict[str, float]]] = {b: [] for b in choices}
    for _ in range(args.rounds):
        for bpv in choices:
            url = _url(args.backend)
            prefix = f"bpv{bpv}-{uuid.uuid4().hex[:6]}:"
            spec = _spec(url, kv_blocks_per_value=bpv, key_prefix=prefix)
            kwargs: dict[str, Any] = {
                "shape": shape,
                "max_num_seqs": 32,
                "max_num_batched_tokens": 4096,
                "max_model_len": 1024,
            }
            first = EngineSim(model, kv=spec, **kwargs)
            for i, n in enumerate(lengths):
                first.add_request(f"a{i}", _prompt(i, n), max_tokens=1)
            while first.scheduler.has_requests() or first.scheduler.requests:
                first.step()
                time.sleep(0.001)
            saved = first.workers[0].kv_connector.worker_side.saver.saved
            first.close()
            second = EngineSim(model, kv=spec, **kwargs)
            for i, n in enumerate(lengths):
                second.add_request(f"b{i}", _prompt(i, n), max_tokens=1)
            t0 = time.perf_counter()
            # the load phase: until every request has been admitted (its lookup answered, its load landed)
            while second.scheduler.waiting or second.scheduler.kv_holding_waiting:
                if time.perf_counter() - t0 > 60:
                    raise TimeoutError(f"bpv={bpv}: requests still waiting after 60 s")
                record = second.step()
                if not record.num_scheduled_tokens:
                    time.sleep(0.0005)
            load_s = time.perf_counter() - t0
            while second.scheduler.has_requests() or second.scheduler.requests:
                second.step()
            worker = second.workers[0].kv_connector.worker_side
            prompt_tokens = sum(lengths)
            computed = sum(second.tokens_computed.values()) - len(lengths)  # minus one decode step each
            runs[bpv].append(
                {
                    "keys_saved": saved,
                    "load_phase_ms": load_s * 1e3,
                    "bytes_loaded": worker.loader.loaded_bytes,
                    "mb_per_s": worker.loader.loaded_bytes / load_s / 1e6,
                    "tokens_loaded": prompt_tokens - computed,
                    "tokens_recomputed": computed,
                }
            )
            second.close()
    return {
        "backend": redact(args.backend),
        "prompts": len(lengths),
        "prompt_tokens": sum(lengths),
        "by_bpv": {
            str(b): {k: statistics.median(r[k] for r in rs) for k in rs[0]} for b, rs in runs.items() if rs
        },
    }


def bench(args: argparse.Namespace) -> dict[str, Any]:
    _sim_env()
    from asyncconn_tools.sim.engine import make_model_dir

    model = make_model_dir(Path(tempfile.mkdtemp(prefix="asyncconn-bench-kv-")) / "model")
    wanted = {w.strip() for w in args.what.split(",") if w.strip()}
    out: dict[str, Any] = {}
    if "schedule" in wanted:
        out["schedule"] = bench_schedule(model, args)
    if "save" in wanted:
        out["save"] = bench_save(model, args)
    if "bpv" in wanted:
        out["bpv"] = bench_bpv(model, args)
    return out


def run(args: argparse.Namespace) -> int:
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    result = bench(args)
    if args.json:
        for part in result.get("schedule", {}).values():
            if isinstance(part, dict):
                part.pop("per_step_ms", None)
        print(json.dumps(result, indent=2, default=float))
    else:
        print(json.dumps(result, indent=2, default=float))
    return 0
