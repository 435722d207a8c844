"""KV events for the local store (``local_store_url``): a router that replays them knows which values this
host's directory holds, under the local store's own name, apart from the shared store's residency.

vLLM's real scheduler (and its KV output aggregator across two workers) through the simulator, with KV
events on, a shared ``file://`` store and a local ``file://`` directory in front of it. The router's local
residency is compared with the directory itself (every rank's key of a value on disk) after saves, after
the local sweep evicts, and after loads bring the values back. The engine test is
``tests/engine/test_kv_events_engine.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from asyncconn.vllm.kv.localevents import LOCAL_TIER, LocalChange, LocalNews, LocalTierEvents
from tests.vllm.kv.test_connector import sim_hashes
from tests.vllm.kv.test_support import EventRouter, kv_spec, leaks, prompt, run_checked

pytestmark = pytest.mark.interface

LOCAL = (LOCAL_TIER.medium, LOCAL_TIER.ownership)
STORE = ("STORAGE", "asyncconn:file")


def _on_local_disk(sim: Any, tokens: list[int]) -> set[Any]:
    """The block hashes (as events carry them) of ``tokens``' values whose every rank's key the local
    directory holds now (asked of the directory, not of anything the connector keeps)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    block_hashes = sim_hashes(tokens)
    workers = [w.kv_connector.worker_side for w in sim.workers]
    first = workers[0]
    local = first.store.layered.local
    bpv = first.keys.blocks_per_value
    held: set[Any] = set()
    for v, value_hash in enumerate(first.keys.value_hashes(block_hashes)):
        keys = [w.keys.store_key(value_hash, w.rank) for w in workers]
        if all(first.runtime.run(local.exists(keys))):
            held.update(maybe_convert_block_hash(h) for h in block_hashes[v * bpv : (v + 1) * bpv])
    return held


@pytest.mark.parametrize("workers", [1, 2])
def test_a_router_replaying_the_local_stores_events_knows_what_its_directory_holds(
    make_sim: Any, tmp_path: Path, workers: int
) -> None:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = prompt(21, 4 * 16 + 3)
    kv = kv_spec(f"file://{tmp_path / 'shared'}", local_store_url=f"file://{tmp_path / 'local'}")
    sim = make_sim(kv=kv, num_workers=workers, kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    side = sim.scheduler.connector.scheduler_side
    assert isinstance(side.local_events, LocalTierEvents)
    full = [maybe_convert_block_hash(h) for h in sim_hashes(tokens)[:4]]

    # A save writes every value to the directory too: one BlockStored each, vLLM's payload, its name.
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    stored = router.of(BlockStored, LOCAL)
    assert [h for e in stored for h in e.block_hashes] == full
    assert {e.locality for e in stored} == {"LOCAL"}
    assert [e.token_ids for e in stored] == [tokens[i * 16 : (i + 1) * 16] for i in range(4)]
    assert [e.parent_block_hash for e in stored] == [None, *full[:3]]
    assert router.held[LOCAL] == _on_local_disk(sim, tokens) == set(full)
    assert router.held[STORE] == set(full)

    # The directory's own sweep (past its max_bytes) drops every value, whichever rank wrote it: one
    # worker's sweep reports them all. The router hears it; the shared store's residency is untouched.
    worker = sim.workers[0].kv_connector.worker_side
    local = worker.store.layered.local
    local.max_bytes = 1
    report = worker.runtime.run(local.sweep())
    assert report is not None and report.evicted == 4 * workers
    sim.add_request("other", prompt(99, 10), max_tokens=2)  # steps: the reports reach the scheduler
    run_checked(sim)
    local.max_bytes = 0
    removed = router.of(BlockRemoved, LOCAL)
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(full)
    assert router.held[LOCAL] & set(full) == _on_local_disk(sim, tokens) == set()
    assert router.held[STORE] == set(full) and not router.of(BlockRemoved, STORE)

    # Loaded again from the shared store, the values are written to the directory: announced again.
    assert sim.scheduler.reset_prefix_cache()
    sim.add_request("b", [*tokens, 5], max_tokens=2)
    run_checked(sim)
    again = router.of(BlockStored, LOCAL)[len(stored) :]
    assert sorted(h for e in again for h in e.block_hashes) == sorted(full)
    assert router.held[LOCAL] & set(full) == _on_local_disk(sim, tokens) == set(full)
    assert leaks(sim) == []


@pytest.mark.parametrize("scope", ["all", "store", "host", "none"])
def test_the_local_stores_events_are_this_hosts_with_the_host_tiers(
    make_sim: Any, tmp_path: Path, scope: str
) -> None:
    """``kv_events``: the local store's residency is published with the host tier's (``all``, ``host``:
    this host's), never with the shared store's alone."""
    kv = kv_spec(
        f"file://{tmp_path / 'shared'}", local_store_url=f"file://{tmp_path / 'local'}", kv_events=scope
    )
    sim = make_sim(kv=kv, kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    sim.add_request("a", prompt(31, 2 * 16 + 3), max_tokens=2)
    run_checked(sim)
    published = {where for where, hashes in router.held.items() if hashes}
    want = {"all": {LOCAL, STORE}, "store": {STORE}, "host": {LOCAL}, "none": set()}[scope]
    assert published - {("GPU", None)} == want
    side = sim.scheduler.connector.scheduler_side
    assert (side.local_events is not None) == (LOCAL in want)
    assert (sim.workers[0].kv_connector.worker_side.local_news is not None) == (LOCAL in want)
    assert leaks(sim) == []


def test_a_worker_buffers_the_directorys_changes_in_order_and_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from asyncconn.vllm.kv import localevents

    monkeypatch.setattr(localevents, "MAX_VALUES", 3)
    news = LocalNews()
    news.heard(["a", "b"], True)
    news.heard(["a"], False)
    news.heard(["c", "d"], True)  # past the bound: dropped and counted
    assert news.held() == 3 and news.dropped == 2
    changes: list[LocalChange] = news.take()
    assert changes == [("a", True), ("b", True), ("a", False)]
    assert news.take() == [] and news.held() == 0
