"""Figures for a hybrid (sliding-window + full-attention) model in vLLM's real engine, hybrid manager on.

Two questions, on a Gemma-3-style ~100M model (``hybrid-100m``: 10 sliding-window layers of 512 tokens,
2 full-attention layers):

- what a second engine's time to first token is on long prompts another engine computed: recomputed (no
  connector) against loaded by asyncconn over ``file://``, fresh engines in alternating rounds, medians;
- how many bytes the store holds per prompt, against the same model with every layer full attention
  (``hybrid-100m-full``): what a sliding-window group's blocks cost in the store.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncconn_tools.bench.engine_runs import long_prompt_engine, stored_prompts
from asyncconn_tools.engines import Probe, close_llm, kv_config, make_llm

__all__ = ["hybrid_bench"]


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _store_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def hybrid_bench(tokens: int = 4096, prompts: int = 2, rounds: int = 2) -> dict[str, Any]:
    """TTFT recompute vs loaded, and store bytes per prompt against the all-full-attention twin."""
    from vllm import SamplingParams

    from asyncconn_tools.tiny_models import build_model

    texts = stored_prompts(tokens, prompts, seed=11)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine_args = long_prompt_engine(tokens)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-hybrid-"))
    figures: dict[str, Any] = {"prompt tokens": tokens + 17}
    try:
        stores: dict[str, Path] = {}
        for name in ("hybrid-100m", "hybrid-100m-full"):
            model = build_model(name, progress=_say)
            store = stores[name] = workdir / name
            llm = make_llm(model, kv=kv_config(backend_url=f"file://{store}"), **engine_args)
            kinds = sorted({kind for kind, _ in Probe(llm).kv_groups()})
            llm.generate([{"prompt_token_ids": t} for t in texts], one, use_tqdm=False)
            Probe(llm).settle(timeout=600)
            close_llm(llm)
            figures[f"{name}: KV cache groups"] = ", ".join(kinds)
            figures[f"{name}: store bytes per prompt"] = _store_bytes(store) // prompts
        hybrid = build_model("hybrid-100m")

        def timed(make: Callable[[], Any] | None) -> list[float]:
            llm = make_llm(hybrid, kv=None if make is None else make(), **engine_args)
            samples = []
            for text in texts:
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
                samples.append(time.perf_counter() - started)
            hits = Probe(llm).metrics().get("vllm:external_prefix_cache_hits", 0)
            if make is not None and hits < prompts * (tokens // 32) * 32 * 0.99:
                _say(f"only {hits} tokens came from the store")
            close_llm(llm)
            return samples

        configs: dict[str, Callable[[], Any] | None] = {
            "recompute (no connector)": None,
            "asyncconn file://": lambda: kv_config(backend_url=f"file://{stores['hybrid-100m']}"),
        }
        results: dict[str, list[float]] = {name: [] for name in configs}
        for round_ in range(rounds):
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                samples = timed(configs[name])
                _say(f"round {round_ + 1}, {name}: TTFT samples {[round(x, 3) for x in samples]} s")
                results[name].extend(samples)
        recompute = statistics.median(results["recompute (no connector)"])
        for name, samples in results.items():
            median = statistics.median(samples)
            figures[f"hybrid-100m, {name}: TTFT median s"] = round(median, 3)
            figures[f"hybrid-100m, {name}: speed-up vs recompute"] = round(recompute / median, 1)
        full = figures["hybrid-100m-full: store bytes per prompt"]
        figures["store bytes, hybrid / all full attention"] = round(
            figures["hybrid-100m: store bytes per prompt"] / full, 3
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    title = f"Hybrid model: TTFT on {tokens}-token prompts another engine computed ({rounds} rounds)"
    return {"title": title, "figures": figures}
