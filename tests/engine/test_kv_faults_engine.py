"""The KV connector's lifecycle and faults in vLLM's real engine.

Aborts while a lookup, a load or a save is in flight, and while a read writes a request's blocks in place;
preemption under a small KV cache with chunked prefill; a store killed before and during loads; a store
hung or killed during sync loads; corrupt values. Each ends with the engine healthy (greedy tokens and KV
bytes equal a reference engine's) and every connector structure and KV block back to zero.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from asyncconn_backends.file import FileBackend

from asyncconn.transfer import Failure, StreamLoader
from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import (
    PROMPTS,
    assert_idle,
    assert_same_kv,
    assert_store_serves_cleanly,
    generate,
    sampling,
    save_prompts,
)
from tests.servers import RedisServer

pytestmark = pytest.mark.vllm


def internal_ids(probe: Probe, request_id: str) -> list[str]:
    return [rid for rid in probe.scheduler.requests if rid.startswith(request_id)]


def status_of(probe: Probe, request_id: str) -> str | None:
    ids = internal_ids(probe, request_id)
    return None if not ids else probe.scheduler.requests[ids[0]].status.name


def step_until(probe: Probe, cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        probe.llm.llm_engine.step()
        time.sleep(0.005)


def test_aborts_while_a_lookup_a_load_or_a_save_is_in_flight(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], fresh_redis: RedisServer
) -> None:
    save_prompts(text_model, fresh_redis.url)
    llm = make_llm(text_model, kv=kv_config(backend_url=fresh_redis.url, lookup_timeout="1s"))
    engines.append(llm)
    probe = Probe(llm)
    engine = llm.llm_engine

    # 1. A lookup in flight: the store is frozen, so the request waits for its answer; abort it there.
    fresh_redis.pause()
    try:
        engine.add_request("lookup", {"prompt_token_ids": PROMPTS[0]}, sampling())
        for _ in range(5):
            engine.step()
            time.sleep(0.01)
        assert status_of(probe, "lookup") == "WAITING"
        assert probe.kv_scheduler_connector().scheduler_side.held()["lookup_entries"] == 1
        engine.abort_request(["lookup"])
        engine.step()
    finally:
        fresh_redis.resume()

    # 2. A load in flight: the request parks in WAITING_FOR_REMOTE_KVS while its blocks load; abort it there.
    engine.add_request("load", {"prompt_token_ids": PROMPTS[1]}, sampling())
    step_until(probe, lambda: status_of(probe, "load") == "WAITING_FOR_REMOTE_KVS", "a load in flight")
    engine.abort_request(["load"])

    # 3. A save in flight: with the store frozen the lookup times out (a miss), the prompt is computed and
    # its saves wait on the frozen store; abort mid-decode.
    fresh = [t + 1 for t in PROMPTS[2]]
    fresh_redis.pause()
    try:
        engine.add_request("save", {"prompt_token_ids": fresh}, sampling(max_tokens=50))
        step_until(probe, lambda: status_of(probe, "save") == "RUNNING", "the new prompt to run")
        for _ in range(3):
            engine.step()
        worker = probe.kv_worker_connector().worker_side
        assert worker.saver.held()["requests"] > 0, "no save was in flight"
        engine.abort_request(["save"])
        engine.step()
    finally:
        fresh_redis.resume()

    assert_idle(probe)
    # The engine is healthy afterwards: loads give the reference tokens and bytes.
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert_idle(probe)


def test_preemption_under_a_small_kv_cache_with_chunked_prefill(
    text_model: Path, engines: list[Any], tmp_path: Path
) -> None:
    url = f"file://{tmp_path / 'store'}"
    small = {"kv_cache_bytes": 16 * 32 << 10, "max_model_len": 320, "max_num_batched_tokens": 64}
    ref = make_llm(text_model, **small)  # type: ignore[arg-type]
    engines.append(ref)
    want = generate(ref, PROMPTS, max_tokens=40)
    assert Probe(ref).metrics().get("vllm:num_preemptions", 0) > 0, "the cache is not small enough"
    close_llm(ref)
    engines.remove(ref)

    save_prompts(text_model, url)
    llm = make_llm(text_model, kv=kv_config(backend_url=url), **small)  # type: ignore[arg-type]
    engines.append(llm)
    probe = Probe(llm)
    assert generate(llm, PROMPTS, max_tokens=40) == want
    metrics = probe.metrics()
    assert metrics["vllm:num_preemptions"] > 0
    assert metrics["vllm:external_prefix_cache_hits"] > 0
    assert_idle(probe)


def test_a_store_killed_before_or_during_loads_means_recompute_not_a_hang(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], fresh_redis: RedisServer
) -> None:
    save_prompts(text_model, fresh_redis.url)
    llm = make_llm(
        text_model, kv=kv_config(backend_url=fresh_redis.url, store_timeout="1s", lookup_timeout="1s")
    )
    engines.append(llm)
    probe = Probe(llm)
    engine = llm.llm_engine
    # Killed between the lookup and the load: the loads fail, vLLM recomputes those blocks.
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, sampling())
    step_until(
        probe,
        lambda: any(r.status.name == "WAITING_FOR_REMOTE_KVS" for r in probe.scheduler.requests.values()),
        "a load in flight",
    )
    fresh_redis.kill()
    outputs: dict[str, list[int]] = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the engine hung on a dead store"
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    assert [outputs[f"r{i}"] for i in range(len(PROMPTS))] == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)  # recomputed, so the reference's bytes
    # Dead from the start of a request: a miss, computed locally.
    started = time.monotonic()
    other = [[t + 2 for t in p] for p in PROMPTS]
    generate(llm, other)
    assert time.monotonic() - started < 30
    assert_idle(probe)


def test_an_abort_while_a_read_writes_the_blocks_in_place_holds_them_until_the_read_ends(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``file://`` on a CPU engine reads a value straight into the request's cache blocks. Abort the request
    while that read is held: vLLM must not get the request back (nor free its blocks) until the read has
    ended, another request meanwhile runs beside it, and afterwards everything is idle and the
    engine still loads byte for byte."""
    root = tmp_path / "store"
    save_prompts(text_model, f"file://{root}")
    started, release = threading.Event(), threading.Event()
    held: list[int] = []
    real = FileBackend._read_many

    def gated(self: FileBackend, reads: Any, cached_only: bool = False) -> list[int | None]:
        if cached_only and not held:  # the first in-place read only
            held.append(len(reads))
            started.set()
            assert release.wait(30), "the test never released the read"
        return real(self, reads, cached_only)

    monkeypatch.setattr(FileBackend, "_read_many", gated)
    llm = make_llm(text_model, kv=kv_config(backend_url=f"file://{root}"))
    engines.append(llm)
    probe = Probe(llm)
    engine = llm.llm_engine
    worker = probe.kv_worker_connector().worker_side
    try:
        engine.add_request("held", {"prompt_token_ids": PROMPTS[0]}, sampling())
        step_until(probe, started.is_set, "the in-place read to start")
        assert status_of(probe, "held") == "WAITING_FOR_REMOTE_KVS"
        engine.abort_request(["held"])
        for _ in range(5):
            engine.step()
            time.sleep(0.01)
        # Aborted, but its blocks are still being written: the worker keeps its load, vLLM its blocks.
        assert worker.held()["req_loads"] == 1 and internal_ids(probe, "held")
        # Another request (a prompt the store lacks, so it shares no read with the held one) runs and
        # finishes beside it.
        engine.add_request("beside", {"prompt_token_ids": [t + 1 for t in PROMPTS[2]]}, sampling())
        step_until(probe, lambda: status_of(probe, "beside") is None, "the other request to finish")
        assert worker.held()["req_loads"] == 1
    finally:
        release.set()
    step_until(probe, lambda: not internal_ids(probe, "held"), "the aborted request to be released")
    assert held and worker.loader.totals()["reads_in_place"] > 0
    assert_idle(probe)
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert_idle(probe)


