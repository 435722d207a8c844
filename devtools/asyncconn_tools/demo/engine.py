"""The parts of ``asyncconn demo`` that run vLLM's real engine (its CPU build here) on an embedded store.

``ec``: an encoder instance E (``ec_producer``) encodes images and saves the embeddings; a prefill/decode
instance PD (``ec_consumer``) gets the same requests with E's ``ec_transfer_params`` (what a proxy forwards)
and loads the embeddings instead of encoding them. ``kv``: engine 1 computes and saves the KV of prompts
sharing a long prefix; a fresh engine 2 loads it. A connector-less reference engine runs the same requests.

Each part checks what the tests check (docs/engine.md): outputs equal the reference; the stored embeddings
are byte for byte what E's encoder returned; PD's encoder ran only for what it did not load; engine 1's KV
blocks (what it saved) and engine 2's loaded ones are byte for byte the reference's; vLLM's own counters
saw the loaded tokens; every connector structure is back to zero. Engines run one at a time, in this process.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any

from asyncconn_tools.engines import (
    BLOCK_SIZE,
    Probe,
    close_llm,
    ec_config,
    ec_params,
    forward_ec_params,
    kv_config,
    make_llm,
    token_ids,
)
from asyncconn_tools.tiny_models import IMAGE_SIZE, build_model

__all__ = ["ec_part", "kv_part"]

_IMAGES = 6
#: Long enough that the other requests' prefetches are reported while the request an idle PD released to its
#: encoder is still decoding: when it finishes first, PD idles again and releases the next one (docs/ec.md).
_EC_SAMPLING = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def _idle(counters: dict[str, int]) -> bool:
    return all(v == 0 for v in counters.values())


def ec_part(backend_url: str, workdir: Path) -> dict[str, Any]:
    """E -> PD for images over ``backend_url``; returns the summary ``asyncconn demo`` prints."""
    import numpy as np
    import torch
    from PIL import Image
    from vllm import SamplingParams

    model = build_model("vision", progress=_say)
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8))
        for _ in range(_IMAGES)
    ]
    requests = [
        {"prompt": f"w{10 + i} w11 w12 w13", "multi_modal_data": {"image": image}}
        for i, image in enumerate(images)
    ]

    def run(role: str | None, sampling: Any) -> dict[str, Any]:
        _say(f"EC: starting {'the reference engine' if role is None else role} (vLLM, in process)")
        ec = None if role is None else ec_config(role, backend_url=backend_url, key_prefix="demo-ec:")
        llm = make_llm(model, ec=ec, max_model_len=512)
        try:
            probe = Probe(llm)
            started = time.perf_counter()
            with probe.encoder_outputs() as encoded:
                outputs = llm.generate(requests, sampling)
            probe.settle()
            probe.ec_saves_done()
            out: dict[str, Any] = {
                "tokens": token_ids(outputs),
                "params": ec_params(outputs),
                "encoded": encoded,
                "seconds": time.perf_counter() - started,
            }
            if role is not None:
                worker = probe.ec_worker_connector().worker_side
                worker.poll()
                scheduler = probe.ec_scheduler_connector().scheduler_side
                out["idle"] = _idle(scheduler.held()) and _idle(worker.held())
                stats = scheduler.totals()
                out["released"] = stats["encode_stalled"] + stats["encode_budget"]
                out["loaded"] = worker.loader.loaded if worker.loader else 0
                out["loaded_bytes"] = worker.loader.loaded_bytes if worker.loader else 0
                out["saved"] = worker.saver.saved if worker.saver else 0
                if worker.saver is not None:
                    out["stored"] = _read_stored(worker, out["params"])
            return out
        finally:
            close_llm(llm)

    reference = run(None, SamplingParams(**_EC_SAMPLING))
    e = run("ec_producer", SamplingParams(**_EC_SAMPLING))
    pd = run("ec_consumer", [forward_ec_params(p, **_EC_SAMPLING) for p in e["params"]])
    stored_ok = len(e["stored"]) == _IMAGES and all(
        value is not None and any(value.shape == t.shape and torch.equal(value, t) for t in e["encoded"])
        for value in e["stored"]
    )
    encoded_on_pd = len(pd["encoded"])
    return {
        "title": "EC: encoder instance (E) -> prefill/decode instance (PD), vLLM's real engine",
        "figures": {
            "images": _IMAGES,
            "images encoded on E": len(e["encoded"]),
            "embeddings saved by E": e["saved"],
            "embeddings loaded by PD": pd["loaded"],
            "bytes loaded by PD": pd["loaded_bytes"],
            "images encoded on PD": encoded_on_pd,
            "images PD sent to its encoder (stalled / budget)": pd["released"],
            "PD generate() seconds (6 requests)": round(pd["seconds"], 3),
            "reference generate() seconds (6 requests, all encoded)": round(reference["seconds"], 3),
        },
        "checks": {
            "E handed every request over with ec_transfer_params": all(e["params"]),
            "the store holds exactly what E's encoder returned (bytes)": stored_ok,
            "PD's greedy tokens equal the reference engine's": pd["tokens"] == reference["tokens"],
            "PD loaded every image it did not encode": pd["loaded"] == _IMAGES - encoded_on_pd,
            # Workers that never see an empty step (vLLM's CPU engine) cannot move a prefetch on an idle
            # engine, so PD releases a waiting request to its encoder whenever it runs out of work
            # (docs/ec.md): the first to arrive, and any whose prefetch is still in flight when that happens
            # again. Every other image must have been loaded; an encode for any other reason fails this.
            "PD's encoder ran for a stored image only on a stalled engine's release": encoded_on_pd
            == pd["released"],
            "PD loaded most images (loaded > encoded)": pd["loaded"] > encoded_on_pd,
            "every EC connector structure is back to zero (E and PD)": bool(e["idle"] and pd["idle"]),
        },
    }


def _read_stored(worker: Any, params: list[Any]) -> list[Any]:
    hashes = [h for p in params if p for h in p.get("asyncconn_saving", [])]
    return list(worker.runtime.run(worker.store.get([worker.key(h) for h in hashes]), 30))


def _kv_mismatch(
    got: list[list[dict[str, Any]]], want: list[list[dict[str, Any]]], full: int
) -> tuple[int, int]:
    """``(missing, differing)`` blocks of ``got`` against ``want``, prompt by prompt, for prompts of ``full``
    whole blocks: a block is missing when the engine no longer caches it, differing when any layer's bytes
    differ. Counted rather than judged at the first one, so that a failed check says how far off it was."""
    import torch

    missing = differing = 0
    for blocks, reference in zip(got, want, strict=True):
        missing += full - len(blocks)
        for a, b in zip(blocks, reference, strict=False):
            differing += any(not torch.equal(a[layer], b[layer]) for layer in b)
    return missing, differing


def kv_part(backend_url: str, workdir: Path) -> dict[str, Any]:
    """Engine 1 saves shared-prefix KV, a fresh engine 2 loads it; returns the demo summary."""
    from vllm import SamplingParams

    model = build_model("text", progress=_say)
    rng = random.Random(1)
    head = [rng.randrange(5, 1000) for _ in range(6 * BLOCK_SIZE)]
    prompts = [head + [rng.randrange(5, 1000) for _ in range(100)] for _ in range(4)]
    full = len(prompts[0]) // BLOCK_SIZE
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def run(name: str, kv: Any) -> dict[str, Any]:
        _say(f"KV: starting {name} (vLLM, in process)")
        llm = make_llm(model, kv=kv)
        try:
            probe = Probe(llm)
            started = time.perf_counter()
            tokens = token_ids(llm.generate(inputs, sampling))
            seconds = time.perf_counter() - started
            probe.settle()
            out: dict[str, Any] = {
                "tokens": tokens,
                "kv": [probe.prompt_kv(p) for p in prompts],
                "metrics": probe.metrics(),
                "seconds": seconds,
            }
            worker = probe.kv_worker_connector()
            if worker is not None:
                side = worker.worker_side
                out["idle"] = _idle(side.held()) and _idle(
                    probe.kv_scheduler_connector().scheduler_side.held()
                )
                out["saved"] = side.saver.saved
                out["loaded"] = side.loader.loaded
                out["loaded_bytes"] = side.loader.loaded_bytes
                out["blocks_per_value"] = side.keys.blocks_per_value
            return out
        finally:
            close_llm(llm)

    config = {"backend_url": backend_url, "key_prefix": "demo-kv:"}
    reference = run("the reference engine", None)
    first = run("engine 1 (saves)", kv_config(**config))
    second = run("engine 2 (loads)", kv_config(**config))
    reference_missing, _ = _kv_mismatch(reference["kv"], reference["kv"], full)
    first_missing, first_differing = _kv_mismatch(first["kv"], reference["kv"], full)
    second_missing, second_differing = _kv_mismatch(second["kv"], reference["kv"], full)
    external = int(second["metrics"].get("vllm:external_prefix_cache_hits", 0))
    local = int(second["metrics"].get("vllm:prefix_cache_hits", 0))
    # Only whole values are stored: a prompt's tail of fewer blocks than a value is computed again.
    stored = full // second["blocks_per_value"] * second["blocks_per_value"] * BLOCK_SIZE
    return {
        "title": "KV: engine 2 reuses engine 1's KV from the store, vLLM's real engine",
        "figures": {
            "prompts (sharing a 192-token prefix)": len(prompts),
            "blocks per value (kv_blocks_per_value)": second["blocks_per_value"],
            "KV values saved by engine 1": first["saved"],
            "KV values loaded by engine 2": second["loaded"],
            "bytes loaded by engine 2": second["loaded_bytes"],
            "tokens vLLM counted as loaded (external prefix cache hits)": external,
            "KV blocks not cached (reference / engine 1 / engine 2)": (
                f"{reference_missing} / {first_missing} / {second_missing}"
            ),
            "KV blocks differing from the reference's (engine 1 / 2)": (
                f"{first_differing} / {second_differing}"
            ),
            "engine 2 generate() seconds": round(second["seconds"], 3),
            "reference generate() seconds (all computed)": round(reference["seconds"], 3),
        },
        "checks": {
            "engine 1's greedy tokens equal the reference's": first["tokens"] == reference["tokens"],
            "engine 2's greedy tokens equal the reference's": second["tokens"] == reference["tokens"],
            "every whole stored value of every prompt came from the store or from another prompt's": (
                stored > 0 and external + local == len(prompts) * stored and external >= stored
            ),
            "engine 1's KV blocks (what it saved) are byte for byte the reference's": (
                reference_missing == first_missing == first_differing == 0
            ),
            "engine 2's KV blocks are byte for byte the reference's": (
                reference_missing == second_missing == second_differing == 0
            ),
            "every KV connector structure is back to zero (both engines)": bool(
                first["idle"] and second["idle"]
            ),
        },
    }
