"""KV events for the local store (``local_store_url``): a router that replays them knows which values this
host's directory holds, under the local store's own name, apart from the shared store's residency.

vLLM's real scheduler (and its KV output aggregator across two workers) through the simulator, with KV
events on, a shared ``file://`` store and a local ``file://`` directory in front of it. The router's local
residency is compared with the directory itself (every rank's key of a value on disk) after saves, after
the local sweep evicts, and after loads bring the values back; then with the directory changed behind the
workers' backs (another engine's sweep or write), which only the recheck (``kv_events_recheck``) hears.
Unit tests (a stand-in lookup client) pin the recheck's answer against the workers' reports. The engine
tests are in ``tests/engine/test_kv_events_engine.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from asyncconn.lookup.protocol import store_key
from asyncconn.vllm.kv.localevents import LOCAL_TIER, LocalChange, LocalMirror, LocalNews, LocalTierEvents
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.recheck import ResidencyRecheck
from tests.vllm.kv.test_connector import sim_hashes
from tests.vllm.kv.test_events import _events, _published, _request
from tests.vllm.kv.test_support import (
    EventRouter,
    kv_spec,
    leaks,
    prompt,
    record_stats,
    run_checked,
    serve_others,
)

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


@pytest.mark.usefixtures("unwatched_directories")  # as on another host: only a recheck can hear it
@pytest.mark.parametrize(("recheck", "workers"), [("200ms", 1), ("200ms", 2), (0, 1)])
def test_a_directory_changed_behind_the_workers_backs_is_heard_by_the_recheck(
    make_sim: Any, tmp_path: Path, recheck: Any, workers: int
) -> None:
    """Another engine sharing the directory removes one rank's file of a value (its sweep), later writes
    it back: this engine's workers hear neither. With ``kv_events_recheck`` the scheduler asks the
    directory again: while the engine serves other prompts (never that one) the router drops exactly that
    value from the local residency, and finds it again once the file is back -- each time equal to what
    the directory holds -- counted in the stats vLLM takes. Off (0): neither is heard."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = prompt(21, 4 * 16 + 3)
    kv = kv_spec(
        f"file://{tmp_path / 'shared'}",
        local_store_url=f"file://{tmp_path / 'local'}",
        kv_events_recheck=recheck,
    )
    sim = make_sim(kv=kv, num_workers=workers, kv_events=True)
    router = EventRouter()
    sim.scheduler.kv_event_publisher = router
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    full = [maybe_convert_block_hash(h) for h in sim_hashes(tokens)[:4]]
    assert router.held[LOCAL] == _on_local_disk(sim, tokens) == set(full)
    side = sim.scheduler.connector.scheduler_side
    counted = record_stats(side)

    last = sim.workers[-1].kv_connector.worker_side  # the last rank's file: any rank's missing key counts
    value_hashes = last.keys.value_hashes(sim_hashes(tokens))
    path = last.store.layered.local.path_for(last.keys.store_key(value_hashes[1], last.rank))
    saved = path.read_bytes()
    path.unlink()
    others = serve_others(sim, until=lambda: full[1] not in router.held[LOCAL])
    if not recheck:
        assert side.local_recheck is None
        assert router.held[LOCAL] & set(full) == set(full) and not router.of(BlockRemoved, LOCAL)
        assert leaks(sim) == []
        return
    assert [h for e in router.of(BlockRemoved, LOCAL) for h in e.block_hashes] == [full[1]]
    assert router.held[LOCAL] & set(full) == _on_local_disk(sim, tokens) == set(full) - {full[1]}
    assert router.held[STORE] >= set(full)  # the shared store's residency is its own

    path.write_bytes(saved)  # written again by the other engine
    stored = len(router.of(BlockStored, LOCAL))
    serve_others(sim, until=lambda: full[1] in router.held[LOCAL], start=others)
    again = [h for e in router.of(BlockStored, LOCAL)[stored:] for h in e.block_hashes]
    assert full[1] in again and not set(again) & (set(full) - {full[1]})  # only that value is new
    assert router.held[LOCAL] & set(full) == _on_local_disk(sim, tokens) == set(full)
    assert side.local_recheck is not None and side.local_recheck.removed == 1
    rechecked = side.local_recheck.rechecked + (side.recheck.rechecked if side.recheck is not None else 0)
    assert sum(c.get("events_rechecked", 0) for c in counted) == rechecked
    assert sum(c.get("events_recheck_removed", 0) for c in counted) == 1
    assert leaks(sim) == []


