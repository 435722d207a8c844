"""What the KV engine tests share: the prompts, greedy generation, and the checks on bytes and leaks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm, token_ids
from tests.engine.conftest import shared_prefix_prompts

PROMPTS = shared_prefix_prompts()
FULL_BLOCKS = len(PROMPTS[0]) // BLOCK_SIZE  # 196 tokens: 6 full blocks, the last 4 tokens computed


def sampling(max_tokens: int = 8) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(max_tokens)))


def cached_by_source(llm: Any) -> dict[str, float]:
    """vLLM's prompt tokens cached, by source (``vllm:prompt_tokens_cached_by_source``), without its own
    prefix cache's (``device``) and the sources at zero."""
    return {
        m.labels["source"]: m.value
        for m in llm.get_metrics()
        if m.name == "vllm:prompt_tokens_cached_by_source"
        and m.labels.get("source") != "device"
        and getattr(m, "value", 0)
    }


def assert_same_kv(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.keys() == b.keys()
        for layer in a:
            assert torch.equal(a[layer], b[layer]), f"block {i} of layer {layer} differs from the reference"


def assert_idle(probe: Probe) -> None:
    """Every connector structure and every KV block back to zero / free once the engine is settled."""
    probe.settle()
    worker = probe.kv_worker_connector()
    assert worker is not None
    assert set(worker.worker_side.held().values()) == {0}, worker.worker_side.held()
    scheduler = probe.kv_scheduler_connector()
    assert set(scheduler.scheduler_side.held().values()) == {0}, scheduler.scheduler_side.held()
    free, total = probe.free_blocks()
    assert free == total


def save_prompts(text_model: Path, url: str, **extra: Any) -> None:
    """Engine 1: compute and save :data:`PROMPTS`, then close (its saves finish first)."""
    llm = make_llm(text_model, kv=kv_config(backend_url=url, **extra))
    try:
        generate(llm, PROMPTS)
        probe = Probe(llm)
        assert_idle(probe)
        assert probe.kv_worker_connector().worker_side.saver.saved > 0
    finally:
        close_llm(llm)


def record_forwards(probe: Probe, events: list[str], monkeypatch: Any) -> None:
    """Append ``"forward"`` to ``events`` each time the engine runs its model (the order tests check)."""
    forward = probe.runner._model_forward

    def model_forward(*args: Any, **kwargs: Any) -> Any:
        events.append("forward")
        return forward(*args, **kwargs)

    monkeypatch.setattr(probe.runner, "_model_forward", model_forward)


def assert_store_serves_cleanly(
    text_model: Path, url: str, engines: list[Any], kv_reference: dict[str, Any]
) -> None:
    """A fresh engine on ``url`` loads :data:`PROMPTS` with no failed load, tokens and KV bytes equal to the
    reference's: what the store holds is good."""
    llm = make_llm(text_model, kv=kv_config(backend_url=url))
    engines.append(llm)
    probe = Probe(llm)
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    loader = probe.kv_worker_connector().worker_side.loader
    assert loader.loaded > 0 and not loader.failures
    assert probe.metrics()["vllm:external_prefix_cache_hits"] > 0
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert_idle(probe)
