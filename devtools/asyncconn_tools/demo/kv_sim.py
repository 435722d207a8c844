"""The KV half of ``asyncconn demo``: a second wave of requests reuses KV a first wave saved to the store.

Two engines (vLLM's real scheduler with simulated workers, :mod:`asyncconn_tools.sim`) share one store URL and
nothing else. The first computes requests that share a few long prefixes and saves their KV; the second gets
new requests with the same prefixes and different endings, looks the prefixes up, loads them and computes
only the rest. The demo reports tokens loaded versus recomputed and checks, byte for byte, that the KV the
second engine loaded into its cache equals the KV the first engine computed for the same tokens.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from asyncconn.url import redact

__all__ = ["run_kv_demo"]


def _tokens(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 31 + 11) % 1000 for i in range(length)]


def run_kv_demo(
    backend_url: str,
    *,
    num_requests: int = 8,
    num_prefixes: int = 2,
    prefix_tokens: int = 128,
    suffix_tokens: int = 24,
    max_tokens: int = 4,
    blocks_per_value: int = 1,
    model_dir: str | Path | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """Run both waves against ``backend_url`` and return what happened (JSON-serializable).

    Keys of the result: ``backend_url`` (credentials redacted), ``blocks_per_value``, ``wave1`` and ``wave2``
    (each ``requests``, ``prompt_tokens``, ``tokens_loaded_from_store``, ``tokens_from_local_prefix_cache``,
    ``tokens_recomputed``),
    ``kv_bytes_equal`` (every loaded token's KV equals what wave 1 computed, on every layer),
    ``bytes_compared`` and ``seconds``. Raises :class:`asyncconn.exceptions.AsyncConnError` subclasses for a
    bad URL or an unreachable store (at engine start-up).
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, SimShape, make_model_dir

    started = time.monotonic()
    model = make_model_dir(Path(model_dir) if model_dir else Path(tempfile.mkdtemp(prefix="asyncconn-demo-")))
    spec = ConnectorSpec(
        "AsyncConnKVConnector",
        "asyncconn.vllm",
        "kv_both",
        {"backend_url": backend_url, "kv_blocks_per_value": blocks_per_value},
    )
    shape = SimShape(num_blocks=max(256, num_requests * ((prefix_tokens + suffix_tokens) // 16 + 4)))
    prefixes = [_tokens(1000 + p, prefix_tokens) for p in range(num_prefixes)]
    engine_kw: dict[str, Any] = {
        "shape": shape,
        "kv": spec,
        "max_num_seqs": max(num_requests, 1),
        "max_model_len": prefix_tokens + suffix_tokens + max_tokens + 16,
    }
    engine_kw["max_num_batched_tokens"] = min(2048, engine_kw["max_num_seqs"] * engine_kw["max_model_len"])

    def prompts(wave: int) -> dict[str, list[int]]:
        return {
            f"w{wave}-{i}": prefixes[i % num_prefixes] + _tokens(wave * 100 + i, suffix_tokens)
            for i in range(num_requests)
        }

    # Wave 1: compute and save; keep each prefix's computed KV to compare the loads against.
    computed: dict[int, dict[str, torch.Tensor]] = {}
    first = prompts(1)
    # The first engine stays up (idle) while the second runs: two instances sharing one store. It must on a
    # Mooncake store, whose values live in the memory segments its live clients contribute: closing the
    # first engine's client would take the values it saved with it.
    with contextlib.ExitStack() as engines:
        first_sim = engines.enter_context(EngineSim(model, **engine_kw))
        for rid, tokens in first.items():
            first_sim.add_request(rid, tokens, max_tokens=max_tokens)
        _run(first_sim, timeout, lambda: _capture(first_sim, first, num_prefixes, prefix_tokens, computed))
        wave1 = _summary(first_sim, first, max_tokens)
        wave2, checks = _second_wave(
            engines.enter_context(EngineSim(model, **engine_kw)),
            prompts(2),
            computed,
            num_prefixes,
            max_tokens,
            timeout,
        )
    return {
        "backend_url": redact(backend_url),
        "blocks_per_value": blocks_per_value,
        "wave1": wave1,
        "wave2": wave2,
        "kv_bytes_equal": bool(checks["equal"]) and int(checks["bytes"]) > 0,
        "bytes_compared": int(checks["bytes"]),
        "seconds": round(time.monotonic() - started, 3),
    }


def _second_wave(
    sim: Any,
    second: dict[str, list[int]],
    computed: dict[int, dict[str, torch.Tensor]],
    num_prefixes: int,
    max_tokens: int,
    timeout: float,
) -> tuple[dict[str, int], dict[str, Any]]:
    """Same prefixes, new endings, on a second engine; loaded blocks are checked the step they arrive."""
    checks: dict[str, Any] = {"equal": True, "bytes": 0}
    for rid, tokens in second.items():
        sim.add_request(rid, tokens, max_tokens=max_tokens)

    def verify() -> None:
        out = sim.steps[-1].kv_connector_output
        for rid in (out.finished_recving or ()) if out is not None else ():
            request = sim.scheduler.requests[rid]
            loaded = request.num_computed_tokens
            reference = computed.get(int(rid.split("-")[1]) % num_prefixes)
            if reference is None:
                checks["equal"] = False
                continue
            for layer, tensor in sim.read_kv(rid).items():
                same = torch.equal(tensor, reference[layer][:loaded])
                checks["equal"] = bool(checks["equal"]) and same
                checks["bytes"] = int(checks["bytes"]) + tensor.numel() * tensor.element_size()

    _run(sim, timeout, verify)
    wave2 = _summary(sim, second, max_tokens)
    return wave2, checks


def _run(sim: Any, timeout: float, after_step: Any) -> None:
    deadline = time.monotonic() + timeout
    while sim.scheduler.has_requests() or sim.scheduler.requests:
        if time.monotonic() > deadline:
            raise TimeoutError(f"demo engine not idle after {timeout:g}s")
        record = sim.step()
        after_step()
        if not record.num_scheduled_tokens:
            time.sleep(0.002)  # idle step: let in-flight store calls progress, as a real engine's loop does


def _capture(
    sim: Any, prompts: dict[str, list[int]], num_prefixes: int, prefix_tokens: int, out: dict[int, Any]
) -> None:
    for request in sim.scheduler.running:
        group = int(request.request_id.split("-")[1]) % num_prefixes
        if group not in out and request.num_computed_tokens >= prefix_tokens:
            out[group] = {k: v[:prefix_tokens].clone() for k, v in sim.read_kv(request.request_id).items()}


def _summary(sim: Any, prompts: dict[str, list[int]], max_tokens: int) -> dict[str, int]:
    """Prompt tokens by where their KV came from: the store, the engine's own prefix cache, or compute."""
    prompt_tokens = sum(len(t) for t in prompts.values())
    computed = sum(sim.tokens_computed[rid] for rid in prompts)
    # every request also computes max_tokens - 1 decode tokens after its prompt
    prompt_computed = computed - len(prompts) * (max_tokens - 1)
    from_store = 0
    for record in sim.steps:
        out = record.kv_connector_output
        stats = out.kv_connector_stats if out is not None else None
        if stats is not None:
            from_store += int(stats.data.get("tokens_loaded", 0))
    return {
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "tokens_loaded_from_store": from_store,
        "tokens_from_local_prefix_cache": prompt_tokens - prompt_computed - from_store,
        "tokens_recomputed": prompt_computed,
    }


def demo_part(backend_url: str, workdir: Path) -> dict[str, Any]:
    """The KV part of ``asyncconn demo``: :func:`run_kv_demo` as a titled summary with named checks."""
    result = run_kv_demo(backend_url, model_dir=workdir / "kv-model")
    w1, w2 = result["wave1"], result["wave2"]
    return {
        "title": "KV: wave 1 computes and saves; wave 2 (same prefixes, a second engine) loads",
        "figures": {
            "wave 1 requests / prompt tokens": f"{w1['requests']} / {w1['prompt_tokens']}",
            "wave 1 tokens computed": w1["tokens_recomputed"],
            "wave 2 requests / prompt tokens": f"{w2['requests']} / {w2['prompt_tokens']}",
            "wave 2 tokens loaded from the store": w2["tokens_loaded_from_store"],
            "wave 2 tokens recomputed": w2["tokens_recomputed"],
            "KV bytes compared": result["bytes_compared"],
            "wall time (s)": result["seconds"],
        },
        "checks": {
            "every loaded KV byte equals what wave 1 computed": result["kv_bytes_equal"],
            "wave 2 loaded tokens from the store": w2["tokens_loaded_from_store"] > 0,
        },
    }
