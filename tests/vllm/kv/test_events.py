"""KV events and cache-hit sources (asyncconn.vllm.kv.events) with vLLM's real classes.

Unit tests of the event logic on real ``Request`` objects (vLLM's block hasher), then vLLM's real scheduler
(the simulator, two workers merged by vLLM's ``KVOutputAggregator``): what it publishes and the hit source it
records. The real engine and ZMQ publisher: tests/engine/test_kv_events_engine.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import Request

from asyncconn.vllm.kv import events as kv_events
from asyncconn.vllm.kv.events import KVEvents, SavedReport, SaveReports, tier_of
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from tests.vllm.kv.test_support import kv_spec, leaks, prompt, record_hit_sources, run_checked, store_url

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

BLOCK = 16


def _hasher() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=1), None, block_hasher=_hasher())


def _published(hashes: list[Any]) -> list[Any]:
    """Block hashes as vLLM's events carry them (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in hashes]


def _events(tp: int = 1, bpv: int = 1, url: str = "file:///kv", stages: int = 1) -> KVEvents:
    identity = KVIdentity("m", "", "float16", "default", BLOCK, 2, 8, ("l0",), tp, bpv)
    return KVEvents(KeySpace(identity), tier_of(url), stages=stages)


def test_tiers_name_vllm_media_and_hit_sources() -> None:
    """Each built-in scheme maps to vLLM's own medium constants and a real ``CacheHitSource``."""
    want = {
        "file:///srv/kv": ("STORAGE", "LOCAL", CacheHitSource.DISK),
        "memory://x": ("CPU", "LOCAL", CacheHitSource.HOST),
        "redis://h:6379/0": ("CPU", "REMOTE", CacheHitSource.EXTERNAL_UNSPECIFIED),
        "redis+cluster://h:7000": ("CPU", "REMOTE", CacheHitSource.EXTERNAL_UNSPECIFIED),
        "mooncake://h:50051": ("CPU", "REMOTE", CacheHitSource.EXTERNAL_UNSPECIFIED),
        "plugin://x": ("STORAGE", None, CacheHitSource.EXTERNAL_UNSPECIFIED),
    }
    for url, (medium, locality, source) in want.items():
        tier = tier_of(url)
        assert (tier.medium, tier.locality, CacheHitSource(tier.hit_source)) == (medium, locality, source)
        assert tier.ownership == "asyncconn:" + url.split("://")[0]


def test_a_value_is_published_once_every_rank_confirmed_it_with_vllms_payload() -> None:
    events = _events(tp=2, bpv=2)
    tokens = prompt(1, 5 * BLOCK + 3)
    request = _request("a", tokens)
    hashes = list(request.block_hashes)
    pub = _published(hashes)
    assert len(hashes) == 5
    events.planned("a", request, [(0, hashes[1]), (1, hashes[3])])  # values of blocks 0-1 and 2-3
    events.update(SavedReport(saved={hashes[1]: 1, hashes[3]: 1}))  # one rank each: not in the store yet
    assert events.take() == []
    events.update(SavedReport(saved={hashes[3]: 1}))
    (second,) = events.take()
    assert isinstance(second, BlockStored)
    assert second.block_hashes == pub[2:4] and second.parent_block_hash == pub[1]
    assert second.token_ids == tokens[2 * BLOCK : 4 * BLOCK] and second.block_size == BLOCK
    assert (second.medium, second.locality, second.ownership) == ("STORAGE", "LOCAL", "asyncconn:file")
    assert second.extra_keys == [None, None] and second.lora_id is None
    events.update(SavedReport(saved={hashes[1]: 1, hashes[3]: 1}))  # value 1 again: published already
    (first,) = events.take()
    assert first.block_hashes == pub[0:2] and first.parent_block_hash is None
    assert first.token_ids == tokens[: 2 * BLOCK]
    assert events.held() == {"event_requests": 1, "event_snapshots": 0}
    events.release("a")
    assert events.held() == {"event_requests": 0, "event_snapshots": 0}


def test_failed_or_released_values_are_never_published() -> None:
    events = _events(tp=1)
    request = _request("a", prompt(2, 3 * BLOCK))
    h = list(request.block_hashes)
    events.planned("a", request, [(0, h[0]), (1, h[1]), (2, h[2])])
    events.planned("b", request, [(2, h[2])])  # another request planned the same value
    events.update(SavedReport(failed={h[0]}))
    events.release("a")
    assert events.held() == {"event_requests": 1, "event_snapshots": 1}  # b still needs value 2
    events.update(SavedReport(saved={h[0]: 1, h[1]: 1, h[2]: 1}))
    assert [e.block_hashes for e in events.take()] == [_published([h[2]])]
    events.release("b")
    assert events.held() == {"event_requests": 0, "event_snapshots": 0}


