"""AsyncConnKVConnector against vLLM 0.32's real scheduler (asyncconn_tools.sim.engine), real KV layouts in
workers.

Every test checks the KV bytes of every running request after every step (loaded blocks must equal computed
ones) and ends with the leak check: no request, queue entry, KV block, lookup, load, save, staging buffer or
future left anywhere.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)
from vllm.v1.request import RequestStatus

from asyncconn.transfer.lazy import Pieces
from asyncconn.vllm.kv import saves as kv_saves
from asyncconn_tools.sim.engine import SimShape
from tests.vllm.kv.test_support import (
    EventRouter,
    check_kv,
    check_tier_events,
    kv_spec,
    leaks,
    load_error_blocks,
    prompt,
    run_checked,
    store_url,
)

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


def _fill(make_sim: Any, url: str, prompts: dict[str, list[int]], bpv: int = 1, **kw: Any) -> None:
    """A first instance computes and saves the prompts' KV."""
    sim = make_sim(kv=kv_spec(url, kv_blocks_per_value=bpv), **kw)
    for rid, tokens in prompts.items():
        sim.add_request(rid, tokens, max_tokens=2)
    run_checked(sim)
    assert leaks(sim) == []
    sim.close()


def _waiting_for_kv(sim: Any, rid: str) -> bool:
    request = sim.scheduler.requests.get(rid)
    return request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS


@pytest.fixture(params=[1, 4], ids=["1-block-values", "4-block-values"])
def bpv(request: pytest.FixtureRequest) -> int:
    """Blocks per stored value: 4 exercises values that straddle local hits and partial positions."""
    return int(request.param)