def test_an_abort_while_a_redis_read_writes_the_blocks_in_place_stops_the_read(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    fresh_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``redis://`` on a CPU engine reads values straight into the request's cache blocks too. The store
    stops answering (SIGSTOP) as the loads are issued, so the reads hang inside those blocks; the request is
    aborted. Its reads are stopped at once: vLLM gets the request back while the store is still stopped,
    long before the store's and the load's timeouts (60 s here). Afterwards everything is idle and the
    engine loads byte for byte."""
    save_prompts(text_model, fresh_redis.url)
    timeouts = {"store_timeout": "60s", "load_timeout": "60s"}
    url = f"{fresh_redis.url}?timeout=60s"  # the connection's own bound too
    llm = make_llm(text_model, kv=kv_config(backend_url=url, **timeouts))
    engines.append(llm)
    probe = Probe(llm)
    engine = llm.llm_engine
    worker = probe.kv_worker_connector().worker_side
    issue_loads = worker.issue_loads
    paused: list[bool] = []

    def issue_then_hang(meta: Any) -> Any:
        if meta.loads and not paused:
            paused.append(True)
            fresh_redis.pause()  # before the reads are sent: they are in flight when it hangs
        return issue_loads(meta)

    monkeypatch.setattr(worker, "issue_loads", issue_then_hang)
    try:
        engine.add_request("held", {"prompt_token_ids": PROMPTS[0]}, sampling())
        step_until(probe, lambda: worker.loader.totals()["reads_in_place"] > 0, "the in-place reads to start")
        assert status_of(probe, "held") == "WAITING_FOR_REMOTE_KVS" and paused
        engine.abort_request(["held"])
        started = time.monotonic()
        step_until(probe, lambda: not internal_ids(probe, "held"), "the aborted request to be released", 10)
        assert time.monotonic() - started < 10  # the store is still stopped: nothing else ended the reads
        assert worker.held()["req_loads"] == 0
    finally:
        fresh_redis.resume()
    monkeypatch.undo()
    assert_idle(probe)
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert worker.loader.totals()["loaded_in_place"] > 0
    assert_idle(probe)


@pytest.mark.parametrize("sync_loads", [False, True], ids=["async-loads", "sync-loads"])
def test_corrupt_stored_values_are_recomputed(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], tmp_path: Path, sync_loads: bool
) -> None:
    """Every stored value has one bit flipped: each is refused, deleted and recomputed, and what the engine
    saves instead is good -- a third engine loads all of it with no failure. With sync loads the step that
    loads also computes the prompt's tail on top of the bad blocks: vLLM drops that step's output and
    recomputes, and the values that step computed are not saved."""
    root = tmp_path / "store"
    save_prompts(text_model, f"file://{root}")
    damaged = 0
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        data = bytearray(path.read_bytes())
        data[-5] ^= 0x01  # one bit of the payload
        path.write_bytes(bytes(data))
        damaged += 1
    assert damaged >= len(PROMPTS)
    loader = _recomputes_a_damaged_store(
        text_model, engines, kv_reference, f"file://{root}", kv_sync_loads=sync_loads
    )
    assert loader.failures, "no load failed on a corrupt value"
    assert BLOCK_SIZE == 32


def test_corrupt_values_read_in_place_from_redis_are_recomputed(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], fresh_redis: RedisServer
) -> None:
    """Over ``redis://`` a CPU engine reads each value straight into the request's blocks, before its
    checksum is known. Every stored value has one payload bit flipped in the server: each is refused and
    deleted, its blocks recomputed (tokens and KV bytes equal the reference's), and what the engine saves
    instead is good -- a third engine loads all of it with no failure."""
    save_prompts(text_model, fresh_redis.url)
    client = redis.Redis(port=fresh_redis.port)
    damaged = 0
    try:
        for key in client.scan_iter(count=1000):
            if client.type(key) != b"string" or client.strlen(key) < 1024:
                continue  # KV values of this model are stored inline, whole
            at = client.strlen(key) - 5
            byte = cast(bytes, client.getrange(key, at, at))
            client.setrange(key, at, bytes([byte[0] ^ 0x01]))
            damaged += 1
    finally:
        client.close()
    assert damaged >= len(PROMPTS)
    loader = _recomputes_a_damaged_store(text_model, engines, kv_reference, fresh_redis.url)
    assert loader.failures[Failure.CORRUPT] >= damaged // 2, loader.failures  # shared values: read once


def _recomputes_a_damaged_store(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], url: str, **kv: Any
) -> StreamLoader:
    """An engine over ``url``, whose values are damaged, gives the reference's tokens and KV bytes (the
    blocks it read the damaged values into, in place, recomputed); a third engine then loads what it saved
    instead with no failure. Its loader, for the caller's counts."""
    llm = make_llm(text_model, kv=kv_config(backend_url=url, **kv))
    engines.append(llm)
    probe = Probe(llm)
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    loader = probe.kv_worker_connector().worker_side.loader
    assert loader.totals()["reads_in_place"] > 0  # straight into the blocks vLLM then recomputed
    assert_idle(probe)
    close_llm(llm)
    engines.remove(llm)
    assert_store_serves_cleanly(text_model, url, engines, kv_reference)
    return loader


def test_a_failed_sync_load_saves_nothing_computed_on_top_of_it(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], tmp_path: Path
) -> None:
    """With sync loads the step that loads a prompt's first four values also computes its next two. When
    value 1 (shared by all four prompts, through vLLM's prefix cache) turns out corrupt, what that step
    computed is wrong for every prompt that read it: vLLM drops it and recomputes, and none of it may reach
    the store (the recomputed values' saves would then be skipped as existing). A third engine loads every
    value the second one left in the store, byte for byte, with no failure."""
    root = tmp_path / "store"
    save_prompts(text_model, f"file://{root}")
    llm = make_llm(text_model, kv=kv_config(backend_url=f"file://{root}", kv_sync_loads=True))
    engines.append(llm)
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    backend: FileBackend = worker.store.backend  # type: ignore[assignment]
    shared: set[str] = set()
    for prompt in PROMPTS:
        keys = [worker.keys.store_key(h, 0) for h in worker.keys.value_hashes(probe.block_hashes(prompt))]
        assert len(keys) == 6
        for key in keys[4:]:  # the store holds values 0-3: the step that loads them computes 4 and 5
            backend.path_for(key).unlink()
        shared.add(keys[1])
    (value_1,) = shared  # the prompts share their first 3 blocks: value 1 is one file
    path = backend.path_for(value_1)
    data = bytearray(path.read_bytes())
    middle = len(data) // 2  # a middle layer's KV: the layers after it compute other KV on top of it
    for i in range(4):  # one of the four is a float's exponent byte
        data[middle + i] ^= 0x40
    path.write_bytes(bytes(data))
    assert generate(llm, PROMPTS) == kv_reference["tokens"]
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert worker.loader.failures, "no load failed on the corrupt value"
    assert_idle(probe)
    close_llm(llm)
    engines.remove(llm)
    assert_store_serves_cleanly(text_model, f"file://{root}", engines, kv_reference)