class _Client:
    """Stands in for the lookup client: records each question, answers what the test sets."""

    def __init__(self) -> None:
        self.asked: dict[str, list[bytes]] = {}
        self.answers: dict[str, tuple[tuple[bool, ...], bool]] = {}

    def submit(self, rid: str, keys: list[bytes]) -> None:
        self.asked[rid] = keys

    def poll_answer(self, rid: str) -> tuple[tuple[bool, ...], bool] | None:
        return self.answers.pop(rid, None)


def _followed(tp: int, n: int) -> tuple[LocalTierEvents, list[bytes], list[list[str]]]:
    """Local events over ``n`` one-block values of a request, planned (followed) and reported held by every
    rank, all published: the events, the value hashes, each value's keys (rank by rank)."""
    events = _events(tp=tp)
    local = LocalTierEvents(events, LocalMirror(ValueParts.single(events.keys), tp))
    request = _request("a", prompt(3, n * 16))
    hashes = list(request.block_hashes)
    local.planned(request, list(enumerate(hashes)))
    keys = [[events.keys.store_key(h, rank) for rank in range(tp)] for h in hashes]
    local.update_local((key, True) for value in keys for key in value)
    assert len(events.take()) == n
    return local, hashes, keys


def test_a_recheck_answer_never_undoes_a_report_made_after_its_question() -> None:
    """The directory's answer may predate a worker's report that arrives while it is out: a key such a
    report changed keeps the report's word; the others take the answer, in both directions."""
    local, h, keys = _followed(tp=2, n=3)
    client = _Client()
    recheck = ResidencyRecheck(local, client, interval=0.0)  # type: ignore[arg-type]
    recheck.step()
    ((rid, asked),) = client.asked.items()
    assert [store_key("", k) for k in asked] == [k for value in keys for k in value]  # value by value
    # While it is out, a worker reports value 0's rank-1 key written again (after the directory answered
    # that it was missing); value 1's rank-0 key and value 2's are answered missing, reported by nobody.
    local.update_local([(keys[0][1], False)])
    local.update_local([(keys[0][1], True)])
    assert [type(e) for e in local.events.take()] == [BlockRemoved, BlockStored]
    client.answers[rid] = ((True, False, False, True, False, False), True)
    recheck.step()
    (removed,) = local.events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == _published(h[1:])
    assert (removed.medium, removed.ownership) == (LOCAL_TIER.medium, LOCAL_TIER.ownership)
    assert (recheck.rechecked, recheck.removed) == (3, 2)
    assert set(local.published()) == {h[0]}

    # The next recheck finds values 1 and 2 whole again (another engine wrote them): announced stored.
    recheck.step()
    rid2 = next(r for r in client.asked if r != rid)
    client.answers[rid2] = ((True,) * 6, True)
    recheck.step()
    stored = local.events.take()
    assert all(isinstance(e, BlockStored) for e in stored)
    assert [b for e in stored for b in e.block_hashes] == _published(h[1:])
    assert set(local.published()) == set(h)


def test_a_recheck_answer_the_store_did_not_give_changes_nothing() -> None:
    local, _h, _keys = _followed(tp=1, n=2)
    client = _Client()
    recheck = ResidencyRecheck(local, client, interval=0.0)  # type: ignore[arg-type]
    recheck.step()
    ((rid, _),) = client.asked.items()
    client.answers[rid] = ((False, False), False)  # a timeout or an error
    recheck.step()
    assert local.events.take() == [] and (recheck.rechecked, recheck.removed) == (0, 0)


def test_a_local_recheck_waits_for_every_pipeline_stages_keys() -> None:
    """Under pipeline parallelism a value is the directory's only with every stage's copy: until a later
    stage's key space is known, nothing is asked."""
    events = _events(tp=1, stages=2)
    local = LocalTierEvents(events, LocalMirror(ValueParts.single(events.keys), 1, events.spaces))
    request = _request("a", prompt(3, 2 * 16))
    local.planned(request, list(enumerate(request.block_hashes)))
    client = _Client()
    recheck = ResidencyRecheck(local, client, interval=0.0)  # type: ignore[arg-type]
    recheck.step()
    assert client.asked == {} and not recheck.asking
    events.spaces.learn({1: ["l1"]})
    recheck.step()
    ((_, asked),) = client.asked.items()
    assert len(asked) == 2 * 2  # two values, each stage's key
