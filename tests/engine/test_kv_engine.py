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

from asyncconn.tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import FULL_BLOCKS, PROMPTS, assert_idle, assert_same_kv, generate
from tests.servers import LookupServerProcess, RedisServer

pytestmark = pytest.mark.vllm


def run_pair(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], **extra: Any
) -> tuple[Probe, dict[str, float]]:
    """Engine 1 computes and saves; a fresh engine 2 loads. Returns engine 2's probe and metrics."""
    first = make_llm(text_model, kv=kv_config(**extra))
    engines.append(first)
    assert generate(first, PROMPTS) == kv_reference["tokens"]
    probe1 = Probe(first)
    assert_idle(probe1)
    saver = probe1.kv_worker_connector().worker_side.saver
    assert saver.saved > 0 and not saver.failures
    close_llm(first)
    engines.remove(first)

    second = make_llm(text_model, kv=kv_config(**extra))
    engines.append(second)
    assert generate(second, PROMPTS) == kv_reference["tokens"]
    probe = Probe(second)
    assert_idle(probe)
    return probe, probe.metrics()


@pytest.fixture(params=["file", "file-4-blocks-per-value", "redis", "lookup-server"])
def store_config(
    request: pytest.FixtureRequest, tmp_path: Path, redis_server: RedisServer
) -> Iterator[dict[str, Any]]:
    prefix = f"kv-engine-{request.param}:"
    if request.param == "file":
        yield {"backend_url": f"file://{tmp_path / 'store'}"}
    elif request.param == "file-4-blocks-per-value":  # 4 of the 6 full blocks stored, the tail computed
        yield {"backend_url": f"file://{tmp_path / 'store'}", "kv_blocks_per_value": 4}
    elif request.param == "redis":
        yield {"backend_url": redis_server.url, "key_prefix": prefix}
    else:
        server = LookupServerProcess(redis_server.url, key_prefix=prefix, block_size=BLOCK_SIZE).start()
        try:
            yield {"backend_url": redis_server.url, "key_prefix": prefix, "lookup_server": server.endpoint}
        finally:
            server.stop()


def test_a_fresh_engine_loads_the_shared_prefixes_byte_for_byte(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], store_config: dict[str, Any]
) -> None:
    probe, metrics = run_pair(text_model, engines, kv_reference, **store_config)
    bpv = probe.kv_worker_connector().worker_side.keys.blocks_per_value
    assert bpv == store_config.get("kv_blocks_per_value", 1)
    stored = FULL_BLOCKS // bpv * bpv * BLOCK_SIZE  # whole values only: the tail blocks are computed
    # Every stored block came from the store or from blocks this engine had just loaded for another prompt.
    external, local = metrics["vllm:external_prefix_cache_hits"], metrics["vllm:prefix_cache_hits"]
    assert external + local == len(PROMPTS) * stored
    assert external >= stored > 0
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    # file:// on a CPU engine reads values straight into their cache blocks when the page cache holds them
    # (a value it would have to wait for goes through staging); the other stores always go through staging.
    loader = probe.kv_worker_connector().worker_side.loader
    assert loader.loaded > 0
    if "file://" in store_config["backend_url"]:
        assert loader.loaded_in_place > 0
    else:
        assert loader.loaded_in_place == 0
    # Run again, every prompt is in vLLM's own prefix cache (loaded from the store, or computed and saved by
    # this engine): nothing is saved again, not even as far as the store's "exists" check.
    saver = probe.kv_worker_connector().worker_side.saver
    before = (saver.saved, saver.skipped, saver.skipped_existing)
    assert generate(probe.llm, PROMPTS) == kv_reference["tokens"]
    assert_idle(probe)
    assert (saver.saved, saver.skipped, saver.skipped_existing) == before
