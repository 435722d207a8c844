"""The EC part of ``asyncconn demo``: an E and a PD instance over one store, with vLLM's real scheduler.

A stream of multimodal requests with repeated images goes to E (``ec_producer``), which encodes and saves
each image; as each E request finishes, the "proxy" (this function) forwards it to PD (``ec_consumer``, two
simulated workers) with E's ``ec_transfer_params`` -- possibly before E's save has landed, which is the race
the connector closes. PD loads instead of encoding. The summary says what moved and checks that every
embedding PD used is byte-identical to what E stored and that PD's encoder ran for a stored image only
where the connector released a request on a stalled engine: the simulator follows vLLM's V1 runner, which
skips the EC hooks on a step with no tokens, so a request arriving at an idle PD cannot be prefetched for;
it is encoded (never admitted on a load at install that could fail and crash the engine), and its step
starts the prefetches of the requests behind it.

:func:`run_ec_demo` returns the summary as a dict (``title``, ``figures``, ``checks``), so that ``asyncconn
demo`` can print it beside other parts (a KV part follows the same shape).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore

__all__ = ["capture_params", "run_ec_demo"]

_CLASS, _MODULE = "AsyncConnECConnector", "asyncconn.vllm"


def run_ec_demo(
    backend_url: str,
    workdir: Path,
    *,
    requests: int = 24,
    images: int = 6,
    rows: int = 64,
    pd_workers: int = 2,
) -> dict[str, Any]:
    """Run E and PD side by side on ``backend_url``; the model directory goes under ``workdir``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch

    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, MMItem, SimShape, make_model_dir

    shape = SimShape(num_blocks=1024)
    model = make_model_dir(workdir / "model", shape)
    extra = {"backend_url": backend_url, "key_prefix": f"demo-{os.getpid()}-{time.time_ns()}:"}
    prefix = extra["key_prefix"]
    e = EngineSim(model, shape=shape, ec=ConnectorSpec(_CLASS, _MODULE, "ec_producer", extra), max_num_seqs=4)
    pd = None
    try:
        pd = EngineSim(
            model,
            shape=shape,
            ec=ConnectorSpec(_CLASS, _MODULE, "ec_consumer", extra),
            num_workers=pd_workers,
            max_num_seqs=8,
        )
        params = capture_params(e)
        delayed: list[bool] = []
        plan: dict[str, list[Any]] = {}
        prompt_len = 2 * rows + 24
        for i in range(requests):
            first = MMItem(f"img-{i % images}", offset=8, length=rows)
            items = [first]
            if i % 3 == 2:  # every third request shows a second (also repeated) image
                items.append(MMItem(f"img-{(i * 7 + 1) % images}", offset=16 + rows, length=rows))
            if len(items) == 2 and items[0].identifier == items[1].identifier:
                items.pop()
            plan[f"req-{i}"] = items
        tokens = {rid: [(n * 31 + j) % 1000 for j in range(prompt_len)] for n, rid in enumerate(plan)}

        started = time.perf_counter()
        pending = list(plan)
        forwarded: set[str] = set()
        steps = 0
        while pending or e.scheduler.has_requests() or pd.scheduler.has_requests():
            if pending:  # one new request per tick arrives at E
                rid = pending.pop(0)
                e.add_request(rid, tokens[rid], max_tokens=1, mm_items=plan[rid])
            if e.scheduler.has_requests():
                e.step()
            for rid in [r for r in params if r not in forwarded]:  # the proxy: E answered, forward to PD
                forwarded.add(rid)
                pd.add_request(rid, tokens[rid], max_tokens=6, mm_items=plan[rid])
                request = pd.scheduler.requests[rid]
                request.ec_transfer_params = params[rid]
                delayed.append(params[rid] is not None)
            if pd.scheduler.has_requests():
                pd.step()
            steps += 1
            time.sleep(0.0005)  # leave the loop thread the GIL between ticks, as a real engine's I/O does
            if steps > 100_000:
                raise RuntimeError("demo did not finish")
        elapsed = time.perf_counter() - started

        stored = _read_back(backend_url, [prefix + f"img-{i}" for i in range(images)])
        used_ok = True
        for rid, items in plan.items():
            used = pd.embeddings_used(rid)
            for item in items:
                value = stored.get(prefix + item.identifier)
                if value is None or not torch.equal(used[item.identifier], value):
                    used_ok = False
        pd_stats = dict(pd.scheduler.ec_connector.scheduler_side.totals())
        saver = e.workers[0].ec_connector.worker_side.saver
        loaded_bytes = pd_stats.get("loaded_bytes", 0)
        saved_bytes = saver.saved_bytes if saver is not None else 0
        distinct = {item.identifier for items in plan.values() for item in items}
        released = pd_stats.get("encode_stalled", 0) + pd_stats.get("encode_budget", 0)
        figures: dict[str, Any] = {
            "requests": requests,
            "distinct images": len(distinct),
            "items encoded on E": len(e.encoder_runs()),
            "items saved by E": saver.saved if saver is not None else 0,
            "saves skipped (already stored or in flight)": (saver.skipped + saver.skipped_existing)
            if saver is not None
            else 0,
            "PD deferral steps": sum(
                1 for r in pd.steps if any(w in plan for w in r.waiting) and not r.num_scheduled_tokens
            ),
            "PD deferrals (ensure_cache_available -> False)": pd_stats.get("deferrals", 0),
            "PD prefetch hits (admitted after prefetch)": pd_stats.get("admit_prefetched", 0),
            "PD items sent to the encoder (stalled / budget)": released,
            "PD encoder runs": len(pd.encoder_runs()),
            "PD waits for items E announced": pd_stats.get("arrivals_awaited", 0),
            "PD workers": pd_workers,
            "bytes saved by E": saved_bytes,
            "bytes loaded by PD (all workers)": loaded_bytes,
            "wall time (s)": round(elapsed, 3),
            "GB/s moved (saved + loaded, over the wall time)": round(
                (saved_bytes + loaded_bytes) / elapsed / 1e9, 4
            ),
        }
        checks = {
            "every embedding PD used equals what E stored": used_ok,
            "PD's encoder ran for a stored image only on a stalled engine's release": len(pd.encoder_runs())
            <= released,
            "PD loaded most items (prefetch hits > encoder runs)": pd_stats.get("admit_prefetched", 0)
            > len(pd.encoder_runs()),
            "every PD request finished": all(pd.finish_reasons.get(r) == "length" for r in plan),
            "E handed every request over with ec_transfer_params": all(delayed) and len(delayed) == requests,
            "E leak check (requests, queues, encoder cache, KV blocks)": e.leak_check() == [],
            "PD leak check (requests, queues, encoder cache, KV blocks)": pd.leak_check() == [],
            "PD connector holds nothing": not any(
                v for k, v in pd.scheduler.ec_connector.scheduler_side.held().items() if k != "pending_drops"
            ),
        }
        return {"title": "EC: encoder (E) -> prefill/decode (PD)", "figures": figures, "checks": checks}
    finally:
        e.close()
        if pd is not None:
            pd.close()


def capture_params(sim: Any) -> dict[str, Any]:
    """The proxy's view: what E's scheduler returned from ``request_finished`` for each request."""
    connector = sim.scheduler.ec_connector
    original = connector.request_finished
    seen: dict[str, Any] = {}

    def spy(request: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = original(request)
        if delay:
            raise AssertionError("EC request_finished returned True: the request would leak")
        seen[request.request_id] = params
        return delay, params

    connector.request_finished = spy
    return seen


def _read_back(url: str, keys: list[str]) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        store = await TensorStore.open(url)
        try:
            values = await store.get(keys)
        finally:
            await store.close()
        return {k: v for k, v in zip(keys, values, strict=True) if v is not None}

    return get_runtime().run(go(), 30)
