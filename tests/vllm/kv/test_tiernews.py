"""Host-tier hits counted as ``host`` with several ranks: each worker's tier reports what it holds, the
scheduler counts a load's value as ``host`` when every rank's tier holds it, and a tier keeps a value it
announced readable until the scheduler has acknowledged its eviction.

The protocol's pieces on their own (a real :class:`HostLRU` in announced mode), then vLLM's real scheduler
with two workers through the simulator.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncconn.hosttier import HostLRU
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.metadata import ValueRef
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.tiernews import TierMirror, WorkerTierNews
from tests.vllm.kv.test_connector import sim_hashes
from tests.vllm.kv.test_support import kv_spec, leaks, prompt, record_hit_sources, run_checked

pytestmark = pytest.mark.interface

IDENTITY = KVIdentity("m", "", "float16", "default", 16, 2, 8, ("l0",), 2, 1)  # two ranks
KEYS = KeySpace(IDENTITY)
HASHES = [bytes([i]) * 32 for i in range(4)]


def _hold(lru: HostLRU, key: str, nbytes: int = 10) -> None:
    extent = lru.reserve(nbytes)
    assert extent is not None
    lru.commit(key, extent)


def _ref(i: int) -> ValueRef:
    return ValueRef(HASHES[i], (0,), ((i,),))


def _key(i: int, rank: int) -> str:
    return KEYS.store_key(HASHES[i], rank)


# -- the tier in announced mode ---------------------------------------------------------------------------


def test_announced_values_are_withdrawn_readable_until_acknowledged() -> None:
    lru = HostLRU(30, align=1)
    lru.announce()
    _hold(lru, "a")
    _hold(lru, "b")
    assert lru.take_news() == (1, ["a", "b"], [])
    assert lru.take_news() is None  # nothing new: no report, no number used
    _hold(lru, "c")  # not announced yet
    # For 15: c goes first (nobody was told of it), then a is withdrawn; its room is not free yet.
    assert lru.reserve(15) is None
    assert "a" not in lru and "b" in lru and "c" not in lru
    assert lru.withdrawn == 1 and lru.used == 20
    assert lru.readable("a") and lru.readable("b") and not lru.readable("c")
    entry = lru.pin("a")  # still readable
    assert entry is not None
    lru.unpin(entry)
    assert lru.take_news() == (2, [], ["a"])  # c was never announced: never reported
    lru.acknowledge(1)  # an older report: a's withdrawal is in report 2
    assert lru.withdrawn == 1 and lru.pin("x") is None
    lru.acknowledge(2)
    assert lru.withdrawn == 0 and lru.used == 10 and lru.pin("a") is None and not lru.readable("a")
    assert lru.reserve(15) is not None


def test_a_value_not_announced_yet_is_evicted_at_once_and_never_reported() -> None:
    lru = HostLRU(20, align=1)
    lru.announce()
    _hold(lru, "a")
    _hold(lru, "b")
    _hold(lru, "c")  # a goes at once: the scheduler never heard of it
    assert lru.withdrawn == 0 and "a" not in lru
    assert lru.take_news() == (1, ["b", "c"], [])


def test_a_claimed_withdrawn_value_outlives_its_acknowledgement_until_released() -> None:
    lru = HostLRU(20, align=1)
    worker = WorkerTierNews(lru)
    _hold(lru, "a")
    _hold(lru, "b")
    worker.take()
    worker.claim("r", ["a", "zzz"])
    assert lru.reserve(10) is None  # b (unclaimed) is withdrawn; a is claimed
    assert "a" in lru and "b" not in lru
    seq, _, gone = worker.take() or (0, [], [])
    assert gone == ["b"]
    worker.acknowledge(seq)
    assert lru.used == 10  # b's room is back
    worker.release("r")
    worker.release("r")  # twice is nothing
    assert lru.stats.pinned == 0 and worker.held() == 0


def test_the_scheduler_counts_a_value_every_rank_holds_as_a_stale_report_said_and_the_tier_keeps_it() -> None:
    """The exactness argument in one run: the scheduler plans on a report that a value is held; rank 1 has
    evicted it meanwhile; the worker's claim (before the acknowledgement) still finds it, and after the
    acknowledgement it stays readable until the load released it."""
    mirror = TierMirror(ValueParts.single(KEYS), tp_size=2, block_size=16)
    tiers = [HostLRU(20, align=1), HostLRU(20, align=1)]
    workers = [WorkerTierNews(lru) for lru in tiers]
    for rank, lru in enumerate(tiers):
        _hold(lru, _key(0, rank))
        _hold(lru, _key(1, rank))
    _hold(tiers[0], _key(2, 0))  # value 2: only rank 0 (rank 0 evicted value 0 for it: not announced yet)
    mirror.update({rank: news for rank, w in enumerate(workers) if (news := w.take()) is not None})
    assert mirror.acks() == {0: 1, 1: 1}
    # Rank 1 lets value 1 go (announced: withdrawn), and that report has not reached the scheduler.
    tiers[1].forget(_key(1, 1))
    assert _key(1, 1) not in tiers[1] and tiers[1].withdrawn == 1
    assert mirror.claim("r", [_ref(0), _ref(1), _ref(2)]) == 16  # value 1: both ranks, as far as it knows
    assert mirror.take_tokens("r") == 16 and mirror.take_tokens("r") == 0
    # The workers get the load and claim it, then the metadata's acknowledgements (report 1 only).
    for rank, worker in enumerate(workers):
        worker.claim("r", [_key(i, rank) for i in range(3)])
        worker.acknowledge(mirror.acks().get(rank))
    news = workers[1].take()
    assert news is not None and news[2] == [_key(1, 1)]
    mirror.update({1: news})
    workers[1].acknowledge(mirror.acks()[1])  # the withdrawal is acknowledged while the load still reads
    entry = tiers[1].pin(_key(1, 1))
    assert entry is not None  # the value the scheduler counted is still there for the load
    tiers[1].unpin(entry)
    assert mirror.claim("s", [_ref(1)]) == 0  # a later plan knows it is gone
    for worker in workers:
        worker.release("r")
    assert tiers[1].pin(_key(1, 1)) is None and tiers[1].withdrawn == 0
    assert all(lru.stats.pinned == 0 for lru in tiers)


# -- vLLM's scheduler, two workers ------------------------------------------------------------------------


def test_two_ranks_hits_served_by_both_tiers_are_counted_as_host(make_sim: Any, tmp_path: Path) -> None:
    url = f"file://{tmp_path}"
    tokens = prompt(21, 4 * 16 + 3)
    sim = make_sim(kv=kv_spec(url, host_cache_bytes="4MiB"), num_workers=2)
    seen = record_hit_sources(sim)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    mirror = sim.scheduler.connector.scheduler_side.host
    assert isinstance(mirror, TierMirror)
    workers = [w.kv_connector.worker_side for w in sim.workers]
    assert all(w.tier_news is not None for w in workers)
    assert sim.scheduler.reset_prefix_cache()  # vLLM's own cache forgets the prompt: it must be loaded

    sim.add_request("b", [*tokens, 5], max_tokens=2)
    run_checked(sim)
    hits = {k: v for s in seen for k, v in s.items()}
    assert hits == {CacheHitSource.HOST: 4 * 16}
    assert [w.store.host_tier.stats.hits for w in workers] == [4, 4]  # type: ignore[union-attr]

    # Rank 1's tier loses value 2 (deleted through it) and lets value 3 go (withdrawn: readable until the
    # scheduler acknowledges). The scheduler hears of both before it plans the next load (its lookup takes
    # a step), and counts those two under the store's source; the loads are right either way.
    tier1 = workers[1].store.host_tier
    assert tier1 is not None
    keys1 = [workers[1].keys.store_key(h, 1) for h in workers[1].keys.value_hashes(sim_hashes(tokens))]
    assert tier1.lru.discard([keys1[2]]) == 1
    tier1.lru.forget(keys1[3])
    assert tier1.lru.withdrawn == 1
    seen.clear()
    assert sim.scheduler.reset_prefix_cache()
    sim.add_request("c", [*tokens, 6], max_tokens=2)
    run_checked(sim)
    hits = {k: v for s in seen for k, v in s.items()}
    assert hits == {CacheHitSource.HOST: 2 * 16, CacheHitSource.DISK: 2 * 16}
    assert tier1.lru.withdrawn == 0  # acknowledged through the metadata: its room is free again
    assert leaks(sim) == []
