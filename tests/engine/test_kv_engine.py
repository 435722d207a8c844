"""The KV connector in vLLM's real engine: a fresh engine loads another's shared prefixes, byte for byte.

Equal greedy tokens are not proof (KV scaled by 1.001 keeps them), so every test also compares the KV bytes
of each loaded block with the blocks a connector-less reference engine computed, and counts the tokens vLLM
itself says came from the connector (``vllm:external_prefix_cache_hits``).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn.tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm, token_ids
from tests.engine.conftest import shared_prefix_prompts
from tests.servers import LookupServerProcess, RedisServer

pytestmark = pytest.mark.vllm

PROMPTS = shared_prefix_prompts()
FULL_BLOCKS = len(PROMPTS[0]) // BLOCK_SIZE  # 196 tokens: 6 full blocks, the last 4 tokens computed


def sampling(max_tokens: int = 8) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    return token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], sampling(max_tokens)))


@pytest.fixture(scope="module")
def reference(text_model: Path) -> Iterator[dict[str, Any]]:
    """Tokens and per-block KV of :data:`PROMPTS` from an engine without a connector."""
    llm = make_llm(text_model)
    try:
        tokens = generate(llm, PROMPTS)
        probe = Probe(llm)
        kv = [probe.prompt_kv(p) for p in PROMPTS]
        assert all(len(blocks) == FULL_BLOCKS for blocks in kv)
        yield {"tokens": tokens, "kv": kv}
    finally:
        close_llm(llm)


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
    assert set(worker.worker_side.counts().values()) == {0}, worker.worker_side.counts()
    scheduler = probe.kv_scheduler_connector()
    assert set(scheduler.scheduler_side.counts().values()) == {0}, scheduler.scheduler_side.counts()
    free, total = probe.free_blocks()
    assert free == total


def run_pair(
    text_model: Path, engines: list[Any], reference: dict[str, Any], **extra: Any
) -> tuple[Probe, dict[str, float]]:
    """Engine 1 computes and saves; a fresh engine 2 loads. Returns engine 2's probe and metrics."""
    first = make_llm(text_model, kv=kv_config(**extra))
    engines.append(first)
    assert generate(first, PROMPTS) == reference["tokens"]
    probe1 = Probe(first)
    assert_idle(probe1)
    saver = probe1.kv_worker_connector().worker_side.saver
    assert saver.saved > 0 and not saver.failures
    close_llm(first)
    engines.remove(first)

    second = make_llm(text_model, kv=kv_config(**extra))
    engines.append(second)
    assert generate(second, PROMPTS) == reference["tokens"]
    probe = Probe(second)
    assert_idle(probe)
    return probe, probe.metrics()


@pytest.fixture(params=["file", "redis", "lookup-server"])
def store_config(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer
) -> Iterator[dict[str, Any]]:
    prefix = f"kv-engine-{request.param}:"
    if request.param == "file":
        yield {"backend_url": f"file://{tmp_path / 'store'}"}
    elif request.param == "redis":
        yield {"backend_url": redis_server.url, "key_prefix": prefix}
    else:
        server = LookupServerProcess(redis_server.url, key_prefix=prefix, block_size=BLOCK_SIZE).start()
        try:
            yield {"backend_url": redis_server.url, "key_prefix": prefix, "lookup_server": server.endpoint}
        finally:
            server.stop()


def test_a_fresh_engine_loads_the_shared_prefixes_byte_for_byte(
    text_model: Path, engines: list[Any], reference: dict[str, Any], store_config: dict[str, Any]
) -> None:
    probe, metrics = run_pair(text_model, engines, reference, **store_config)
    full = len(PROMPTS) * FULL_BLOCKS * BLOCK_SIZE
    # Every full block came from the store or from blocks this engine had just loaded for another prompt.
    assert metrics["vllm:external_prefix_cache_hits"] + metrics["vllm:prefix_cache_hits"] == full
    assert metrics["vllm:external_prefix_cache_hits"] >= FULL_BLOCKS * BLOCK_SIZE
    for prompt, want in zip(PROMPTS, reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
