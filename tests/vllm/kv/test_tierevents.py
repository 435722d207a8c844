"""KV events for the host tiers: a router that replays them knows exactly which values every rank's tier
holds, under the tier's own name, apart from the store's residency.

vLLM's real scheduler (and its KV output aggregator across two workers) through the simulator, with KV
events on, a ``file://`` store and a host tier per worker. After every scenario the events are replayed as
a router does -- a set of block hashes per (medium, ownership) -- and the host tier's set must equal the
values every worker's tier holds at that moment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncconn.vllm.kv import tierevents
from asyncconn.vllm.kv.tierevents import HOST_TIER, TierEvents
from tests.vllm.kv.test_connector import sim_hashes
from tests.vllm.kv.test_support import (
    EventRouter,
    check_tier_events,
    kv_spec,
    leaks,
    prompt,
    record_hit_sources,
    run_checked,
)

pytestmark = pytest.mark.interface

HOST = (HOST_TIER.medium, HOST_TIER.ownership)
STORE = ("STORAGE", "asyncconn:file")


def _in_every_tier(sim: Any, tokens: list[int]) -> set[Any]:
    """The block hashes (as events carry them) of ``tokens``' values that every worker's tier holds now."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    block_hashes = sim_hashes(tokens)
    workers = [w.kv_connector.worker_side for w in sim.workers]
    keys = workers[0].keys
    bpv = keys.blocks_per_value
    held: set[Any] = set()
    for v, value_hash in enumerate(keys.value_hashes(block_hashes)):
        if all(w.keys.store_key(value_hash, w.rank) in w.store.host_tier.lru for w in workers):
            held.update(maybe_convert_block_hash(h) for h in block_hashes[v * bpv : (v + 1) * bpv])
    return held


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_replaying_the_tier_events_knows_what_every_tier_holds(
    make_sim: Any, tmp_path: Path, workers: int
) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = prompt(21, 4 * 16 + 3)
    sim = make_sim(
        kv=kv_spec(f"file://{tmp_path}", host_cache_bytes="4MiB"), num_workers=workers, kv_events=True
    )
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    seen = record_hit_sources(sim)
    assert isinstance(sim.scheduler.connector.scheduler_side.tier_events, TierEvents)
    full = [maybe_convert_block_hash(h) for h in sim_hashes(tokens)[:4]]

    # A save puts the values in every tier: one BlockStored each, vLLM's payload, the tier's name.
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    stored = router.of(BlockStored, HOST)
    assert [h for e in stored for h in e.block_hashes] == full
    assert {e.locality for e in stored} == {"LOCAL"}
    assert [e.token_ids for e in stored] == [tokens[i * 16 : (i + 1) * 16] for i in range(4)]
    assert [e.parent_block_hash for e in stored] == [None, *full[:3]]
    assert router.held[STORE] == set(full)  # the store's own residency, apart
    assert router.held[HOST] == _in_every_tier(sim, tokens) == set(full)
    assert check_tier_events(sim, router) == 4

    # The last rank's tier loses value 2 (deleted) and lets value 3 go (withdrawn): one BlockRemoved of
    # their blocks, from the tier only, at the next step's report.
    last = sim.workers[-1].kv_connector.worker_side
    tier = last.store.host_tier
    keys = [last.keys.store_key(h, last.rank) for h in last.keys.value_hashes(sim_hashes(tokens))]
    assert tier.lru.discard([keys[2]]) == 1
    tier.lru.forget(keys[3])
    sim.add_request("other", prompt(99, 10), max_tokens=2)  # steps, nothing stored
    run_checked(sim)
    removed = router.of(BlockRemoved, HOST)
    assert [sorted(e.block_hashes) for e in removed] == [sorted(full[2:])]
    assert router.held[HOST] == _in_every_tier(sim, tokens) == set(full[:2])
    assert check_tier_events(sim, router) == 2
    assert router.held[STORE] == set(full) and not router.of(BlockRemoved, STORE)

    # Loaded again from the store, the two values are back in every tier: announced again.
    assert sim.scheduler.reset_prefix_cache()
    sim.add_request("b", [*tokens, 5], max_tokens=2)
    run_checked(sim)
    hits = {k: v for s in seen for k, v in s.items()}
    assert hits[CacheHitSource.HOST] == 2 * 16  # values 0 and 1 were in every tier
    again = router.of(BlockStored, HOST)[len(stored) :]
    assert sorted(h for e in again for h in e.block_hashes) == sorted(full[2:])
    assert router.held[HOST] == _in_every_tier(sim, tokens) == set(full)
    assert check_tier_events(sim, router) == 4
    assert leaks(sim) == []


@pytest.mark.parametrize("scope", ["all", "store", "host", "none"])
def test_kv_events_names_the_residencies_published(make_sim: Any, tmp_path: Path, scope: str) -> None:
    """``kv_events`` picks which of the connector's residencies vLLM's events carry; vLLM's own ``GPU``
    events flow whatever it says. Without the host tier's events, one rank goes back to claims."""
    from asyncconn.vllm.kv.hostclaims import HostClaims

    tokens = prompt(31, 2 * 16 + 3)
    kv = kv_spec(f"file://{tmp_path}", host_cache_bytes="4MiB", kv_events=scope)
    sim = make_sim(kv=kv, kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    side = sim.scheduler.connector.scheduler_side
    published = {where for where, hashes in router.held.items() if hashes}
    want = {"all": {HOST, STORE}, "store": {STORE}, "host": {HOST}, "none": set()}[scope]
    assert published - {("GPU", None)} == want and ("GPU", None) in published
    assert (side.tier_events is not None) == (HOST in want)
    if HOST not in want:
        assert isinstance(side.host, HostClaims)  # one rank without the tiers' events
    assert (sim.workers[0].kv_connector.worker_side.events is not None) == (STORE in want)
    assert leaks(sim) == []


def test_the_values_remembered_are_bounded_and_the_oldest_go(
    make_sim: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the bound, the least recently planned value is forgotten: its later changes are not published
    (a router keeps it, and finds it in the store or misses); the rest stay exact."""
    monkeypatch.setattr(tierevents, "MAX_VALUES", 2)
    tokens = prompt(7, 4 * 16 + 3)
    sim = make_sim(kv=kv_spec(f"file://{tmp_path}", host_cache_bytes="4MiB"), kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    events = sim.scheduler.connector.scheduler_side.tier_events
    assert events is not None and len(events.published()) == 2  # values 0 and 1 were forgotten before reports
    worker = sim.workers[0].kv_connector.worker_side
    keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(sim_hashes(tokens))]
    assert worker.store.host_tier.lru.discard(keys) == 4
    sim.add_request("other", prompt(99, 10), max_tokens=2)
    run_checked(sim)
    (removed,) = router.of(BlockRemoved, HOST)
    assert len(removed.block_hashes) == 2 and not events.published()
    assert leaks(sim) == []