def test_deferral_then_async_load_then_decode(make_sim: Any, bpv: int) -> None:
    url = store_url("20ms")
    tokens = prompt(1, 100)
    _fill(make_sim, url, {"a": tokens}, bpv=bpv)
    sim = make_sim(kv=kv_spec(url, kv_blocks_per_value=bpv))
    sim.add_request("b", [*tokens, 5, 6, 7], max_tokens=3)
    first = sim.step()
    assert first.num_scheduled_tokens == {} and first.waiting == ("b",)  # deferred: lookup in flight
    assert not _waiting_for_kv(sim, "b")
    records = [first, *run_checked(sim)]
    recv_steps = [
        r.index
        for r in records
        if r.kv_connector_output and "b" in (r.kv_connector_output.finished_recving or ())
    ]
    assert len(recv_steps) == 1
    assert all(not r.num_scheduled_tokens for r in records[: recv_steps[0] + 1])
    loaded = min(6 // bpv, 102 // (16 * bpv)) * 16 * bpv  # 96 tokens in 1-block values, 64 in 4-block ones
    assert sim.tokens_computed["b"] == 103 - loaded + 2
    assert sim.outputs["b"] == [7, 7, 7]
    assert leaks(sim) == []


def test_partial_local_hit_loads_only_the_missing_blocks(make_sim: Any) -> None:
    url = store_url()
    tokens = prompt(14, 80)
    _fill(make_sim, url, {"a": tokens}, bpv=4)
    sim = make_sim(kv=kv_spec(url, kv_blocks_per_value=4))
    sim.add_request("local", tokens[:40], max_tokens=1)  # leaves blocks 0-1 in the local prefix cache
    run_checked(sim)
    sim.add_request("b", tokens, max_tokens=2)
    run_checked(sim)
    worker = sim.workers[0].kv_connector.worker_side
    assert worker.loader.loaded == 1  # one 4-block value, of which only positions 2 and 3 were written
    assert sim.tokens_computed["b"] == 80 - 64 + 1
    assert leaks(sim) == []


def test_miss_computes_and_saves_then_hit(make_sim: Any) -> None:
    url = store_url()
    sim = make_sim(kv=kv_spec(url))
    sim.add_request("m", prompt(2, 40), max_tokens=2)
    run_checked(sim)
    assert sim.tokens_computed["m"] == 41
    stats = sim.workers[0].kv_connector.worker_side
    assert stats.saver.saved == 2  # two full blocks of 16
    assert leaks(sim) == []


def test_a_connector_reset_is_refused_and_the_store_keeps_its_values(
    make_sim: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update) is answered False: the
    shared store was not wiped, and a caller told otherwise would serve the old weights' KV. It was not:
    the next request still loads the prompt."""
    url = store_url()
    tokens = prompt(12, 40)
    sim = make_sim(kv=kv_spec(url))
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    with caplog.at_level("WARNING"):
        assert sim.scheduler.reset_prefix_cache(reset_connector=True) is False
    assert "reset_connector asked, not applied" in caplog.text and "key_prefix" in caplog.text
    assert sim.scheduler.reset_prefix_cache()  # vLLM's own cache alone: done
    sim.add_request("b", [*tokens, 7], max_tokens=2)
    run_checked(sim)
    assert sim.tokens_computed["b"] == 41 + 1 - 32  # the two stored blocks were loaded
    assert leaks(sim) == []


def test_abort_during_lookup(make_sim: Any) -> None:
    url = store_url("300ms")
    sim = make_sim(kv=kv_spec(url))
    sim.add_request("x", prompt(3, 64), max_tokens=2)
    sim.step()
    side = sim.scheduler.connector.scheduler_side
    assert side.lookup is not None and side.lookup.pending("x")
    assert sim.abort("x")
    run_checked(sim)
    assert side.lookup.metrics.discards == 1
    assert sim.tokens_computed["x"] == 0
    assert leaks(sim) == []


def test_abort_during_load(make_sim: Any) -> None:
    url = store_url("150ms")
    tokens = prompt(4, 80)
    _fill(make_sim, url, {"a": tokens})
    sim = make_sim(kv=kv_spec(url))
    sim.add_request("b", tokens, max_tokens=4)
    for _ in range(500):
        sim.step()
        if _waiting_for_kv(sim, "b"):
            break
        time.sleep(0.002)
    worker = sim.workers[0].kv_connector.worker_side
    assert worker.held()["fetches"] > 0  # the load is in flight (the store sleeps 150 ms)
    assert sim.abort("b")
    assert "b" in sim.scheduler.requests  # blocks held: a load may still write them
    records = run_checked(sim)
    # vLLM frees an aborted request's blocks on finished_recving: reported there once, never as sent
    got = [
        r for r in records if r.kv_connector_output and "b" in (r.kv_connector_output.finished_recving or ())
    ]
    sent = [
        r for r in records if r.kv_connector_output and "b" in (r.kv_connector_output.finished_sending or ())
    ]
    assert len(got) == 1 and not sent
    assert not set().union(*(r.kv_connector_output.invalid_block_ids or set() for r in got))
    assert sim.tokens_computed["b"] == 0 and sim.finish_reasons["b"] == "abort"
    assert worker.loader.cancelled >= 1
    assert leaks(sim) == []


def test_abort_during_save_holds_blocks_until_saved(make_sim: Any) -> None:
    url = store_url("150ms")
    sim = make_sim(kv=kv_spec(url, lookup_timeout="5s"))
    sim.add_request("s", prompt(5, 64), max_tokens=50)
    while sim.tokens_computed["s"] < 64:
        sim.step()
        time.sleep(0.002)
    saver = sim.workers[0].kv_connector.worker_side.saver
    assert saver.held()["futures_pending"] or saver.held()["requests"]  # saves in flight
    assert sim.abort("s")
    assert "s" in sim.scheduler.requests
    records = run_checked(sim)
    sent = [
        r for r in records if r.kv_connector_output and "s" in (r.kv_connector_output.finished_sending or ())
    ]
    assert len(sent) == 1
    assert saver.saved == 4
    assert leaks(sim) == []


def test_preemption_under_kv_pressure_with_pending_saves(make_sim: Any, bpv: int) -> None:
    url = store_url("30ms")
    shape = SimShape(num_blocks=20)
    sim = make_sim(
        kv=kv_spec(url, kv_blocks_per_value=bpv), shape=shape, max_num_seqs=4, max_num_batched_tokens=128
    )
    for i in range(4):
        sim.add_request(f"p{i}", prompt(10 + i, 48), max_tokens=40)
    records = run_checked(sim)
    assert any(r.preempted for r in records), "the workload must preempt"
    for i in range(4):
        assert len(sim.outputs[f"p{i}"]) == 40
    assert leaks(sim) == []


def test_store_dies_mid_load_recomputes(make_sim: Any, fresh_redis: Any) -> None:
    url = fresh_redis.url
    extra = {"store_timeout": "1s", "lookup_timeout": "1s"}
    tokens = prompt(6, 96)
    sim = make_sim(kv=kv_spec(url, **extra))
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    sim.close()

    sim = make_sim(kv=kv_spec(url, **extra), kv_load_failure_policy="recompute")
    worker = sim.workers[0].kv_connector.worker_side
    original = worker.issue_loads

    def kill_then_issue(meta: Any) -> None:
        # The store dies between the lookup's answer and the loads: before they are issued, which on a CPU
        # engine is at bind time, before start_load_kv (killed there, a load could land first).
        if meta.loads and fresh_redis.alive:
            fresh_redis.kill()
        original(meta)

    worker.issue_loads = kill_then_issue  # type: ignore[method-assign]
    sim.add_request("b", tokens, max_tokens=3)
    records = run_checked(sim)
    assert len(load_error_blocks(records)) == 5  # 95 usable tokens: 5 blocks planned, all failed
    assert sim.tokens_computed["b"] == 96 + 2  # everything recomputed
    assert sim.outputs["b"] == [7, 7, 7]
    assert worker.loader.failures  # counted as store errors
    assert leaks(sim) == []


def test_corrupt_value_is_a_load_error_not_garbage(make_sim: Any) -> None:
    import asyncio

    from asyncconn.backend import open_backend

    url = store_url()
    tokens = prompt(7, 64)
    _fill(make_sim, url, {"a": tokens})
    sim = make_sim(kv=kv_spec(url), kv_load_failure_policy="recompute")
    keys = sim.workers[0].kv_connector.worker_side.keys
    second = keys.store_key(keys.value_hashes(sim_hashes(tokens))[1], 0)

    async def corrupt() -> None:
        backend = await open_backend(url)
        (value,) = await backend.get([second])
        assert value is not None
        raw = bytearray(b"".join(bytes(c) for c in value))
        raw[-1] ^= 0xFF
        await backend.put([(second, bytes(raw))])

    asyncio.run(corrupt())
    sim.add_request("b", tokens, max_tokens=2)
    records = run_checked(sim)
    invalid = set().union(
        *(r.kv_connector_output.invalid_block_ids or set() for r in records if r.kv_connector_output)
    )
    assert len(invalid) == 1
    assert sim.tokens_computed["b"] == 64 - 16 + 1  # block 0 loaded; blocks 1.. recomputed from the bad one
    assert leaks(sim) == []
    # the bad value was deleted and saved again by the request that recomputed it: a third engine loads all
    healed = make_sim(kv=kv_spec(url), kv_load_failure_policy="recompute")
    healed.add_request("c", tokens, max_tokens=2)
    run_checked(healed)
    assert healed.tokens_computed["c"] == 64 - 48 + 1
    assert leaks(healed) == []


def sim_hashes(tokens: list[int], block_size: int = 16) -> list[bytes]:
    """vLLM's block hashes of a prompt (what the scheduler side keys values by)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    request = Request(
        "h",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )
    return [bytes(h) for h in request.block_hashes]


