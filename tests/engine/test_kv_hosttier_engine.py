"""The host-memory tier in vLLM's real engine: a request whose prefix left vLLM's own cache is loaded from
the worker's tier, byte for byte, without reading the store, and vLLM counts those tokens as ``host``.

Proof that the store was not read: after the first run every stored value is overwritten with zeros (the
files stay, so the scheduler's lookups still find them); a load that reached the store would fail its frame
check and be counted as a failure.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.engines import Probe, kv_config, make_llm
from tests.engine.kvcase import (
    PROMPTS,
    assert_idle,
    assert_same_kv,
    cached_by_source,
    generate,
    save_prompts,
)
from tests.servers import RedisServer

pytestmark = pytest.mark.vllm


def test_a_prefix_evicted_from_vllm_is_loaded_from_the_host_tier(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], tmp_path: Path
) -> None:
    root = tmp_path / "store"
    llm = make_llm(text_model, kv=kv_config(backend_url=f"file://{root}", host_cache_bytes="64MiB"))
    engines.append(llm)
    probe = Probe(llm)
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    assert_idle(probe)
    worker = probe.kv_worker_connector().worker_side
    tier = worker.store.host_tier
    assert tier is not None and tier.stats.entries > 0 and tier.stats.hits == 0
    files = [p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")]  # not its lock
    assert len(files) == tier.stats.entries  # every saved value is held
    for path in files:
        path.write_bytes(bytes(path.stat().st_size))
    assert llm.reset_prefix_cache()  # vLLM's own cache forgets the prompts: they must be loaded

    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    assert_idle(probe)
    loader = worker.loader
    assert loader.loaded > 0 and loader.totals()["loaded_in_place"] > 0 and not loader.failures
    assert tier.stats.hits == loader.loaded and tier.stats.misses == 0
    hit_tokens = probe.metrics()["vllm:external_prefix_cache_hits"]
    assert hit_tokens > 0
    # vLLM counts every one of those tokens as served by host memory, none under the store's ``disk``.
    assert cached_by_source(llm) == {"host": hit_tokens}
    assert probe.kv_scheduler_connector().scheduler_side.held()["host_claims"] == 0  # released
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)


def test_a_cold_tier_over_redis_reads_in_place_and_fills_itself(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], redis_server: RedisServer
) -> None:
    """Behind a host tier over ``redis://``, a value the tier does not hold is read from redis straight into
    the request's blocks too (not through staging), and the tier keeps a copy of it; the next pass is served
    by the tier, in place as well. Byte for byte both times."""
    prefix = f"kv-tier-{uuid.uuid4().hex[:8]}:"
    save_prompts(text_model, redis_server.url, key_prefix=prefix)
    kv = kv_config(backend_url=redis_server.url, key_prefix=prefix, host_cache_bytes="64MiB")
    llm = make_llm(text_model, kv=kv)
    engines.append(llm)
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    tier, loader = worker.store.host_tier, worker.loader
    assert tier is not None
    for rounds in (1, 2):
        if rounds == 2:
            assert llm.reset_prefix_cache()  # vLLM's own cache forgets the prompts: they must be loaded
        assert generate(llm, PROMPTS) == kv_reference["tokens"]
        assert_idle(probe)
        for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
            assert_same_kv(probe.prompt_kv(prompt), want)
        assert loader.loaded > 0 and loader.totals()["loaded_in_place"] == loader.loaded
        assert not loader.failures
        if rounds == 1:  # every value came from redis, through the tier, which kept it
            assert tier.stats.hits == 0 and tier.stats.misses == loader.loaded == tier.stats.entries
        else:  # every value of this pass from the tier
            assert tier.stats.hits == loader.loaded - tier.stats.misses > 0