def test_a_removed_store_key_becomes_block_removed_of_its_blocks() -> None:
    """Any rank's key ends its value; keys of unknown values are ignored; removal is announced once."""
    events = _events(tp=2, bpv=2, url="redis://h/0")
    request = _request("a", prompt(3, 4 * BLOCK))
    h = list(request.block_hashes)
    events.planned("a", request, [(0, h[1]), (1, h[3])])
    events.update(SavedReport(saved={h[1]: 2, h[3]: 2}))
    assert len(events.take()) == 2
    rank1_key = events.keys.store_key(h[3], 1)
    events.update(SavedReport(removed=[rank1_key, "kv:unknown", events.keys.store_key(h[3], 0)]))
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved)
    assert removed.block_hashes == _published(h[2:4])
    assert (removed.medium, removed.locality, removed.ownership) == ("CPU", "REMOTE", "asyncconn:redis")
    events.removed_keys([rank1_key])
    assert events.take() == []


def test_with_pipeline_stages_every_stages_ranks_confirm_a_value_before_it_is_published() -> None:
    """Two stages of two TP ranks each save their own layers: a value is in the store once all four
    workers confirmed it, not once the first stage's two did; a removal of a first-stage key is heard."""
    events = _events(tp=2, url="redis://h/0", stages=2)
    request = _request("a", prompt(5, 2 * BLOCK))
    h = list(request.block_hashes)
    events.planned("a", request, [(0, h[0]), (1, h[1])])
    events.update(SavedReport(saved={h[0]: 2, h[1]: 1}))  # the first stage's ranks (vLLM merged them)
    assert events.take() == []
    events.update(SavedReport(saved={h[0]: 2, h[1]: 2}))  # the second stage's
    assert [e.block_hashes for e in events.take()] == [_published([h[0]])]
    events.update(SavedReport(saved={h[1]: 1}))
    assert [e.block_hashes for e in events.take()] == [_published([h[1]])]
    events.update(SavedReport(removed=[events.keys.store_key(h[1], 1)]))
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == _published([h[1]])


def test_buffers_are_bounded_drop_oldest_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_events, "MAX_EVENTS", 2)
    monkeypatch.setattr(kv_events, "MAX_VALUES", 3)
    events = _events()
    request = _request("a", prompt(4, 4 * BLOCK))
    h = list(request.block_hashes)
    events.planned("a", request, [(i, h[i]) for i in range(4)])  # the fourth snapshot drops the first
    assert events.dropped == 1
    events.update(SavedReport(saved={x: 1 for x in h}))
    # three published into a buffer of two: the oldest dropped
    assert [e.block_hashes for e in events.take()] == [_published([h[2]]), _published([h[3]])]
    assert events.dropped == 2
    reports = SaveReports()
    for i in range(4):
        reports.saved(bytes([i]))
    reports.report_removed(["k1", "k2", "k3", "k4"])
    assert reports.dropped == 2
    report = reports.take()
    assert report is not None and len(report.saved) == 3 and report.removed == ["k1", "k2", "k3"]
    assert reports.take() is None and reports.held() == 0


def test_reports_of_several_workers_add_up() -> None:
    a = SavedReport(saved={b"x": 1}, failed={b"f"}, removed=["k1"])
    b = SavedReport(saved={b"x": 1, b"y": 1}, removed=["k2"])
    merged = a.aggregate(b)
    assert merged.saved == {b"x": 2, b"y": 1} and merged.failed == {b"f"} and merged.removed == ["k1", "k2"]