def test_prefix_shared_by_many_requests(make_sim: Any, bpv: int) -> None:
    url = store_url("5ms")
    shared = prompt(8, 64)
    _fill(make_sim, url, {"a": shared}, bpv=bpv)
    sim = make_sim(
        kv=kv_spec(url, kv_blocks_per_value=bpv),
        max_num_seqs=16,
        max_num_batched_tokens=512,
        shape=SimShape(num_blocks=128),
    )
    for i in range(12):
        sim.add_request(f"s{i}", [*shared, *prompt(100 + i, 20)], max_tokens=2)
    run_checked(sim)
    worker = sim.workers[0].kv_connector.worker_side
    for i in range(12):
        assert sim.tokens_computed[f"s{i}"] <= 20 + 1
    # the 12 lookups are answered by one store call, so all 12 loads are planned in one step: each shared
    # value is fetched once for all of them (coalesced), not once per request
    assert worker.loader.loaded == 4 // bpv
    assert leaks(sim) == []


def test_tensor_parallel_two_workers(make_sim: Any) -> None:
    import asyncio

    from asyncconn.backend import open_backend

    url = store_url()
    tokens = prompt(9, 80)

    def tp_sim(**kw: Any) -> Any:
        sim = make_sim(kv=kv_spec(url), num_workers=2, **kw)
        return sim

    sim = tp_sim()
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    assert leaks(sim) == []
    sim.close()

    sim = tp_sim()
    worker_keys = sim.workers[1].kv_connector.worker_side.keys
    hashes = worker_keys.value_hashes(sim_hashes(tokens))
    assert worker_keys.store_key(hashes[0], 0) != worker_keys.store_key(hashes[0], 1)

    async def drop_rank1_value3() -> None:
        backend = await open_backend(url)
        assert await backend.delete([worker_keys.store_key(hashes[3], 1)]) == 1

    asyncio.run(drop_rank1_value3())
    sim.add_request("b", tokens, max_tokens=2)
    run_checked(sim)
    # values 0-2 are present on both ranks; value 3 only on rank 0, so the prefix ends at 48 tokens
    assert sim.tokens_computed["b"] == 80 - 48 + 1
    assert leaks(sim) == []


