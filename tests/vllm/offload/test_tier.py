"""asyncconn's tier driven by vLLM's own ``TieringOffloadingManager`` and CPU primary tier, in-process,
against real stores: chunks evicted from the primary come back from the store byte for byte; a chunk the
store lacks, a corrupt value and a store gone are misses or failed promotions (never wrong bytes, never a
hang); shutdown leaves nothing behind. vLLM's GPU worker (CUDA) is the only part not run here."""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncconn.exceptions import ConfigError
from tests.vllm.offload.tiering import ROW, Tiered, keys_of

pytestmark = pytest.mark.interface

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
IDLE = {"jobs": 0, "checks": 0, "tracked": 0}

Make = Callable[..., Tiered]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[Tiered] = []

    def build(url: str, **kw: Any) -> Tiered:
        made.append(Tiered(url, **kw))
        return made[-1]

    yield build
    for tiered in made:
        tiered.close()


def _round_trip(t: Tiered) -> None:
    tag = uuid.uuid4().hex[:8]
    a, b = keys_of(f"a{tag}", 3), keys_of(f"b{tag}", 4)
    pa = [os.urandom(ROW) for _ in a]
    t.offload(a, pa)
    t.settle()
    t.offload(b, [os.urandom(ROW) for _ in b])  # 4 primary slots: A's are evicted and reused
    t.settle()
    ctx = t.request()
    assert [t.manager.primary_tier.lookup(k, ctx) for k in a] == [MISS] * 3, "A must be gone from the primary"

    assert t.lookup(ctx, a) == [HIT] * 3
    for key in a:
        # the tier never waited on the store: the first answer is "ask again", the promotion came after
        assert t.seen[key][0] is RETRY and LookupResult.HIT_PENDING in t.seen[key], t.seen[key]
        assert t.manager.get_load_source(key, ctx) is CacheHitSource.EXTERNAL_UNSPECIFIED
    assert t.load(ctx, a) == pa
    t.finish(ctx)
    t.settle()
    assert t.tier.io.counts.written == 7 and t.tier.io.counts.read == 3
    assert t.tier.pending() == IDLE


def test_evicted_chunks_come_back_from_a_file_store_byte_for_byte(make: Make, tmp_path: Any) -> None:
    _round_trip(make(f"file://{tmp_path}/store"))


@pytest.mark.redis
def test_evicted_chunks_come_back_from_redis_byte_for_byte(make: Make, redis_server: Any) -> None:
    _round_trip(make(redis_server.url, key_prefix=f"t{uuid.uuid4().hex[:6]}:"))


@pytest.mark.redis
def test_evicted_chunks_come_back_from_a_redis_cluster_byte_for_byte(make: Make, redis_cluster: Any) -> None:
    _round_trip(make(redis_cluster.url, key_prefix=f"t{uuid.uuid4().hex[:6]}:"))


@pytest.mark.mooncake
def test_evicted_chunks_come_back_from_mooncake_byte_for_byte(make: Make, mooncake_master: Any) -> None:
    prefix = f"t{uuid.uuid4().hex[:6]}/"
    url = mooncake_master.url(protocol="tcp", segment="64MiB", buffer="16MiB", prefix=prefix)
    _round_trip(make(url))


def test_a_chunk_the_store_never_had_is_a_miss(make: Make, tmp_path: Any) -> None:
    t = make(f"file://{tmp_path}/store")
    ctx = t.request()
    (key,) = keys_of("never", 1)
    assert t.lookup(ctx, [key]) == [MISS]
    assert t.seen[key][0] is RETRY  # asked on the loop, answered on a later step
    t.finish(ctx)
    t.settle()
    assert t.tier.pending() == IDLE


def test_another_model_never_reads_these_chunks(make: Make, tmp_path: Any) -> None:
    """Same store, same offload keys, another model: other names, so a miss (not that model's bytes)."""
    url = f"file://{tmp_path}/store"
    keys = keys_of("shared", 2)
    one = make(url, model="model-one")
    one.offload(keys, [os.urandom(ROW) for _ in keys])
    one.settle()
    other = make(url, model="model-two")
    ctx = other.request()
    assert other.lookup(ctx, keys) == [MISS, MISS]
    ctx = one.request()
    assert one.lookup(ctx, keys) == [HIT, HIT]  # the store does hold them, under model-one's names