# -- vLLM's real scheduler (simulator) ---------------------------------------------------------------------
class _Published:
    """Stands in for the scheduler's ``kv_event_publisher``: keeps every batch vLLM publishes."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, batch: Any) -> None:
        self.batches.append(batch)

    def ours(self, medium: str) -> list[Any]:
        events = [e for b in self.batches for e in b.events]
        return [e for e in events if isinstance(e, BlockStored) and e.medium == medium]

    def shutdown(self) -> None:
        pass


def test_two_ranks_publish_each_value_once_with_vllms_own_hashes(make_sim: Any) -> None:
    """Through vLLM's scheduler and KVOutputAggregator: our BlockStored events cover exactly the request's
    full blocks (the hashes vLLM's own GPU events carry), each once, with the store's medium."""
    sim = make_sim(kv=kv_spec(store_url()), num_workers=2, kv_events=True)
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    tokens = prompt(5, 6 * 16 + 5)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    ours = published.ours("CPU")  # memory://: vLLM's CPU medium
    assert ours, "no BlockStored with the store's medium"
    gpu = [e for e in (ev for b in published.batches for ev in b.events) if getattr(e, "medium", "") == "GPU"]
    gpu_hashes = [h for e in gpu if isinstance(e, BlockStored) for h in e.block_hashes]
    got = [h for e in ours for h in e.block_hashes]
    assert sorted(got) == sorted(gpu_hashes[:6]) and len(got) == 6  # the 6 full prompt blocks, once each
    by_first = {e.block_hashes[0]: e for e in ours}
    for i, h in enumerate(gpu_hashes[:6]):
        event = by_first[h]
        assert event.parent_block_hash == (gpu_hashes[i - 1] if i else None)
        assert event.token_ids == tokens[i * 16 : (i + 1) * 16]
    assert leaks(sim) == []


def test_hits_are_counted_under_the_stores_source(make_sim: Any, tmp_path: Path) -> None:
    """vLLM's scheduler asks the connector for the source of each external hit: file:// is DISK."""
    url = f"file://{tmp_path}"
    tokens = prompt(6, 4 * 16 + 3)
    first = make_sim(kv=kv_spec(url))
    first.add_request("a", tokens, max_tokens=1)
    run_checked(first)
    first.close()
    sim = make_sim(kv=kv_spec(url))
    seen = record_hit_sources(sim)
    sim.add_request("b", [*tokens, 9], max_tokens=1)
    run_checked(sim)
    hits = {k: v for s in seen for k, v in s.items()}
    assert hits == {CacheHitSource.DISK: 4 * 16}
    assert leaks(sim) == []


def test_a_corrupt_value_removed_from_the_store_is_announced_removed(make_sim: Any) -> None:
    """The one removal main can see: a load that finds a damaged value deletes it (the purger), and vLLM's
    scheduler publishes a ``BlockRemoved`` of exactly that value's block."""
    import asyncio

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from asyncconn.backend import open_backend

    url = store_url()
    sim = make_sim(kv=kv_spec(url), kv_events=True, kv_load_failure_policy="recompute")
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    tokens = prompt(8, 4 * 16)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    request = _request("h", tokens)
    hashes = list(request.block_hashes)
    assert {h for e in published.ours("CPU") for h in e.block_hashes} == set(_published(hashes))
    keys = sim.workers[0].kv_connector.worker_side.keys
    bad = keys.store_key(hashes[1], 0)

    async def corrupt() -> None:
        backend = await open_backend(url)
        (value,) = await backend.get([bad])
        assert value is not None
        raw = bytearray(b"".join(bytes(c) for c in value))
        raw[-1] ^= 0xFF
        await backend.put([(bad, bytes(raw))])

    asyncio.run(corrupt())
    assert sim.scheduler.reset_prefix_cache()  # the next request asks the store, not vLLM's own cache
    sim.add_request("b", tokens, max_tokens=2)
    run_checked(sim)
    removed = [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.medium) for e in removed if e.medium == "CPU"] == [
        ([maybe_convert_block_hash(hashes[1])], "CPU")
    ]
    assert leaks(sim) == []