def test_roles_producer_never_loads_consumer_never_saves(make_sim: Any) -> None:
    url = store_url()
    tokens = prompt(11, 64)
    producer = make_sim(kv=kv_spec(url, role="kv_producer"))
    producer.add_request("a", tokens, max_tokens=2)
    run_checked(producer)
    assert producer.scheduler.connector.scheduler_side.lookup is None
    assert producer.workers[0].kv_connector.worker_side.saver.saved == 4
    assert leaks(producer) == []
    consumer = make_sim(kv=kv_spec(url, role="kv_consumer"))
    consumer.add_request("b", [*tokens, 1], max_tokens=2)
    consumer.add_request("c", prompt(12, 64), max_tokens=2)
    run_checked(consumer)
    assert consumer.tokens_computed["b"] == 1 + 1
    assert consumer.workers[0].kv_connector.worker_side.saver.saved == 0
    assert leaks(consumer) == []


def test_stats_reach_vllm_hooks(make_sim: Any) -> None:
    from asyncconn.vllm.kv.connector import AsyncConnKVConnector

    url = store_url()
    tokens = prompt(13, 64)
    _fill(make_sim, url, {"a": tokens})
    sim = make_sim(kv=kv_spec(url))
    sim.add_request("b", [*tokens, 3], max_tokens=2)
    records = run_checked(sim)
    worker_stats = [r.kv_connector_output.kv_connector_stats for r in records if r.kv_connector_output]
    merged = AsyncConnKVConnector.build_kv_connector_stats()
    assert merged is not None
    for s in worker_stats:
        if s is not None:
            merged.aggregate(s)
    reduced = merged.reduce()
    assert reduced["tokens_loaded"] == 64 and reduced["loads"] == 4 and reduced["bytes_loaded"] > 0
    lookups = sim.scheduler.connector.scheduler_side.lookup.metrics
    assert lookups.completed == 1 and lookups.hits == 1
    assert leaks(sim) == []


