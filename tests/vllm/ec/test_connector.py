"""AsyncConnECConnector against vLLM 0.32's real scheduler (through :mod:`asyncconn_tools.sim.engine`).

Every scenario ends with the engine's leak check and the connector's own counters back to zero: no
requests, no lookups, no prefetches staged or loading, no pending futures or staging buffers.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.backend import open_backend
from asyncconn.exceptions import ConfigError, RuntimeStateError
from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn.url import parse_url
from asyncconn.vllm.ec.metadata import SAVING_PARAM
from asyncconn.vllm.ec.scheduler import ItemState
from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, MMItem, SimShape, embedding_for

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

HIDDEN = SimShape().hidden_size
CLASS, MODULE = "AsyncConnECConnector", "asyncconn.vllm"
_ids = itertools.count()


def store_url(latency: str = "") -> str:
    """A private in-process store; E and PD of one test share it by name."""
    name = f"ec-{uuid.uuid4().hex[:8]}"
    return f"memory://{name}" + (f"?latency={latency}" if latency else "")


def spec(role: str, url: str, **extra: Any) -> ConnectorSpec:
    return ConnectorSpec(CLASS, MODULE, role, {"backend_url": url, **extra})


def prompt(n: int = 64) -> list[int]:
    base = next(_ids) * 13
    return [(base + i) % 1000 for i in range(n)]


def sched(sim: EngineSim) -> Any:
    return sim.scheduler.ec_connector.scheduler_side


def workers(sim: EngineSim) -> list[Any]:
    return [w.ec_connector.worker_side for w in sim.workers]


def stats(sim: EngineSim) -> dict[str, int]:
    """Every event the scheduler side has counted (its own and the workers' reports)."""
    return dict(sched(sim).totals())


def assert_no_leaks(sim: EngineSim) -> None:
    assert sim.leak_check() == []
    held = {k: v for k, v in sched(sim).held().items() if v and k != "pushing"}
    assert held == {}, held
    for worker in workers(sim):
        worker.poll()
        held = {k: v for k, v in worker.held().items() if v}
        assert held == {}, held


def run(sim: EngineSim, max_steps: int = 2000, pause: float = 0.0) -> None:
    """Step until idle; ``pause`` leaves the loop thread time for a slow store between steps."""
    steps = 0
    while sim.scheduler.has_requests() or sim.scheduler.requests:
        sim.step()
        steps += 1
        assert steps < max_steps, f"not idle after {max_steps} steps"
        if pause:
            time.sleep(pause)


def produce(make_sim: Callable[..., EngineSim], url: str, items: list[MMItem]) -> dict[str, Any]:
    """Run an E instance over ``items`` (one request each); return the ec_transfer_params E answered."""
    e = make_sim(ec=spec("ec_producer", url))
    params = capture_params(e)
    for item in items:
        e.add_request(f"e-{item.identifier}", prompt(item.offset + item.length + 4), mm_items=[item])
    run(e, pause=0.001)
    assert e.leak_check() == []
    assert not e.scheduler.has_requests()  # saves confirmed in the store
    return params


def capture_params(sim: EngineSim) -> dict[str, Any]:
    """What the scheduler-side connector returned from request_finished, per request (the proxy's view)."""
    connector = sim.scheduler.ec_connector
    original = connector.request_finished
    seen: dict[str, Any] = {}

    def spy(request: Any) -> tuple[bool, dict[str, Any] | None]:
        delay, params = original(request)
        assert delay is False  # never True: it would leak the request without a KV connector
        seen[request.request_id] = params
        return delay, params

    connector.request_finished = spy
    return seen


def check_embeddings(sim: EngineSim, request_id: str, items: list[MMItem]) -> None:
    used = sim.embeddings_used(request_id)
    for item in items:
        assert torch.equal(used[item.identifier], embedding_for(item.identifier, item.length, HIDDEN))


def run_hooks_on_empty_steps(sim: EngineSim) -> EngineSim:
    """Make the simulated workers do what vLLM's V2 model runner does on a step that schedules no tokens:
    run the EC hooks anyway (``ActiveECConnector.no_forward``). The simulator follows the V1 runner, which
    returns before them, so by default an idle engine never moves a prefetch."""
    from vllm.v1.outputs import ModelRunnerOutput

    from asyncconn_tools.sim.runner import StepPlan, WorkerStepResult

    for worker in sim.workers:
        original = worker.execute

        def execute(plan: StepPlan, _worker: Any = worker, _original: Any = original) -> WorkerStepResult:
            so = plan.scheduler_output
            if so.total_num_scheduled_tokens or _worker.kv_connector is not None:
                return _original(plan)
            for mm_hash in so.free_encoder_mm_hashes:
                _worker.encoder_cache.pop(mm_hash, None)
            with _worker._ec_lifecycle(so) as ec_out:
                pass
            return WorkerStepResult(output=ModelRunnerOutput.with_ec_conn_output_only(ec_out))

        worker.execute = execute  # type: ignore[method-assign]
    return sim


def check_installs_are_staged(sim: EngineSim) -> list[str]:
    """Spy on ``has_cache_item``: every True answer must name an item every worker holds staged right then
    (vLLM plans no encoder run for it; an install that could fail would crash vLLM's gather)."""
    connector = sim.scheduler.ec_connector
    original = connector.has_cache_item
    answered: list[str] = []

    def spy(identifier: str) -> bool:
        result: bool = original(identifier)
        if result:
            answered.append(identifier)
            for worker in workers(sim):
                assert identifier in worker._staged, f"{identifier} is not staged on every worker"
        return result

    connector.has_cache_item = spy
    return answered


MODES = ["busy", "stalled", "empty-step-hooks"]


def start_pd(make_sim: Callable[..., EngineSim], url: str, mode: str, **kwargs: Any) -> EngineSim:
    """A PD engine: ``busy`` (a text request keeps the workers stepping), ``stalled`` (alone, V1 runner:
    nothing runs the workers until a request is admitted) or ``empty-step-hooks`` (alone, V2 runner)."""
    extra = kwargs.pop("extra", {})
    pd = make_sim(ec=spec("ec_consumer", url, **extra), **kwargs)
    if mode == "busy":
        keep_busy(pd)
    elif mode == "empty-step-hooks":
        run_hooks_on_empty_steps(pd)
    return pd


def after_lookup(sim: EngineSim, action: Callable[[], object]) -> None:
    """Run ``action`` once, right after the scheduler takes its first lookup answer (before it can order a
    prefetch): the store changes between the lookup and any load."""
    scheduler = sched(sim)
    original = scheduler._apply

    def spy(*args: Any) -> None:
        original(*args)
        scheduler._apply = original
        action()

    scheduler._apply = spy


def keep_busy(sim: EngineSim, tokens: int = 200) -> str:
    """A text request that keeps the engine stepping (so the workers run and prefetches progress)."""
    rid = f"busy-{next(_ids)}"
    sim.add_request(rid, prompt(16), max_tokens=tokens)
    return rid


# -- admission -------------------------------------------------------------------------------------------


def test_deferral_then_admission_with_prefetch_on_two_workers(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-defer", offset=8, length=24)
    params = produce(make_sim, url, [img])
    assert params == {"e-img-defer": {SAVING_PARAM: ["img-defer"]}}

    pd = make_sim(ec=spec("ec_consumer", url), num_workers=2)
    installs = check_installs_are_staged(pd)
    keep_busy(pd)
    pd.add_request("r1", prompt(48), max_tokens=3, mm_items=[img])
    pd.step()
    assert sched(pd).ensure_cache_available(pd.scheduler.requests["r1"], 0) is False  # idempotent
    run(pd, pause=0.001)

    assert pd.encoder_runs() == []
    assert pd.finish_reasons["r1"] == "length"
    check_embeddings(pd, "r1", [img])
    c = stats(pd)
    assert c["deferrals"] >= 1
    assert c["admit_prefetched"] == 1 and c.get("encode_stalled", 0) == 0
    assert c["prefetches"] == 2 and c["installs_staged"] == 2  # one per worker, summed by aggregate
    assert installs == ["img-defer"]
    assert sched(pd).expected_workers == 2
    assert_no_leaks(pd)


def test_stalled_engine_encodes_rather_than_loading_at_install(make_sim: Any) -> None:
    """V1 runner, alone on the engine: the workers never run, so no prefetch can confirm the item. The
    request is released to the encoder -- never admitted on a load at install that could fail and crash."""
    url = store_url()
    img = MMItem("img-idle", offset=4, length=16)
    produce(make_sim, url, [img])
    pd = make_sim(ec=spec("ec_consumer", url))
    installs = check_installs_are_staged(pd)
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-idle")]
    check_embeddings(pd, "r1", [img])
    c = stats(pd)
    assert c["lookup_hits"] == 1 and c["encode_stalled"] == 1
    assert installs == [] and "installs_sync" not in c
    assert_no_leaks(pd)


def test_stalled_engine_releases_one_request_and_prefetches_for_the_others(make_sim: Any) -> None:
    url = store_url()
    imgs = [MMItem(f"img-queue-{i}", offset=4, length=16) for i in range(3)]
    produce(make_sim, url, imgs)
    pd = make_sim(ec=spec("ec_consumer", url))
    installs = check_installs_are_staged(pd)
    for i, img in enumerate(imgs):
        pd.add_request(f"r{i}", prompt(32), max_tokens=8, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r0", "img-queue-0")]  # released: its step runs the workers
    for i, img in enumerate(imgs):
        check_embeddings(pd, f"r{i}", [img])
    assert stats(pd)["admit_prefetched"] == 2 and sorted(installs) == ["img-queue-1", "img-queue-2"]
    assert_no_leaks(pd)


def test_idle_engine_prefetches_when_workers_run_on_empty_steps(make_sim: Any) -> None:
    """V2 runner: the EC hooks run on empty steps, so the prefetch completes on an idle engine."""
    url = store_url()
    img = MMItem("img-v2", offset=4, length=16)
    produce(make_sim, url, [img])
    pd = run_hooks_on_empty_steps(make_sim(ec=spec("ec_consumer", url), num_workers=2))
    installs = check_installs_are_staged(pd)
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == []
    check_embeddings(pd, "r1", [img])
    c = stats(pd)
    assert c["admit_prefetched"] == 1 and c["installs_staged"] == 2 and c.get("encode_stalled", 0) == 0
    assert installs == ["img-v2"]
    assert_no_leaks(pd)


def test_item_not_in_store_is_encoded(make_sim: Any) -> None:
    pd = make_sim(ec=spec("ec_consumer", store_url()))
    img = MMItem("img-absent", offset=4, length=16)
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-absent")]
    assert stats(pd)["lookup_misses"] == 1
    assert_no_leaks(pd)


def test_chunked_prefill_across_two_images_only_the_second_stored(make_sim: Any) -> None:
    url = store_url()
    first, second = MMItem("img-c1", offset=4, length=24), MMItem("img-c2", offset=40, length=24)
    produce(make_sim, url, [second])
    pd = make_sim(ec=spec("ec_consumer", url), max_num_batched_tokens=32)
    keep_busy(pd)
    pd.add_request("r1", prompt(72), max_tokens=2, mm_items=[first, second])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-c1")]
    check_embeddings(pd, "r1", [first, second])
    assert_no_leaks(pd)


def test_two_requests_sharing_an_image_prefetch_it_once(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-shared", offset=8, length=16)
    produce(make_sim, url, [img])
    pd = make_sim(ec=spec("ec_consumer", url))
    keep_busy(pd)
    pd.add_request("a", prompt(40), max_tokens=2, mm_items=[img])
    pd.add_request("b", prompt(40), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == []
    check_embeddings(pd, "a", [img])
    check_embeddings(pd, "b", [img])
    assert stats(pd)["prefetches"] == 1
    assert_no_leaks(pd)


# -- aborts ----------------------------------------------------------------------------------------------


def test_abort_while_the_lookup_is_pending(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-abort-lookup", offset=4, length=16)
    produce(make_sim, url, [img])
    slow = url + "?latency=300ms"
    pd = make_sim(ec=spec("ec_consumer", slow))
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    pd.step()
    assert sched(pd).item_state("img-abort-lookup") is ItemState.LOOKUP
    assert pd.abort("r1")
    run(pd)
    assert sched(pd).lookup.held()["entries"] == 0
    assert pd.encoder_runs() == []
    assert_no_leaks(pd)


def test_abort_while_the_prefetch_is_in_flight(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-abort-fetch", offset=4, length=16)
    produce(make_sim, url, [img])
    pd = make_sim(ec=spec("ec_consumer", url + "?latency=150ms"))
    keep_busy(pd, tokens=900)
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    for _ in range(500):
        if sched(pd).item_state("img-abort-fetch") is ItemState.ORDERED:
            break
        pd.step()
        time.sleep(0.002)
    assert sched(pd).item_state("img-abort-fetch") is ItemState.ORDERED
    pd.step()
    assert workers(pd)[0].held()["loading"] == 1
    assert pd.abort("r1")
    run(pd)  # the busy request keeps stepping: the drop reaches the worker, which cancels the load
    c = stats(pd)
    assert c["prefetch_abandoned"] == 1 and c["prefetch_dropped"] == 1
    assert_no_leaks(pd)


# -- preemption -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["stalled", "empty-step-hooks"])
def test_preempted_request_looks_its_items_up_again(make_sim: Any, mode: str) -> None:
    """KV pressure preempts requests whose images were loaded; the store then loses every image. Re-admitted,
    they do not trust the old answer: looked up again (a miss now), the encoder runs; right embeddings."""
    url = store_url()
    imgs = [MMItem(f"img-pre-{i}", offset=8, length=16) for i in range(3)]
    produce(make_sim, url, imgs)
    pd = start_pd(
        make_sim,
        url,
        mode,
        shape=SimShape(num_blocks=9),  # 8 usable blocks of 16 tokens; each request wants 5 by the end
        max_num_seqs=3,
        encoder_cache_size=32,  # room for two images: re-admitted requests miss vLLM's encoder cache
    )
    installs = check_installs_are_staged(pd)
    for i, img in enumerate(imgs):
        pd.add_request(f"p{i}", prompt(40), max_tokens=40, mm_items=[img])
    preempted: set[str] = set()
    for _ in range(2000):
        preempted |= pd.step().preempted
        if preempted:
            break
        time.sleep(0.001)
    assert preempted, "the workload must preempt"
    _delete(url, [img.identifier for img in imgs])
    run(pd, pause=0.001)
    for i, img in enumerate(imgs):
        assert pd.finish_reasons[f"p{i}"] == "length"
        check_embeddings(pd, f"p{i}", [img])
    c = stats(pd)
    assert c["readmissions"] >= 1
    assert set(installs) <= {img.identifier for img in imgs}
    assert_no_leaks(pd)


# -- the E -> PD race ------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_announced_item_is_awaited_not_recomputed(make_sim: Any, mode: str) -> None:
    url = store_url()
    img = MMItem("img-race", offset=8, length=16)
    pd = start_pd(make_sim, url, mode, extra={"arrival_timeout": "20s"})
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    pd.scheduler.requests["r1"].ec_transfer_params = {SAVING_PARAM: ["img-race"]}  # as the proxy passes it
    if mode == "stalled":  # waiting could only end in an encoder run: encode now
        run(pd, pause=0.001)
        assert pd.encoder_runs() == [("r1", "img-race")] and stats(pd)["encode_stalled"] == 1
        check_embeddings(pd, "r1", [img])
        assert_no_leaks(pd)
        return
    for _ in range(5):
        pd.step()
        time.sleep(0.002)
    assert sched(pd).item_state("img-race") is ItemState.ARRIVING
    assert pd.encoder_runs() == []
    produce(make_sim, url, [img])  # E's save lands late
    run(pd, pause=0.001)
    assert pd.encoder_runs() == []
    check_embeddings(pd, "r1", [img])
    assert stats(pd)["arrivals_awaited"] == 1
    assert_no_leaks(pd)


def test_announced_item_that_never_arrives_is_encoded_after_the_timeout(make_sim: Any) -> None:
    pd = start_pd(make_sim, store_url(), "empty-step-hooks", extra={"arrival_timeout": "100ms"})
    img = MMItem("img-lost", offset=8, length=16)
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    pd.scheduler.requests["r1"].ec_transfer_params = {SAVING_PARAM: ["img-lost"]}
    run(pd, max_steps=100_000, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-lost")]
    assert stats(pd)["arrival_timeouts"] == 1
    assert_no_leaks(pd)


def test_malformed_transfer_params_are_ignored(make_sim: Any) -> None:
    pd = make_sim(ec=spec("ec_consumer", store_url()))
    img = MMItem("img-bad-params", offset=8, length=16)
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    pd.scheduler.requests["r1"].ec_transfer_params = {SAVING_PARAM: "img-bad-params"}  # not a list
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-bad-params")]
    assert_no_leaks(pd)


# -- failures --------------------------------------------------------------------------------------------


def _put_raw(url: str, key: str, payload: bytes) -> None:
    async def go() -> None:
        backend = await open_backend(parse_url(url))
        await backend.put([(key, payload)])
        await backend.close()

    get_runtime().run(go(), 5)


def _delete(url: str, keys: list[str]) -> None:
    async def go() -> None:
        backend = await open_backend(parse_url(url))
        await backend.delete(keys)
        await backend.close()

    get_runtime().run(go(), 5)


def _put_tensor(url: str, key: str, tensor: torch.Tensor) -> None:
    async def go() -> None:
        store = await TensorStore.open(url)
        await store.put([(key, tensor)])
        await store.close()

    get_runtime().run(go(), 5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("when", ["before-lookup", "after-lookup"])
def test_corrupt_value_is_recomputed_never_crashes(make_sim: Any, mode: str, when: str) -> None:
    """A bad value (garbage, or a frame with the wrong row count) stored before the lookup or swapped in
    between the lookup and the admission: no exception, the encoder runs, the embeddings are right."""
    url = store_url()
    img = MMItem("img-corrupt", offset=8, length=16)
    garbage = b"\x00garbage, not a frame" * 10
    if when == "before-lookup":
        _put_raw(url, "img-corrupt", garbage)
    else:
        _put_tensor(url, "img-corrupt", embedding_for("img-corrupt", 16, HIDDEN))
    pd = start_pd(make_sim, url, mode)
    installs = check_installs_are_staged(pd)
    if when == "after-lookup":  # swapped the moment the lookup's answer is taken, before any load
        after_lookup(pd, lambda: _put_tensor(url, "img-corrupt", torch.zeros(15, HIDDEN)))  # a row short
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-corrupt")]
    check_embeddings(pd, "r1", [img])
    assert installs == []
    c = stats(pd)
    if mode == "stalled":
        assert c["encode_stalled"] == 1  # never even loaded
    else:
        assert c["load_failed_corrupt"] >= 1
    assert_no_leaks(pd)


@pytest.mark.parametrize("mode", ["stalled", "empty-step-hooks"])
def test_store_killed_between_lookup_and_admission(make_sim: Any, fresh_redis: Any, mode: str) -> None:
    """The store dies after the lookup found the item, on an idle engine (where the last design loaded at
    install and crashed vLLM's gather on failure): no exception, the encoder runs, nothing leaks."""
    url = fresh_redis.url
    img = MMItem("img-killed", offset=8, length=16)
    cfg = {"lookup_timeout": "300ms", "store_timeout": "300ms", "load_timeout": "1s"}
    _put_tensor(url, "img-killed", embedding_for("img-killed", 16, HIDDEN))
    pd = start_pd(make_sim, url, mode, extra=cfg, num_workers=2)
    installs = check_installs_are_staged(pd)
    after_lookup(pd, fresh_redis.kill)
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    run(pd, max_steps=100_000, pause=0.001)
    assert stats(pd)["lookup_hits"] == 1
    assert pd.finish_reasons["r1"] == "length"
    assert pd.encoder_runs() == [("r1", "img-killed")]
    check_embeddings(pd, "r1", [img])
    assert installs == []
    assert_no_leaks(pd)


def test_wrong_shape_in_store_is_treated_as_corrupt(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-shape", offset=8, length=16)
    _put_tensor(url, "img-shape", torch.zeros(15, HIDDEN))  # one row short
    pd = make_sim(ec=spec("ec_consumer", url))
    keep_busy(pd)
    pd.add_request("r1", prompt(40), max_tokens=2, mm_items=[img])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-shape")]
    check_embeddings(pd, "r1", [img])
    assert_no_leaks(pd)


def test_store_dies_mid_run(make_sim: Any, fresh_redis: Any) -> None:
    url = fresh_redis.url
    cfg = {"lookup_timeout": "300ms", "store_timeout": "300ms", "load_timeout": "1s"}
    stored = [MMItem(f"img-die-{i}", offset=8, length=16) for i in range(4)]
    e = make_sim(ec=spec("ec_producer", url, **cfg))
    for item in stored:
        e.add_request(f"e-{item.identifier}", prompt(32), mm_items=[item])
    run(e, pause=0.001)
    pd = make_sim(ec=spec("ec_consumer", url, **cfg))
    keep_busy(pd, tokens=60)
    pd.add_request("r0", prompt(40), max_tokens=2, mm_items=[stored[0]])
    for _ in range(400):
        pd.step()
        time.sleep(0.001)
        if "r0" in pd.finish_reasons:
            break
    fresh_redis.kill()
    for i, item in enumerate(stored[1:], 1):
        pd.add_request(f"r{i}", prompt(40), max_tokens=2, mm_items=[item])
    run(pd, max_steps=100_000, pause=0.001)
    for i, item in enumerate(stored):
        assert pd.finish_reasons[f"r{i}"] == "length"
        check_embeddings(pd, f"r{i}", [item])
    assert ("r0", "img-die-0") not in pd.encoder_runs()
    assert {h for _, h in pd.encoder_runs()} == {item.identifier for item in stored[1:]}
    assert_no_leaks(pd)


# -- producer --------------------------------------------------------------------------------------------


def test_producer_saves_once_and_never_delays_the_free(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-once", offset=8, length=16)
    e = make_sim(ec=spec("ec_producer", url))
    params = capture_params(e)
    e.add_request("a", prompt(32), mm_items=[img])
    e.add_request("b", prompt(32), mm_items=[img])
    run(e, pause=0.001)
    assert params["a"] == {SAVING_PARAM: ["img-once"]}
    assert e.leak_check() == []
    worker = workers(e)[0]
    # The scheduler saw the item in the store; the worker counts the finished put on its next poll.
    assert settled_saver(worker, lambda saver: saver.saved == 1)
    assert sched(e).totals()["saves_confirmed"] == 1
    e2 = make_sim(ec=spec("ec_producer", url))  # a second E: the store already has it
    e2.add_request("c", prompt(32), mm_items=[img])
    run(e2, pause=0.001)
    assert settled_saver(workers(e2)[0], lambda saver: saver.skipped_existing == 1)
    assert workers(e2)[0].saver.saved == 0


def settled_saver(worker: Any, done: Any) -> bool:
    """Poll the worker's save tracker (as its next step would) until ``done(saver)``; a hang guard."""
    deadline = time.monotonic() + 10
    while not done(worker.saver):
        if time.monotonic() > deadline:
            return False
        worker.saver.poll()
        time.sleep(0.001)
    return True


def test_consumer_ignores_save_caches(make_sim: Any) -> None:
    pd = make_sim(ec=spec("ec_consumer", store_url()))
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[MMItem("img-nosave", 4, 16)])
    run(pd, pause=0.001)
    assert pd.encoder_runs() == [("r1", "img-nosave")]
    assert workers(pd)[0].saver is None
    assert_no_leaks(pd)


def test_ec_both_loads_and_saves(make_sim: Any) -> None:
    url = store_url()
    img = MMItem("img-both", offset=4, length=16)
    both = make_sim(ec=spec("ec_both", url))
    both.add_request("r1", prompt(32), max_tokens=2, mm_items=[img])
    run(both, pause=0.001)
    assert both.encoder_runs() == [("r1", "img-both")]
    other = make_sim(ec=spec("ec_both", url))
    keep_busy(other)
    other.add_request("r2", prompt(32), max_tokens=2, mm_items=[img])
    run(other, pause=0.001)
    assert other.encoder_runs() == []
    check_embeddings(other, "r2", [img])


# -- configuration and stats ----------------------------------------------------------------------------


def test_bad_extra_config_fails_at_start_naming_the_key(make_sim: Any) -> None:
    with pytest.raises(ConfigError, match="arrival_timeuot"):
        make_sim(ec=spec("ec_consumer", store_url(), arrival_timeuot="1s"))
    with pytest.raises(ConfigError, match="load_timeout"):
        make_sim(ec=spec("ec_consumer", store_url(), load_timeout="-1s"))


def test_a_method_of_the_other_role_raises_runtime_state_error(make_sim: Any) -> None:
    """Each facade builds one side; asking a scheduler-role connector for worker work (and back) is the same
    error type as in the KV connector: RuntimeStateError, naming the side."""
    pd = make_sim(ec=spec("ec_consumer", store_url()))
    scheduler_role, worker_role = pd.scheduler.ec_connector, pd.workers[0].ec_connector
    with pytest.raises(RuntimeStateError, match="worker-side EC method"):
        _ = scheduler_role.worker_side
    with pytest.raises(RuntimeStateError, match="worker-side EC method"):
        scheduler_role.get_finished(set())
    with pytest.raises(RuntimeStateError, match="scheduler-side EC method"):
        _ = worker_role.scheduler_side
    with pytest.raises(RuntimeStateError, match="scheduler-side EC method"):
        worker_role.has_cache_item("img-x")


@pytest.mark.parametrize("name", ["vllm_ec_producer.json", "vllm_ec_consumer.json"])
def test_example_configs_are_valid_for_vllm_and_asyncconn(name: str) -> None:
    from vllm.config import ECTransferConfig

    from asyncconn.config import Settings

    raw = json.loads((Path(__file__).resolve().parents[3] / "examples" / name).read_text())
    config = ECTransferConfig(**raw)
    assert config.ec_connector == CLASS and config.ec_connector_module_path == MODULE
    assert config.is_ec_producer == (raw["ec_role"] == "ec_producer")
    Settings.from_extra_config(config.ec_connector_extra_config)


def test_stats_are_exported_through_vllm_hooks(make_sim: Any) -> None:
    from asyncconn.vllm.ec.connector import AsyncConnECConnector, AsyncConnECStats

    pd = make_sim(ec=spec("ec_consumer", store_url()))
    connector = pd.scheduler.ec_connector
    original = connector.get_ec_connector_stats
    exported: list[Any] = []

    def spy() -> Any:  # what vLLM's update_from_output collects every step
        stats = original()
        exported.append(stats)
        return stats

    connector.get_ec_connector_stats = spy
    pd.add_request("r1", prompt(32), max_tokens=2, mm_items=[MMItem("img-stats", 4, 16)])
    run(pd, pause=0.001)
    total = AsyncConnECStats()
    for stats in exported:
        if stats is not None:
            total = total.aggregate(stats)
    assert total.data["lookups"] == 1 and total.data["lookup_misses"] == 1
    assert total.data["deferrals"] >= 1
    built = AsyncConnECConnector.build_ec_connector_stats({"deferrals": 2})
    assert isinstance(built, AsyncConnECStats)
    merged = built.aggregate(AsyncConnECStats(data={"deferrals": 1, "installs_sync": 1}))
    assert merged.reduce() == {"deferrals": 3, "installs_sync": 1}
    assert not merged.is_empty() and AsyncConnECStats().is_empty()
    assert_no_leaks(pd)
