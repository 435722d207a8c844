"""Values announced stored, asked about again (asyncconn.vllm.kv.recheck): removals a store never reports.

Unit tests of the turn and the answer handling (a stand-in lookup client and clock), then vLLM's real
scheduler (the simulator) over ``file://`` with a value deleted behind the store's back, which no removal
hook hears: the recheck announces it while the engine serves other prompts, and nothing does without it.
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_events import BlockRemoved

from asyncconn.vllm.kv.events import KVEvents, SavedReport
from asyncconn.vllm.kv.recheck import ResidencyRecheck, StoreResidency
from tests.vllm.kv.test_events import _events, _Published, _published, _request
from tests.vllm.kv.test_support import kv_spec, leaks, prompt, record_stats, run_checked, serve_others

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

BLOCK = 16


def _stored(events: KVEvents, n: int, rid: str = "a", seed: int = 1) -> list[bytes]:
    """``n`` one-block values of a request, planned and confirmed: published, and remembered."""
    request = _request(rid, prompt(seed, n * BLOCK))
    hashes = list(request.block_hashes)
    events.planned(rid, request, list(enumerate(hashes)))
    events.update(SavedReport(saved=dict.fromkeys(hashes, events.ranks)))
    events.release(rid)
    assert len(events.take()) == n
    return hashes


class _Client:
    """Stands in for the lookup client: records each question, answers what the test sets."""

    def __init__(self) -> None:
        self.asked: dict[str, list[bytes]] = {}
        self.answers: dict[str, tuple[tuple[bool, ...], bool]] = {}
        self.closed = False

    def submit(self, rid: str, keys: list[bytes]) -> None:
        self.asked[rid] = keys

    def poll_answer(self, rid: str) -> tuple[tuple[bool, ...], bool] | None:
        return self.answers.pop(rid, None)

    def close(self) -> None:
        self.closed = True


def _recheck(events: KVEvents, client: _Client, **kwargs: Any) -> ResidencyRecheck:
    return ResidencyRecheck(StoreResidency(events, events.keys), client, **kwargs)  # type: ignore[arg-type]


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_values_are_handed_out_in_turn_and_a_value_announced_again_keeps_its_residency() -> None:
    events = _events(tp=2)
    h = _stored(events, 5)
    first = events.oldest(2)
    assert [v for v, _ in first] == h[:2]
    assert [v for v, _ in events.oldest(2)] == h[2:4]
    assert [v for v, _ in events.oldest(3)] == [h[4], h[0], h[1]]  # the turn goes round
    # value 0 is saved and announced again after it was handed out: the stale answer must not remove it
    request = _request("b", prompt(1, 5 * BLOCK))
    events.planned("b", request, [(0, h[0])])
    events.update(SavedReport(saved={h[0]: 2}))
    events.release("b")
    assert len(events.take()) == 1
    assert events.removed_unless_renewed(first) == 1  # value 1 only
    (removed,) = events.take()
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == _published([h[1]])


def test_a_recheck_asks_on_its_interval_and_announces_only_what_the_store_said_is_gone() -> None:
    events = _events(tp=2, url="mooncake://h:50051")
    h = _stored(events, 3)
    client, clock = _Client(), _Clock()
    recheck = _recheck(events, client, interval=10.0, values=2, clock=clock)

    recheck.step()
    assert client.asked == {}  # not before its interval
    clock.now += 10.0
    recheck.step()
    ((rid, keys),) = client.asked.items()
    assert keys == events.keys.lookup_keys(h[:2])  # both ranks' keys of the two oldest values
    recheck.step()  # not answered yet: nothing happens, nothing more is asked
    assert len(client.asked) == 1 and recheck.asking
    # rank 1's key of value 1 is gone: value 1 is unusable, so it is removed; value 0 is whole
    client.answers[rid] = ((True, True, True, False), True)
    recheck.step()
    (removed,) = events.take()
    assert removed.block_hashes == _published([h[1]])
    assert (removed.medium, removed.ownership) == ("CPU", "asyncconn:mooncake")
    assert (recheck.rechecked, recheck.removed, recheck.asking) == (2, 1, False)

    clock.now += 10.0
    recheck.step()
    rid2 = next(r for r in client.asked if r != rid)
    assert client.asked[rid2] == events.keys.lookup_keys([h[2], h[0]])  # the turn goes on
    client.answers[rid2] = ((False,) * 4, False)  # a timeout or an error: the store said nothing
    recheck.step()
    assert events.take() == []
    assert (recheck.rechecked, recheck.removed) == (2, 1)
    recheck.close()
    assert client.closed and not recheck.asking


def test_a_large_recheck_names_its_keys_over_several_steps() -> None:
    """No step names more than ``KEYS_PER_STEP`` values' keys (a hash per rank each): 300 values take three
    steps, and the third asks the store about all of them at once, in order; the answer is taken in over
    three steps too."""
    from asyncconn.vllm.kv import recheck as recheck_module

    events = _events(tp=2)
    h = _stored(events, 300)
    client, clock = _Client(), _Clock()
    recheck = _recheck(events, client, interval=1.0, values=300, clock=clock)
    clock.now += 1.0
    named = []
    real = events.keys.lookup_keys

    def counted(value_hashes: list[bytes]) -> list[bytes]:
        named.append(len(value_hashes))
        return real(value_hashes)

    events.keys.lookup_keys = counted  # type: ignore[method-assign]
    for _ in range(2):
        recheck.step()
        assert client.asked == {} and recheck.asking
    recheck.step()
    assert named == [recheck_module.KEYS_PER_STEP] * 2 + [300 - 2 * recheck_module.KEYS_PER_STEP]
    ((rid, keys),) = client.asked.items()
    assert keys == real(h)
    # The answer is taken in over as many steps: one value missing in each step's share.
    firsts = (0, recheck_module.KEYS_PER_STEP, 2 * recheck_module.KEYS_PER_STEP)
    answer = [True] * 600
    for gone in firsts:
        answer[2 * gone + 1] = False  # its rank-1 key
    client.answers[rid] = (tuple(answer), True)
    for step, gone in enumerate(firsts):
        recheck.step()
        (removed,) = events.take()
        assert removed.block_hashes == _published([h[gone]])
        assert (recheck.rechecked, recheck.removed, recheck.asking) == (300, step + 1, step < 2)


def test_nothing_remembered_asks_nothing() -> None:
    events = _events()
    client, clock = _Client(), _Clock()
    recheck = _recheck(events, client, interval=1.0, clock=clock)
    clock.now += 5.0
    recheck.step()
    assert client.asked == {} and not recheck.asking


# -- vLLM's real scheduler (simulator) ---------------------------------------------------------------------
def _removed(published: _Published) -> list[Any]:
    """Block hashes of the store's ``BlockRemoved`` events (``file://``: ``STORAGE``; vLLM's own cache
    announces its ``GPU`` evictions beside them)."""
    return [
        h
        for b in published.batches
        for e in b.events
        if isinstance(e, BlockRemoved) and e.medium == "STORAGE"
        for h in e.block_hashes
    ]


@pytest.mark.usefixtures("unwatched_directories")  # unreported, as a Mooncake eviction is
@pytest.mark.parametrize(("recheck", "via"), [("200ms", "store"), ("200ms", "lookup server"), (0, "store")])
def test_a_value_deleted_behind_the_stores_back_is_announced_while_other_prompts_run(
    make_sim: Any, tmp_path: Path, recheck: Any, via: str
) -> None:
    """A file deleted behind ``file://``'s back (no removal hook hears it; Mooncake's evictions in
    production): while the engine serves other prompts, never looking that one up again, the recheck
    announces exactly that value removed, with the store's medium -- asking the store itself, or a real
    lookup server (``asyncconn lookup-server``, its own process). Off (0), nothing is announced."""

    from asyncconn_tools.chaos.procs import LookupServerProcess

    url = f"file://{tmp_path}"
    extra: dict[str, Any] = {"kv_events_recheck": recheck}
    if via == "lookup server":
        server = LookupServerProcess(url, block_size=BLOCK).start()
        extra["lookup_server"] = server.endpoint
    try:
        _recheck_while_other_prompts_run(make_sim, url, extra, recheck, via)
    finally:
        if via == "lookup server":
            server.stop()


def _recheck_while_other_prompts_run(
    make_sim: Any, url: str, extra: dict[str, Any], recheck: Any, via: str
) -> None:
    sim, published, hashes, value_hashes = _one_prompt_saved(make_sim, url, extra, seed=21)
    assert [h for e in published.ours("STORAGE") for h in e.block_hashes] == hashes
    worker = sim.workers[0].kv_connector.worker_side
    Path(worker.store.backend._path(worker.keys.store_key(value_hashes[1], 0))).unlink()

    side = sim.scheduler.connector.scheduler_side
    counted = record_stats(side)
    serve_others(sim, until=lambda: bool(_removed(published)))
    if recheck:
        assert _removed(published) == [hashes[1]]
        removed = [e for b in published.batches for e in b.events if isinstance(e, BlockRemoved)]
        assert ("STORAGE", "asyncconn:file") in {(e.medium, e.ownership) for e in removed}
        assert side.recheck is not None and side.recheck.removed == 1
        if via == "store":  # one store client in the scheduler process (on Mooncake, a second would
            # contribute a second segment); behind a lookup server, none
            assert side.lookup is not None and side.recheck.client.store is side.lookup.store is not None
        else:
            assert side.lookup is not None and side.lookup.store is side.recheck.client.store is None
        assert sum(c.get("events_recheck_removed", 0) for c in counted) == 1
        assert sum(c.get("events_rechecked", 0) for c in counted) == side.recheck.rechecked >= 4
    else:
        assert side.recheck is None
        assert _removed(published) == []
    assert leaks(sim) == []


def test_a_recheck_against_a_hung_redis_announces_nothing_and_stops_no_step(
    make_sim: Any, fresh_redis: Any
) -> None:
    """A real redis-server, SIGSTOPped after a value was deleted behind the engine's back: rechecks run into
    the lookup timeout and announce nothing (a timeout says nothing about the values), and no scheduler step
    waits for them; once the server answers again, the next recheck announces exactly that value."""
    import uuid

    import redis
    from asyncconn_backends.redis.layout import main_key

    url = f"{fresh_redis.url}?timeout=1s&prefix=rc{uuid.uuid4().hex[:8]}:"
    extra = {"kv_events_recheck": "100ms", "lookup_timeout": "300ms", "store_timeout": "1s"}
    sim, published, hashes, value_hashes = _one_prompt_saved(make_sim, url, extra, seed=31)
    assert {h for e in published.ours("CPU") for h in e.block_hashes} == set(hashes)
    worker = sim.workers[0].kv_connector.worker_side
    name = main_key(worker.store.backend.prefix, worker.keys.store_key(value_hashes[1], 0))
    assert redis.Redis(port=fresh_redis.port).delete(name) == 1  # behind the store's back
    side = sim.scheduler.connector.scheduler_side
    assert side.recheck is not None
    timeouts = side.recheck.client.metrics.timeouts

    # vLLM's engine core freezes what start-up allocated (``gc.freeze()``); without it a full collection of
    # torch's and vLLM's objects takes a few hundred ms here, in whichever step it lands.
    gc.collect()
    gc.freeze()
    fresh_redis.pause()
    try:
        deadline = time.monotonic() + 2.0
        n = 0
        while time.monotonic() < deadline:
            n += 1
            sim.add_request(f"hung-{n}", prompt(200 + n, BLOCK + 1), max_tokens=2)
            records = run_checked(sim)
            assert max(r.schedule_ns for r in records) < 0.2e9  # no step waited for the store
        assert side.recheck.client.metrics.timeouts > timeouts  # rechecks were asked, and timed out
        assert _store_removed(published) == []
    finally:
        fresh_redis.resume()
        gc.unfreeze()

    serve_others(sim, until=lambda: bool(_store_removed(published)), seconds=10.0)
    assert _store_removed(published) == [hashes[1]]
    assert leaks(sim) == []


def _one_prompt_saved(
    make_sim: Any, url: str, extra: dict[str, Any], seed: int
) -> tuple[Any, _Published, list[Any], list[bytes]]:
    """A simulator over ``url`` with KV events on that computed and saved one prompt of four values: the
    simulator, what it published, the prompt's block hashes as events carry them, its value hashes."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    sim = make_sim(kv=kv_spec(url, **extra), kv_events=True)
    published = _Published()
    sim.scheduler.kv_event_publisher = published
    tokens = prompt(seed, 4 * BLOCK + 3)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    block_hashes = _request("h", tokens).block_hashes
    hashes = [maybe_convert_block_hash(h) for h in block_hashes]
    value_hashes = sim.workers[0].kv_connector.worker_side.keys.value_hashes(block_hashes)
    return sim, published, hashes, value_hashes


def _store_removed(published: _Published) -> list[Any]:
    """Block hashes of ``redis://``'s ``BlockRemoved`` events (ownership ``asyncconn:redis``)."""
    return [
        h
        for b in published.batches
        for e in b.events
        if isinstance(e, BlockRemoved) and e.ownership == "asyncconn:redis"
        for h in e.block_hashes
    ]