def test_lookups_through_a_lookup_server(make_sim: Any, runtime: Any) -> None:
    """``lookup_server`` set: lookups go over ZMQ to ``asyncconn lookup-server``, which must name the keys
    exactly as the savers write them (same ``key_prefix``, hex of the bytes key)."""
    from asyncconn.lookup import LookupServer
    from asyncconn.store import TensorStore

    url = store_url()
    tokens = prompt(15, 64)
    sim = make_sim(kv=kv_spec(url, key_prefix="kv:"))
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    sim.close()

    async def start() -> LookupServer:
        server = LookupServer(await TensorStore.open(url), "tcp://127.0.0.1:*", key_prefix="kv:")
        await server.start()
        return server

    server = runtime.run(start(), timeout=10)
    try:
        sim = make_sim(kv=kv_spec(url, key_prefix="kv:", lookup_server=server.endpoint))
        sim.add_request("b", [*tokens, 1], max_tokens=2)
        run_checked(sim)
        assert sim.tokens_computed["b"] == 1 + 1
        assert server.stats.lookups >= 1
        assert leaks(sim) == []
    finally:
        runtime.run(server.close(), timeout=10)


@pytest.mark.parametrize(
    ("sync_loads", "tier"),
    [(False, None), (True, None), (False, "8KiB")],
    ids=["async-loads", "sync-loads", "async-loads-small-host-tier"],
)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_workload_with_aborts_and_preemptions(
    make_sim: Any, seed: int, sync_loads: bool, tier: str | None
) -> None:
    """Shared prefixes, a small KV pool (preemptions), a slow store and aborts at random moments: KV correct
    after every step on both ranks, every request finished, nothing left anywhere -- with asynchronous loads,
    with sync loads (``kv_sync_loads``), and with a host tier of a few values per rank (evicting all the
    time: announced values withdrawn and acknowledged, loads' values claimed; asyncconn.vllm.kv.tiernews)."""
    import random

    rng = random.Random(seed)
    bpv = 1 + seed % 2
    url = store_url("3ms")
    prefixes = [prompt(200 + seed * 10 + i, rng.choice([32, 48, 64])) for i in range(3)]

    def workload(sim: Any, tag: str, n: int) -> set[str]:
        ids = set()
        for i in range(n):
            rid = f"{tag}{i}"
            tokens = [*rng.choice(prefixes), *prompt(rng.randrange(10_000), rng.randint(1, 40))]
            sim.add_request(rid, tokens, max_tokens=rng.randint(1, 24))
            ids.add(rid)
        return ids

    def tp_sim() -> Any:
        sim = make_sim(
            kv=kv_spec(url, kv_blocks_per_value=bpv, kv_sync_loads=sync_loads, host_cache_bytes=tier or 0),
            num_workers=2,
            shape=SimShape(num_blocks=24),
            max_num_seqs=8,
            max_num_batched_tokens=96,
            kv_load_failure_policy="recompute",
            kv_events=True,  # the KV events' per-request records too must end at zero (``leaks``)
        )
        return sim

    evictions = published = 0
    for wave in range(2):
        sim = tp_sim()
        router = EventRouter()
        sim.scheduler.kv_event_publisher = router
        ids = workload(sim, f"w{wave}-", 10)
        steps = 0
        while sim.scheduler.has_requests() or sim.scheduler.requests:
            assert steps < 3000
            record = sim.step()
            steps += 1
            check_kv(sim)
            if tier is not None:  # the tiers' events: what a router holds, every tier still serves
                published = max(published, check_tier_events(sim, router))
            live = [r for r in ids if r not in sim.finish_reasons]
            if live and rng.random() < 0.04:
                sim.abort(rng.choice(live))
            if not record.num_scheduled_tokens:
                time.sleep(0.002)
        assert set(sim.finish_reasons) == ids
        assert leaks(sim) == []
        if tier is not None:
            evictions += sum(w.kv_connector.worker_side.store.host_tier.stats.evictions for w in sim.workers)
        sim.close()
    assert tier is None or evictions > 0  # the small tier did evict (announced values withdrawn)
    assert tier is None or published > 0  # and its events were published


