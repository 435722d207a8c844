"""The KV connector on a hybrid model in vLLM's real engine, with vLLM's hybrid KV cache manager on.

A tiny Gemma-3-style model (three sliding-window layers, window 64 tokens = 2 blocks, and one
full-attention layer): vLLM gives each layer kind its own KV cache groups from one block pool, frees a
sliding-window group's blocks once they leave the window, and puts its null block in their place. Engine 1
computes and saves; a fresh engine 2 loads. Checked byte for byte against a connector-less reference engine:
every full-attention block, and every sliding-window block engine 2 holds (those inside the window at the
cut, which is what the next token reads); engine 2 holds every such block, and vLLM counted the whole hit as
external.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import assert_idle, generate

pytestmark = pytest.mark.vllm

WINDOW_BLOCKS = 2  # the model's 64-token window in 32-token blocks
rng = random.Random(7)
HEAD = [rng.randrange(5, 1000) for _ in range(160)]
PROMPTS = [HEAD + [rng.randrange(5, 1000) for _ in range(100)] for _ in range(3)]  # 8 full blocks each
FULL_BLOCKS = len(PROMPTS[0]) // BLOCK_SIZE


@pytest.fixture(scope="module")
def hybrid_model() -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model("hybrid")


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_model: Path) -> Iterator[dict[str, Any]]:
    llm = make_llm(hybrid_model)
    try:
        probe = Probe(llm)
        kinds = {kind for kind, _ in probe.kv_groups()}
        assert kinds == {"SlidingWindowSpec", "FullAttentionSpec"}, kinds  # the hybrid manager is on
        tokens = generate(llm, PROMPTS)
        yield {
            "tokens": tokens,
            "kv": [probe.prompt_kv_by_group(p) for p in PROMPTS],
            "groups": probe.kv_groups(),
        }
    finally:
        close_llm(llm)


def test_a_hybrid_models_kv_is_saved_and_loaded_byte_exact(
    hybrid_model: Path, hybrid_reference: dict[str, Any], engines: list[Any], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    first = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(first)
    assert generate(first, PROMPTS) == hybrid_reference["tokens"]
    assert_idle(Probe(first))
    close_llm(first)
    engines.remove(first)

    second = make_llm(hybrid_model, kv=kv_config(backend_url=url))
    engines.append(second)
    probe = Probe(second)
    worker = probe.kv_worker_connector().worker_side
    assert worker.windowed
    for prompt, want_tokens in zip(PROMPTS, hybrid_reference["tokens"], strict=True):
        assert generate(second, [prompt]) == [want_tokens]  # one at a time: each loads its own prefix
    assert worker.loader.loaded > 0 and not worker.loader.failures
    metrics = probe.metrics()
    # Prompt 1 loads all its full blocks; prompts 2 and 3 hit the shared head locally where vLLM kept it.
    assert metrics["vllm:external_prefix_cache_hits"] >= FULL_BLOCKS * BLOCK_SIZE

    full_layers = [
        n for kind, names in hybrid_reference["groups"] for n in names if kind == "FullAttentionSpec"
    ]
    window_layers = [
        n for kind, names in hybrid_reference["groups"] for n in names if kind != "FullAttentionSpec"
    ]
    for prompt, want in zip(PROMPTS, hybrid_reference["kv"], strict=True):
        got = probe.prompt_kv_by_group(prompt)
        for b in range(FULL_BLOCKS):
            for name in full_layers:
                g, w = got[b][name], want[b][name]
                assert g is not None and w is not None and torch.equal(g, w), (b, name)
            for name in window_layers:
                g, w = got[b][name], want[b][name]
                if g is not None:  # a window block engine 2 holds: what the reference computed
                    assert w is not None and torch.equal(g, w), (b, name)
        # the blocks the next token reads through the window are there, loaded or computed
        for b in range(FULL_BLOCKS - WINDOW_BLOCKS, FULL_BLOCKS):
            assert all(got[b][name] is not None for name in window_layers), b
    # vLLM's null block (block 0: the sliding-window groups' positions outside the window) never written
    assert all(not cache[0].any() for cache in probe.kv_caches().values())
    assert_idle(probe)