@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_a_store_hung_or_killed_during_a_sync_load_holds_the_step_no_longer_than_load_timeout(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    fresh_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
    fault: str,
) -> None:
    """``kv_sync_loads``: vLLM's thread waits in ``start_load_kv`` for the step's loads, the one wait its
    contract demands. The store stops answering (SIGSTOP) or dies (SIGKILL) the moment the first sync loads
    are issued, with their reads in flight: that step's wait ends within its bound (``load_timeout`` past
    the load's own deadline; a hung store's reads take their whole timeout), the blocks are recomputed
    (tokens and KV bytes equal the reference's), nothing hangs, and every connector structure is back to
    zero afterwards (once a hung store answers again; a dead one stays dead)."""
    save_prompts(text_model, fresh_redis.url)
    timeouts = {"store_timeout": "1s", "lookup_timeout": "1s", "load_timeout": "1s"}
    llm = make_llm(text_model, kv=kv_config(backend_url=fresh_redis.url, kv_sync_loads=True, **timeouts))
    engines.append(llm)
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    issue_loads, start_load_kv = worker.issue_loads, worker.start_load_kv
    load_errors = worker.get_block_ids_with_load_errors
    waits: list[float] = []
    reported: set[int] = set()

    faulted: list[str] = []

    def issue_then_hang(meta: Any) -> Any:
        # Stopped before the reads are sent, so that they are in flight when it hangs or dies: stopping it
        # after the issue raced the reads, which a fast store answered first (nothing left to recompute).
        first = any(spec.sync for spec in meta.loads) and not faulted
        if first:
            faulted.append(fault)
            fresh_redis.pause()
        out = issue_loads(meta)
        if first and fault == "killed":
            assert fresh_redis.proc is not None
            fresh_redis.proc.kill()  # SIGKILL ends a stopped process too: it never answers them
            fresh_redis.proc.wait(5)
        return out

    def timed(meta: Any) -> None:
        started = time.monotonic()
        start_load_kv(meta)
        if any(spec.sync for spec in meta.loads):
            waits.append(time.monotonic() - started)

    def errors() -> set[int]:
        out = load_errors()
        reported.update(out)
        return out

    monkeypatch.setattr(worker, "issue_loads", issue_then_hang)
    monkeypatch.setattr(worker, "start_load_kv", timed)
    monkeypatch.setattr(worker, "get_block_ids_with_load_errors", errors)
    try:
        started = time.monotonic()
        assert generate(llm, PROMPTS) == kv_reference["tokens"]
        assert time.monotonic() - started < 30, "the engine waited on a hung store"
    finally:
        if fault == "hung":
            fresh_redis.resume()
    assert waits and waits[0] < 3.5, waits  # the load's deadline (1 s), at most 1 s more, slack
    if fault == "hung":
        assert waits[0] > 0.9, waits  # the reads were in flight on the stopped store: their timeout
    assert reported, "no block was reported for recompute"
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    assert_idle(probe)