def test_tp_abort_after_one_rank_reported_its_load(make_sim: Any) -> None:
    """Rank 0's load lands (and is reported) before the abort, rank 1's after: vLLM's aggregator needs one
    report per rank of the same kind, so both must end in finished_recving (the scheduler says which)."""
    url = store_url()
    tokens = prompt(16, 80)

    def tp_sim() -> Any:
        sim = make_sim(kv=kv_spec(url), num_workers=2)
        return sim

    sim = tp_sim()
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    sim.close()

    sim = tp_sim()
    fast, slow = (w.kv_connector.worker_side for w in sim.workers)
    slow.store.backend.latency = 0.3  # rank 1's store answers late
    sim.add_request("b", tokens, max_tokens=2)
    for _ in range(500):
        sim.step()
        if fast.held()["req_loads"] == 0 and slow.held()["req_loads"] == 1:
            break
        time.sleep(0.002)
    assert _waiting_for_kv(sim, "b")  # rank 0 reported, the merged output has not
    assert sim.abort("b")
    records = run_checked(sim, max_steps=500)
    got = [
        r for r in records if r.kv_connector_output and "b" in (r.kv_connector_output.finished_recving or ())
    ]
    assert len(got) == 1
    assert leaks(sim) == []


def test_bad_config_and_unreachable_store_fail_at_start_up(make_sim: Any) -> None:
    """Errors surface when the engine starts, as asyncconn's own types, never later inside schedule()."""
    from asyncconn.exceptions import BackendUnavailable, ConfigError
    from tests.servers import free_port

    with pytest.raises(ConfigError, match="kv_blocks_per_value"):
        make_sim(kv=kv_spec(store_url(), kv_blocks_per_value=0))
    with pytest.raises(ConfigError, match="no_such_key"):
        make_sim(kv=kv_spec(store_url(), no_such_key=1))
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(BackendUnavailable):
        make_sim(kv=kv_spec(dead, store_timeout="1s", lookup_timeout="1s"))


def test_a_method_of_the_other_role_raises_runtime_state_error(make_sim: Any) -> None:
    """Each facade builds one side; asking a scheduler-role connector for worker work (and back) is the same
    error type as in the EC connector: RuntimeStateError, naming the side."""
    from asyncconn.exceptions import RuntimeStateError

    sim = make_sim(kv=kv_spec(store_url()))
    scheduler_role, worker_role = sim.scheduler.connector, sim.workers[0].kv_connector
    with pytest.raises(RuntimeStateError, match="worker-side KV method"):
        _ = scheduler_role.worker_side
    with pytest.raises(RuntimeStateError, match="worker-side KV method"):
        scheduler_role.get_block_ids_with_load_errors()
    with pytest.raises(RuntimeStateError, match="scheduler-side KV method"):
        _ = worker_role.scheduler_side
    with pytest.raises(RuntimeStateError, match="scheduler-side KV method"):
        worker_role.update_connector_output(None)


