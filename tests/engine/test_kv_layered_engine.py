"""A local ``file://`` store in front of ``redis://`` (``local_store_url``) in vLLM's real engine: a fresh
engine on the same host loads a prefix from the local disk, byte for byte, without reading redis.

Proof that redis was not read: its own command counters (``INFO commandstats``) show no read command run
while the second engine served the prompts (its lookups, ``EXISTS``, still go to redis: it is the fleet's
truth); a load that reached redis would have had to run one.

vLLM counts the tokens the local store served as ``disk`` (``vllm:prompt_tokens_cached_by_source``), and
those read from redis under redis's source: all ``disk`` while the local disk holds every value; with half of
its files deleted, both, each at least the tokens of the values its store served.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from asyncconn.transfer import Failure
from asyncconn_tools.engines import Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import PROMPTS, assert_idle, assert_same_kv, cached_by_source, generate
from tests.servers import RedisServer

pytestmark = pytest.mark.vllm

#: Commands that read a value's bytes (any read path of the redis backend).
READS = ("get", "getrange", "mget", "hget", "hmget", "hgetall", "hstrlen", "substr")


def _reads(server: RedisServer) -> int:
    client = redis.Redis(port=server.port)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in READS)


def test_a_fresh_engine_loads_from_the_local_disk_not_from_redis(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    tmp_path: Path,
    fresh_redis: RedisServer,
) -> None:
    local = tmp_path / "local"
    kv = kv_config(backend_url=fresh_redis.url, local_store_url=f"file://{local}")
    first = make_llm(text_model, kv=kv)
    engines.append(first)
    assert generate(first, PROMPTS) == kv_reference["tokens"]
    probe = Probe(first)
    assert_idle(probe)
    saved = probe.kv_worker_connector().worker_side.saver.saved
    assert saved > 0
    files = [p for p in local.rglob("*") if p.is_file() and not p.name.startswith(".")]
    assert len(files) == saved  # every value written to both stores
    close_llm(first)
    engines.remove(first)

    second = make_llm(text_model, kv=kv)
    engines.append(second)
    reads_before = _reads(fresh_redis)
    assert generate(second, PROMPTS) == kv_reference["tokens"]
    probe = Probe(second)
    assert_idle(probe)
    assert _reads(fresh_redis) == reads_before, "a load read redis"
    worker = probe.kv_worker_connector().worker_side
    layered = worker.store.layered
    assert layered is not None
    assert worker.loader.loaded > 0 and not worker.loader.failures
    assert layered.stats.local_misses == 0 and layered.stats.fills == 0
    hit_tokens = probe.metrics()["vllm:external_prefix_cache_hits"]
    assert hit_tokens > 0
    assert cached_by_source(second) == {"disk": hit_tokens}
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)

    # Half the local copies gone: those values come from redis (and are written locally again).
    for path in sorted(p for p in local.rglob("*") if p.is_file() and not p.name.startswith("."))[::2]:
        path.unlink()
    before = cached_by_source(second)
    stats = layered.stats
    local_hits = stats.local_hits
    assert second.reset_prefix_cache()
    assert generate(second, PROMPTS) == kv_reference["tokens"]
    assert_idle(probe)
    after = cached_by_source(second)
    disk = after.get("disk", 0) - before.get("disk", 0)
    remote = after.get("external_unspecified", 0) - before.get("external_unspecified", 0)
    tokens_per_value = worker.keys.tokens_per_value
    local_hits = stats.local_hits - local_hits
    assert stats.fills > 0 and local_hits > 0
    # (The values the local disk lacks are tried in place first, then read through staging: NOT_CACHED.)
    assert set(worker.loader.failures) <= {Failure.NOT_CACHED}
    assert disk + remote == probe.metrics()["vllm:external_prefix_cache_hits"] - hit_tokens
    # A value read by several requests' loads at once is read once: each is counted at least once.
    assert remote >= stats.fills * tokens_per_value
    assert disk >= local_hits * tokens_per_value