def test_a_corrupt_value_fails_its_promotion_and_is_a_miss_from_then_on(make: Make, tmp_path: Any) -> None:
    store_dir = tmp_path / "store"
    t = make(f"file://{store_dir}", num_chunks=2)
    keys = keys_of("bad", 2)
    payloads = [os.urandom(ROW) for _ in keys]
    t.offload(keys, payloads)
    t.settle()
    t.offload(keys_of("filler", 2), [os.urandom(ROW)] * 2)
    t.settle()
    bad_name = t.tier._names.name(keys[1])
    files = [p for p in store_dir.rglob("*") if p.is_file() and keys[1].hex() in p.name]
    assert len(files) == 1, (bad_name, list(store_dir.rglob("*")))
    raw = bytearray(files[0].read_bytes())
    raw[-100] ^= 0xFF  # one payload byte flipped, length unchanged
    files[0].write_bytes(bytes(raw))

    ctx = t.request()
    assert t.lookup(ctx, keys) == [HIT, MISS]
    assert LookupResult.HIT_PENDING in t.seen[keys[1]]  # it was promoted, and the promotion failed
    assert t.tier.io.counts.read_corrupt == 1
    assert t.load(ctx, keys[:1]) == payloads[:1]  # the good chunk of the same job was kept
    t.finish(ctx)
    t.settle()
    assert t.tier.pending() == IDLE


@pytest.mark.redis
def test_a_store_gone_gives_failed_promotions_and_misses_not_a_hang(make: Make, fresh_redis: Any) -> None:
    t = make(fresh_redis.url, num_chunks=2, store_timeout="1s", lookup_timeout="1s")
    keys = keys_of("gone", 2)
    t.offload(keys, [os.urandom(ROW) for _ in keys])
    t.settle()
    t.offload(keys_of("filler", 2), [os.urandom(ROW)] * 2)
    t.settle()
    ctx = t.request()
    results = [t.manager.lookup(k, ctx) for k in keys]
    assert results == [RETRY, RETRY]
    t.step()  # the presence check goes out
    while t.tier.lookups.busy():
        t.manager.lookup(keys[0], ctx)
    assert [t.manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT_PENDING] * 2  # promotions queued
    fresh_redis.kill()
    t.step()  # the promotion's reads go to a dead store
    assert t.lookup(ctx, keys, within=15) == [MISS, MISS]
    assert t.tier.io.counts.read_failures == 2
    t.finish(ctx)

    ctx = t.request()  # a fresh request: its presence checks fail too, as misses
    others = keys_of("other", 1)
    assert t.lookup(ctx, others, within=15) == [MISS]
    t.offload(keys_of("later", 1), [os.urandom(ROW)])  # a cascade to the dead store fails, and ends
    t.finish(ctx)
    t.settle(within=15)
    assert t.tier.io.counts.write_failures >= 1 and t.tier.io.counts.checks_failed >= 1
    assert t.tier.pending() == IDLE


@pytest.mark.redis
def test_a_hung_store_gives_misses_and_drained_jobs_within_its_timeouts(make: Make, fresh_redis: Any) -> None:
    """A frozen server (SIGSTOP): the presence check ends as a miss after ``lookup_timeout``, and vLLM's
    ``reset_cache`` (which drains the tier's jobs) returns with a cascade to it failed, not stuck."""
    t = make(fresh_redis.url, store_timeout="600ms", lookup_timeout="300ms")
    fresh_redis.pause()
    try:
        ctx = t.request()
        assert t.lookup(ctx, keys_of("frozen", 1), within=10) == [MISS]
        t.finish(ctx)
        t.offload(keys_of("stuck", 1), [os.urandom(ROW)])
        deadline = time.monotonic() + 10
        while t.tier.io.busy == 0:  # the cascade is in the store's hands (not merely queued)
            assert time.monotonic() < deadline
            time.sleep(0.001)
        t.manager.reset_cache()  # drain_jobs: waits for the running cascade, which times out
        assert t.tier.pending()["jobs"] == 0 and t.tier.io.counts.write_failures == 1
        assert t.tier.io.store.stats.timeouts == 1  # the write ran, and the store's bound cut it short
        assert t.tier.io.counts.checks_failed == 1
        t.settle(within=10)
        assert t.tier.pending() == IDLE
    finally:
        fresh_redis.resume()


def test_shutdown_closes_the_store_and_lets_vllm_unmap_the_primary(make: Make, tmp_path: Any) -> None:
    t = make(f"file://{tmp_path}/store")
    keys = keys_of("bye", 2)
    t.offload(keys, [os.urandom(ROW) for _ in keys])
    t.settle()
    t.close()  # vLLM's shutdown: tiers first, then the primary's view and mmap (BufferError if we held it)
    assert t.tier.io.store._closing
    with pytest.raises(ValueError, match="released"):
        t.tier._flat.nbytes
    assert t.tier.pending() == IDLE


def test_bad_tier_keys_stop_vllm_with_the_key_named_and_no_secret(tmp_path: Any) -> None:
    unknown = r"secondary_tiers\[AsyncConnTier\]: unknown key 'pinned_pool_bytes'"
    with pytest.raises(ConfigError, match=unknown):
        Tiered(f"file://{tmp_path}/store", pinned_pool_bytes="1GiB")
    with pytest.raises(ConfigError) as info:
        Tiered("redis://:sekrit-pw@127.0.0.1:1/0?timeout=never")
    assert "'backend_url'" in str(info.value) and "sekrit-pw" not in str(info.value)