def test_cpu_wait_for_save_names_values_by_hash_and_gathers_on_the_copy_thread(
    make_sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's thread hands each request's values over as one Pieces range named by value hash; the gather
    and the store keys run on the save tracker's copy thread; the saved values are the lookup's keys."""
    url = store_url()
    sim = make_sim(kv=kv_spec(url))
    worker = sim.workers[0].kv_connector.worker_side
    calls: list[tuple[str, int, bool, bool]] = []
    gathers: list[str] = []
    submit_many, gather = worker.saver.submit_many, kv_saves._gather_rows

    def record_submit(rid: str, keys: Any, values: Any, *, name: Any = None) -> int:
        calls.append((rid, len(keys), isinstance(values, Pieces), all(isinstance(k, bytes) for k in keys)))
        return int(submit_many(rid, keys, values, name=name))

    def record_gather(*args: Any) -> Any:
        gathers.append(threading.current_thread().name)
        return gather(*args)

    monkeypatch.setattr(worker.saver, "submit_many", record_submit)
    monkeypatch.setattr(kv_saves, "_gather_rows", record_gather)
    tokens = prompt(21, 40)
    sim.add_request("a", tokens, max_tokens=2)
    run_checked(sim)
    assert calls == [("a", 2, True, True)]  # two full blocks, one call, hashes not store keys
    assert gathers == ["asyncconn-save-copy"]
    assert worker.saver.saved == 2
    assert leaks(sim) == []
    sim.close()
    # a second instance finds both values under the keys the scheduler asks for
    second = make_sim(kv=kv_spec(url))
    second.add_request("b", tokens, max_tokens=1)
    run_checked(second)
    assert second.workers[0].kv_connector.worker_side.loader.loaded == 2
    assert leaks(second) == []


@pytest.mark.parametrize("mla", [True, False], ids=["mla", "per-head"])
def test_mla_ranks_share_one_copy_saved_by_rank_0(make_sim: Any, mla: bool) -> None:
    """MLA (``MLAAttentionSpec``): every TP rank holds the same latent KV, so a value is stored once, under a
    key every rank names alike; rank 0 saves it, rank 1 saves nothing yet reports its saves finished (vLLM's
    aggregator waits for both ranks), and both ranks load rank 0's copy byte-exact. A model whose ranks hold
    other heads keeps a key per rank."""
    url = store_url()
    tokens = prompt(23, 96)  # 6 full blocks; the last token is never a hit, so 5 values load
    shape = SimShape(mla=mla)

    sim = make_sim(kv=kv_spec(url), num_workers=2, shape=shape)
    sides = [w.kv_connector.worker_side for w in sim.workers]
    keys = sides[1].keys
    sim.add_request("a", tokens, max_tokens=2)
    records = run_checked(sim)
    sent = [
        r for r in records if r.kv_connector_output and "a" in (r.kv_connector_output.finished_sending or ())
    ]
    assert len(sent) == 1  # both ranks reported the request's saves finished: vLLM freed it once
    assert leaks(sim) == []
    assert [side.saver.saved for side in sides] == ([6, 0] if mla else [6, 6])
    assert len(sides[0].store.backend) == (6 if mla else 12)  # values in the store for 6 blocks
    hashes = keys.value_hashes(sim_hashes(tokens))
    assert (keys.store_key(hashes[0], 0) == keys.store_key(hashes[0], 1)) is mla
    assert keys.replicated is mla
    assert [keys.saves_on(rank) for rank in (0, 1)] == [True, not mla]
    assert keys.lookup_keys(hashes[:2]) == (
        [keys.value_key(hashes[0], 0), keys.value_key(hashes[1], 0)]
        if mla
        else [keys.value_key(h, rank) for h in hashes[:2] for rank in (0, 1)]
    )
    sim.close()

    sim = make_sim(kv=kv_spec(url), num_workers=2, shape=shape)
    sim.add_request("b", tokens, max_tokens=2)
    run_checked(sim)  # every rank's KV byte-equal to what computing it gives, after every step
    assert sim.tokens_computed["b"] == 96 - 80 + 1
    assert [w.kv_connector.worker_side.loader.loaded for w in sim.workers] == [5, 5]
    assert [w.kv_connector.worker_side.saver.saved for w in sim.workers] == [0, 0]
    assert leaks(sim) == []
