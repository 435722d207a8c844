"""The ``hybrid`` part of ``asyncconn demo``: the KV connector on a hybrid model, vLLM's hybrid manager on.

A tiny Gemma-3-style model (three sliding-window layers of 64 tokens, one full-attention layer): engine 1
computes and saves the KV of prompts sharing a prefix, a fresh engine 2 loads it, a connector-less reference
engine runs the same prompts. Checks: vLLM really runs the hybrid manager (sliding-window and full-attention
KV cache groups); tokens equal the reference's; every full-attention block, and every sliding-window block
engine 2 holds, is byte for byte the reference's; the blocks the next token reads through the window are
there; vLLM's null block was never written; every connector structure is back to zero.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm, token_ids
from asyncconn_tools.tiny_models import MODELS, build_model

__all__ = ["hybrid_part"]


def _say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def hybrid_part(backend_url: str, workdir: Path) -> dict[str, Any]:
    """Engine 1 saves a hybrid model's KV, a fresh engine 2 loads it; returns the demo summary."""
    import torch
    from vllm import SamplingParams

    model = build_model("hybrid", progress=_say)
    window_blocks = MODELS["hybrid"].sliding_window // BLOCK_SIZE
    rng = random.Random(5)
    head = [rng.randrange(5, 1000) for _ in range(5 * BLOCK_SIZE)]
    prompts = [head + [rng.randrange(5, 1000) for _ in range(100)] for _ in range(3)]
    full = len(prompts[0]) // BLOCK_SIZE
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(name: str, kv: Any) -> dict[str, Any]:
        _say(f"hybrid: starting {name} (vLLM, in process)")
        llm = make_llm(model, kv=kv)
        try:
            probe = Probe(llm)
            tokens = [token_ids(llm.generate([{"prompt_token_ids": p}], sampling))[0] for p in prompts]
            probe.settle()
            out: dict[str, Any] = {
                "tokens": tokens,
                "groups": probe.kv_groups(),
                "kv": [probe.prompt_kv_by_group(p) for p in prompts],
                "null_untouched": all(not cache[0].any() for cache in probe.kv_caches().values()),
                "metrics": probe.metrics(),
            }
            worker = probe.kv_worker_connector()
            if worker is not None:
                side = worker.worker_side
                scheduler = probe.kv_scheduler_connector().scheduler_side
                out["idle"] = not any(side.held().values()) and not any(scheduler.held().values())
                out["saved"], out["loaded"] = side.saver.saved, side.loader.loaded
            return out
        finally:
            close_llm(llm)

    config = {"backend_url": backend_url, "key_prefix": "demo-hybrid:"}
    reference = run("the reference engine", None)
    first = run("engine 1 (saves)", kv_config(**config))
    second = run("engine 2 (loads)", kv_config(**config))
    kinds = {kind for kind, _ in reference["groups"]}
    whole = {n for kind, names in reference["groups"] for n in names if kind == "FullAttentionSpec"}
    differing = missing_whole = missing_window = held_window = 0
    for got, want in zip(second["kv"], reference["kv"], strict=True):
        for b in range(full):
            for name, value in got[b].items():
                ref = want[b][name]
                if value is None:
                    missing_whole += name in whole
                    missing_window += name not in whole and b >= full - window_blocks
                    continue
                held_window += name not in whole
                differing += ref is None or not torch.equal(value, ref)
    external = int(second["metrics"].get("vllm:external_prefix_cache_hits", 0))
    return {
        "title": "Hybrid model: engine 2 reuses engine 1's KV, vLLM's hybrid KV cache manager on",
        "figures": {
            "KV cache groups": ", ".join(sorted(kinds)),
            "prompts (sharing a 160-token prefix)": len(prompts),
            "KV values saved by engine 1 / loaded by engine 2": f"{first['saved']} / {second['loaded']}",
            "tokens vLLM counted as loaded (external prefix cache hits)": external,
            "sliding-window blocks engine 2 holds (inside the window)": held_window,
            "blocks differing from the reference's": differing,
        },
        "checks": {
            "vLLM runs the hybrid manager (sliding-window and full-attention groups)": kinds
            == {"SlidingWindowSpec", "FullAttentionSpec"},
            "engine 1's and engine 2's greedy tokens equal the reference's": (
                first["tokens"] == reference["tokens"] == second["tokens"]
            ),
            "engine 2 loaded from the store (vLLM counted external hits)": (
                second.get("loaded", 0) > 0 and external >= full * BLOCK_SIZE
            ),
            "engine 2's full-attention blocks and held window blocks are byte for byte the reference's": (
                differing == 0 and missing_whole == 0 and held_window > 0
            ),
            "the sliding-window blocks the next token reads are there": missing_window == 0,
            "vLLM's null block was never written (both engines)": bool(
                first["null_untouched"] and second["null_untouched"]
            ),
            "every KV connector structure is back to zero (both engines)": bool(
                first["idle"] and second["idle"]
            ),
        },
    }