def test_a_backend_that_reports_its_removals_is_heard(make_sim: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend with the ``on_removed`` hook (the backend contract's removal report: ``file://`` eviction and
    expiry) gets the worker's ``report_removed``; the keys it reports, on its loop thread, become one
    ``BlockRemoved`` of those values' blocks; closing the worker unhooks it."""
    from asyncconn_backends.memory import MemoryBackend
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from asyncconn.runtime import get_runtime

    monkeypatch.setattr(MemoryBackend, "on_removed", None, raising=False)  # a backend with the hook
    sim = make_sim(kv=kv_spec(store_url()), kv_events=True)
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    tokens = prompt(9, 3 * 16)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    worker = sim.workers[0].kv_connector.worker_side
    backend = worker.store.backend
    assert backend.on_removed == worker.report_removed
    hashes = list(_request("h", tokens).block_hashes)
    keys = [worker.keys.store_key(h, 0) for h in hashes[:2]]

    async def evict() -> None:  # as a sweep would: on the loop thread
        backend.on_removed(keys)

    get_runtime().run(evict())
    sim.add_request("b", prompt(10, 20), max_tokens=1)  # any step carries the report
    run_checked(sim)
    removed = [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed if e.medium == "CPU"] == [
        [maybe_convert_block_hash(h) for h in hashes[:2]]
    ]
    assert leaks(sim) == []
    sim.close()
    assert backend.on_removed is None


def test_a_payload_vllm_refuses_turns_the_events_off_without_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A later vLLM whose ``BlockStored`` wants a field this module does not fill: one warning, no events,
    nothing raised into the scheduler."""
    events = _events()

    def refuses(**kwargs: Any) -> Any:
        raise TypeError("missing required argument 'new_field'")

    monkeypatch.setattr(events, "_stored_cls", refuses)
    request = _request("a", prompt(11, 2 * BLOCK))
    h = list(request.block_hashes)
    with caplog.at_level("WARNING", logger="asyncconn.vllm.kv.events"):
        events.planned("a", request, [(0, h[0]), (1, h[1])])
        events.planned("b", request, [(0, h[0])])
    assert events.off and "new_field" in caplog.text and caplog.text.count("KV events off") == 1
    events.update(SavedReport(saved={h[0]: 1, h[1]: 1}))
    assert events.take() == [] and events.held() == {"event_requests": 0, "event_snapshots": 0}


def test_a_redis_value_the_server_expired_is_announced_removed(make_sim: Any, redis_server: Any) -> None:
    """``redis://?removals=enable``: the server's own ``ttl`` expiry, heard through keyspace notifications
    on asyncconn's loop, becomes a ``BlockRemoved`` of exactly the expired values' blocks with the store's
    medium -- what no other path reports (nothing here reads or deletes the values)."""
    import time
    import uuid

    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    url = f"{redis_server.url}?removals=enable&ttl=1s&prefix=ev{uuid.uuid4().hex[:8]}:"
    sim = make_sim(kv=kv_spec(url), kv_events=True)
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    tokens = prompt(11, 3 * 16)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    hashes = [maybe_convert_block_hash(h) for h in _request("h", tokens).block_hashes]
    assert {h for e in published.ours("CPU") for h in e.block_hashes} == set(hashes)
    worker = sim.workers[0].kv_connector.worker_side
    (listener,) = worker.store.backend._listeners
    deadline = time.monotonic() + 20
    while listener.heard < len(hashes) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert listener.heard >= len(hashes), "the expiry of the stored values was not heard"
    later = prompt(12, 20)
    sim.add_request("b", later, max_tokens=1)  # any step carries the report
    run_checked(sim)
    removed = [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
    got = {h for e in removed for h in e.block_hashes}
    b_hashes = {maybe_convert_block_hash(h) for h in _request("h2", later).block_hashes}
    assert set(hashes) <= got <= set(hashes) | b_hashes  # "b"'s own value may expire meanwhile too
    assert {(e.medium, e.locality, e.ownership) for e in removed} == {("CPU", "REMOTE", "asyncconn:redis")}
    assert leaks(sim) == []


def _saved_with_events(make_sim: Any, tmp_path: Path, tokens: list[int]) -> tuple[Any, _Published]:
    """A simulated engine on ``file://`` with KV events on that has computed and saved ``tokens``."""
    sim = make_sim(kv=kv_spec(f"file://{tmp_path}"), kv_events=True)
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    return sim, published


@pytest.mark.usefixtures("unwatched_directories")  # unreported: only the lookup can find it missing
def test_a_value_a_lookup_finds_missing_is_announced_removed(make_sim: Any, tmp_path: Path) -> None:
    """A store that never reports its removals (a file deleted behind ``file://``'s back here; Mooncake's
    evictions in production): the next lookup of the prompt answers that value 2 is missing, and the
    engine announces exactly that value removed from the store's residency."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    tokens = prompt(13, 4 * 16 + 3)
    sim, published = _saved_with_events(make_sim, tmp_path, tokens)
    hashes = [maybe_convert_block_hash(h) for h in _request("h", tokens).block_hashes]
    assert [h for e in published.ours("STORAGE") for h in e.block_hashes] == hashes
    worker = sim.workers[0].kv_connector.worker_side
    value_hashes = worker.keys.value_hashes(_request("h", tokens).block_hashes)
    backend = worker.store.backend
    Path(backend._path(worker.keys.store_key(value_hashes[2], 0))).unlink()  # no removal hook hears this

    assert sim.scheduler.reset_prefix_cache()
    sim.add_request("b", [*tokens, 7], max_tokens=2)
    run_checked(sim)
    removed = [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [hashes[2]]
    assert {(e.medium, e.ownership) for e in removed} == {("STORAGE", "asyncconn:file")}
    assert leaks(sim) == []


def test_a_lookup_that_failed_announces_nothing(make_sim: Any, tmp_path: Path) -> None:
    """The miss a lookup serves when the store did not answer (timeout, error) is not the store saying the
    value is gone: no ``BlockRemoved``."""
    from asyncconn.lookup.client import LookupClient

    tokens = prompt(14, 3 * 16 + 3)
    sim, published = _saved_with_events(make_sim, tmp_path, tokens)
    assert published.ours("STORAGE")
    lookup = sim.scheduler.connector.scheduler_side.lookup
    assert isinstance(lookup, LookupClient)
    real = lookup.poll_answer

    def failed(rid: str) -> tuple[int, bool] | None:
        got = real(rid)
        return None if got is None else (0, False)  # a miss served in the store's stead

    lookup.poll_answer = failed  # type: ignore[method-assign]
    assert sim.scheduler.reset_prefix_cache()
    sim.add_request("b", [*tokens, 7], max_tokens=2)
    run_checked(sim)
    assert not [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
    assert leaks(sim) == []
