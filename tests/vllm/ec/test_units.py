"""The EC connector's plain classes without an engine: worker side with real tensors over a real store
(CPU here, CUDA when available), scheduler side with a real lookup client, and the metadata merge."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from asyncconn.config import Settings
from asyncconn.lookup import EXISTS, LookupConfig, open_lookup_client
from asyncconn.lookup.transports import STORE_SLACK_S
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import CpuDevice, default_device
from asyncconn.vllm.ec.metadata import SAVING_PARAM, ECStepMetadata, ECWorkerReport, ItemRef
from asyncconn.vllm.ec.scheduler import ECSchedulerSide, ItemState
from asyncconn.vllm.ec.worker import ECWorkerSide

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


@pytest.fixture
def url() -> str:
    return f"memory://ec-unit-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def store(runtime: Runtime, url: str) -> Iterator[TensorStore]:
    store = runtime.run(TensorStore.open(url), 5)
    yield store
    runtime.run(store.close(), 5)


def put(runtime: Runtime, store: TensorStore, key: str, tensor: torch.Tensor) -> None:
    runtime.run(store.put([(key, tensor)]), 5)


def make_worker(runtime: Runtime, url: str, *, device: Any = None, **extra: Any) -> ECWorkerSide:
    settings = Settings.from_extra_config({"backend_url": url, "pinned_pool_bytes": "64MiB", **extra})
    return ECWorkerSide(settings, producer=True, consumer=True, runtime=runtime, device=device or CpuDevice())


def settle(worker: ECWorkerSide, wanted: set[str], timeout: float = 5.0) -> ECWorkerReport:
    """Poll until every hash in ``wanted`` is ready or failed; merge the reports seen meanwhile."""
    merged = ECWorkerReport()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        worker.poll()
        merged = merged.aggregate(worker.report())
        if wanted <= set(merged.ready) | set(merged.failed):
            return merged
        time.sleep(0.001)
    raise AssertionError(f"not settled: {wanted - set(merged.ready) - set(merged.failed)}")


# -- worker ----------------------------------------------------------------------------------------------


def test_prefetch_then_install_hands_over_the_staged_tensor(
    runtime: Runtime, store: TensorStore, url: str
) -> None:
    emb = torch.randn(24, 64)
    put(runtime, store, "img-a", emb)
    worker = make_worker(runtime, url)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-a", 24)]))
    report = settle(worker, {"img-a"})
    assert report.ready == {"img-a": frozenset({worker.worker_id})} and report.failed == {}
    staged = worker._staged["img-a"]
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-a", 24)]))
    assert cache["img-a"] is staged  # no copy on the forward path
    assert torch.equal(cache["img-a"], emb)
    assert worker.report().stats["installs_staged"] == 1
    assert all(v == 0 for v in worker.held().values())
    worker.close()


def test_second_load_uses_the_learned_row_shape(runtime: Runtime, store: TensorStore, url: str) -> None:
    put(runtime, store, "img-1", torch.randn(8, 32, dtype=torch.float16))
    put(runtime, store, "img-2", torch.randn(5, 32, dtype=torch.float16))
    worker = make_worker(runtime, url)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-1", 8)]))
    settle(worker, {"img-1"})
    assert worker._dest(ItemRef("img-2", 5)).shape == (5, 32)
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-2", 5)]))
    assert settle(worker, {"img-2"}).failed == {}
    worker.close()


def test_install_without_prefetch_loads_synchronously(runtime: Runtime, store: TensorStore, url: str) -> None:
    """The last resort only: the scheduler orders installs of staged items (this is a bug upstream)."""
    emb = torch.randn(6, 16)
    put(runtime, store, "img-s", emb)
    worker = make_worker(runtime, url)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-s", 6)]))
    assert torch.equal(cache["img-s"], emb)
    assert worker.report().stats["installs_sync"] == 1
    assert all(v == 0 for v in worker.held().values())
    worker.close()


@pytest.mark.parametrize(
    ("value", "reason", "then"),
    [
        (None, "miss", "miss"),
        # There but unusable (not a frame; a frame of other rows): removed from the store, since E skips
        # keys the store has; once gone, E's next save of the item writes it again.
        (b"not a frame at all", "corrupt", "miss"),
        (torch.zeros(5, 16), "corrupt", "miss"),
    ],
    ids=["missing", "garbage", "wrong-rows"],
)
def test_failed_loads_are_reported_never_installed(
    runtime: Runtime, store: TensorStore, url: str, value: Any, reason: str, then: str
) -> None:
    if isinstance(value, torch.Tensor):
        put(runtime, store, "img-f", value)
    elif value is not None:
        runtime.run(store.backend.put([("img-f", value)]), 5)
    worker = make_worker(runtime, url)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-f", 6)]))
    assert settle(worker, {"img-f"}).failed == {"img-f": reason}
    deadline = time.monotonic() + 5
    while worker.held()["deletes"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert runtime.run(store.exists(["img-f"]), 5) == [then != "miss"]
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-f", 6)]))  # sync path fails too
    assert "img-f" not in cache
    assert worker.report().failed == {"img-f": then}
    assert all(v == 0 for v in worker.held().values())
    worker.close()


def test_sync_install_is_bounded_by_load_timeout(runtime: Runtime, url: str) -> None:
    worker = make_worker(runtime, url + "?latency=2s", load_timeout="100ms")
    cache: dict[str, torch.Tensor] = {}
    started = time.monotonic()
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-slow", 4)]))
    assert time.monotonic() - started < 1.5
    assert cache == {} and worker.report().failed == {"img-slow": "timeout"}
    deadline = time.monotonic() + 5
    while any(worker.held().values()) and time.monotonic() < deadline:
        worker.poll()
        time.sleep(0.01)
    assert all(v == 0 for v in worker.held().values())
    worker.close()


def test_drop_frees_staged_and_in_flight_prefetches(runtime: Runtime, store: TensorStore, url: str) -> None:
    put(runtime, store, "img-d1", torch.randn(4, 8))
    worker = make_worker(runtime, url)
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-d1", 4)]))
    settle(worker, {"img-d1"})
    slow = make_worker(runtime, url + "?latency=300ms")
    slow.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-d1", 4)]))
    assert slow.held()["loading"] == 1
    for w in (worker, slow):
        w.start_load_caches(cache, ECStepMetadata(drop=["img-d1"]))
        assert w.report().stats["prefetch_dropped"] == 1
    deadline = time.monotonic() + 5
    while any(slow.held().values()) and time.monotonic() < deadline:
        slow.poll()
        time.sleep(0.01)
    for w in (worker, slow):
        assert all(v == 0 for v in w.held().values()), w.held()
        w.close()
    assert cache == {}


def test_prefetch_of_an_item_already_cached_is_ready_at_once_and_held(runtime: Runtime, url: str) -> None:
    """Ready without a load; held, so that vLLM evicting it before the install cannot lose it."""
    worker = make_worker(runtime, url)
    here = torch.ones(2, 2)
    cache = {"img-here": here}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-here", 2)]))
    assert set(worker.report().ready) == {"img-here"}
    assert worker.held()["loading"] == 0 and worker.held()["staged"] == 1
    cache.clear()  # vLLM evicted it (free_encoder_mm_hashes) before the request was admitted
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-here", 2)]))
    assert cache["img-here"] is here
    assert all(v == 0 for v in worker.held().values())
    worker.close()


def test_worker_says_when_its_hooks_run_on_an_empty_step(runtime: Runtime, url: str) -> None:
    worker = make_worker(runtime, url)
    worker.start_load_caches({}, ECStepMetadata(step_tokens=8))
    assert worker.report().empty_step_hooks is False
    worker.start_load_caches({}, ECStepMetadata(step_tokens=0))  # vLLM's V2 runner: no_forward
    assert worker.report().empty_step_hooks is True
    assert worker.report().empty_step_hooks is True  # sticky: later reports say it too
    worker.close()


def test_save_is_deferred_and_deduplicated(runtime: Runtime, store: TensorStore, url: str) -> None:
    worker = make_worker(runtime, url)
    emb = torch.randn(3, 4)
    cache = {"img-save": emb}
    worker.save_caches(cache, "img-save")
    worker.save_caches(cache, "img-save")  # in flight: skipped, never re-sent
    worker.save_caches(cache, "img-unknown")  # not in the cache: nothing to save
    deadline = time.monotonic() + 5
    while worker.has_pending_saves() and time.monotonic() < deadline:
        worker.end_step()
        time.sleep(0.001)
    counts = worker.report().stats
    assert counts["saves"] == 1 and counts["saves_skipped"] == 1 and counts["saves_done"] == 1
    (saved,) = runtime.run(store.get(["img-save"]), 5)
    assert saved is not None and torch.equal(saved, emb)
    worker.close()


@pytest.mark.gpu
def test_worker_on_cuda_prefetches_into_device_memory(runtime: Runtime, store: TensorStore, url: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    emb = torch.randn(576, 1024, dtype=torch.bfloat16)
    put(runtime, store, "img-gpu", emb)
    worker = make_worker(runtime, url, device=default_device())
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img-gpu", 576)]))
    settle(worker, {"img-gpu"})
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img-gpu", 576)]))
    assert cache["img-gpu"].is_cuda
    assert torch.equal(cache["img-gpu"].cpu(), emb)
    gpu_emb = torch.randn(4, 8, device="cuda")
    worker.save_caches({"img-gpu-save": gpu_emb}, "img-gpu-save")
    deadline = time.monotonic() + 5
    while worker.has_pending_saves() and time.monotonic() < deadline:
        worker.end_step()
        time.sleep(0.001)
    (saved,) = runtime.run(store.get(["img-gpu-save"]), 5)
    assert saved is not None and torch.equal(saved, gpu_emb.cpu())
    worker.close()


# -- scheduler -------------------------------------------------------------------------------------------


def request(
    rid: str, *items: tuple[str, int, int], params: Any = None, status: str = "WAITING", preemptions: int = 0
) -> Any:
    features = [
        SimpleNamespace(
            identifier=h,
            mm_position=SimpleNamespace(offset=off, length=n, get_num_embeds=lambda n=n: n),
        )
        for h, off, n in items
    ]
    return SimpleNamespace(
        request_id=rid,
        mm_features=features,
        ec_transfer_params=params,
        status=SimpleNamespace(name=status),
        num_preemptions=preemptions,
    )


def step(tokens: int) -> Any:
    return SimpleNamespace(total_num_scheduled_tokens=tokens)


@pytest.fixture
def make_scheduler(runtime: Runtime, url: str) -> Iterator[Any]:
    made: list[ECSchedulerSide] = []

    def factory(*, producer: bool = False, consumer: bool = True, **extra: Any) -> ECSchedulerSide:
        settings = Settings.from_extra_config({"backend_url": url, **extra})
        lookup = open_lookup_client(LookupConfig(backend_url=url), EXISTS, runtime=runtime)
        made.append(ECSchedulerSide(settings, lookup, producer=producer, consumer=consumer))
        return made[-1]

    yield factory
    for s in made:
        s.close()


def wait_answer(s: ECSchedulerSide, req: Any, n: int = 0, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if s.ensure_cache_available(req, n):
            return True
        if all(s.item_state(f.identifier) not in (ItemState.LOOKUP, ItemState.NEW) for f in req.mm_features):
            return False
        time.sleep(0.001)
    raise AssertionError("lookup never answered")


def test_found_item_is_prefetched_then_admitted_when_every_worker_is_ready(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    put(runtime, store, "img-x", torch.randn(4, 4))
    s = make_scheduler()
    s.build_connector_meta(step(8))  # a busy engine: workers run every step
    req = request("r1", ("img-x", 0, 4))
    assert wait_answer(s, req) is False
    assert s.item_state("img-x") is ItemState.FOUND and not s.has_cache_item("img-x")
    meta = s.build_connector_meta(step(8))
    assert meta.prefetch == [ItemRef("img-x", 4)]
    s.update_connector_output(
        ECWorkerReport(workers=frozenset({"w0", "w1"}), ready={"img-x": frozenset({"w0"})})
    )
    assert s.ensure_cache_available(req, 0) is False  # w1 has not staged it yet
    s.update_connector_output(ECWorkerReport(workers=frozenset({"w1"}), ready={"img-x": frozenset({"w1"})}))
    assert s.ensure_cache_available(req, 0) is True and s.has_cache_item("img-x")
    s.update_state_after_alloc(req, 0)
    assert s.build_connector_meta(step(8)).install == [ItemRef("img-x", 4)]
    assert s.request_finished(req) == (False, None)
    assert all(v == 0 for v in s.held().values())


def test_items_before_num_computed_tokens_are_ignored(make_scheduler: Any) -> None:
    s = make_scheduler()
    req = request("r1", ("img-early", 0, 8))
    assert s.ensure_cache_available(req, 8) is True  # nothing at or beyond token 8
    s.request_finished(req)
    assert all(v == 0 for v in s.held().values())


def make_ready(s: ECSchedulerSide, req: Any, *workers: str) -> None:
    """Drive the request's single item from its lookup to READY on a busy engine."""
    s.build_connector_meta(step(8))
    assert wait_answer(s, req) is False
    assert s.build_connector_meta(step(8)).prefetch
    mm_hash = req.mm_features[0].identifier
    s.update_connector_output(ECWorkerReport(workers=frozenset(workers), ready={mm_hash: frozenset(workers)}))
    assert s.item_state(mm_hash) is ItemState.READY


def test_install_failure_fails_the_requests_that_need_the_item(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    """Defensive: an install cannot fail (only staged items are installed); were one reported, the request
    is failed through take_unavailable_requests rather than left waiting."""
    put(runtime, store, "img-y", torch.randn(4, 4))
    s = make_scheduler()
    req = request("r1", ("img-y", 0, 4))
    make_ready(s, req, "w0")
    assert s.ensure_cache_available(req, 0) is True and s.has_cache_item("img-y")
    s.update_state_after_alloc(req, 0)
    assert s.build_connector_meta(step(4)).install == [ItemRef("img-y", 4)]
    s.update_connector_output(ECWorkerReport(workers=frozenset({"w0"}), failed={"img-y": "corrupt"}))
    assert s.take_unavailable_requests() == {"r1"}
    assert s.take_unavailable_requests() == set()
    s.request_finished(req)
    assert all(v == 0 for v in s.held().values())


def test_has_cache_item_only_for_items_every_worker_staged(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    put(runtime, store, "img-h", torch.randn(4, 4))
    s = make_scheduler()
    req = request("r1", ("img-h", 0, 4))
    s.build_connector_meta(step(8))
    deadline = time.monotonic() + 5
    while s.item_state("img-h") is not ItemState.FOUND:
        assert time.monotonic() < deadline, "lookup never answered"
        assert not s.has_cache_item("img-h")  # unknown, or being looked up
        s.ensure_cache_available(req, 0)
        time.sleep(0.001)
    assert not s.has_cache_item("img-h")  # found by the lookup: not confirmed by anyone
    s.build_connector_meta(step(8))
    assert s.item_state("img-h") is ItemState.ORDERED and not s.has_cache_item("img-h")
    s.update_connector_output(
        ECWorkerReport(workers=frozenset({"w0", "w1"}), ready={"img-h": frozenset({"w0"})})
    )
    assert not s.has_cache_item("img-h")  # one worker of two
    s.update_connector_output(ECWorkerReport(workers=frozenset({"w1"}), ready={"img-h": frozenset({"w1"})}))
    assert s.has_cache_item("img-h")
    s.request_finished(req)
    assert s.build_connector_meta(step(8)).drop == ["img-h"]
    assert all(v == 0 for v in s.held().values())


def test_stalled_engine_releases_one_request_per_step_to_the_encoder(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    """Previous step empty and no worker known to run on empty steps (vLLM's V1 runner): the first request
    whose items are found goes to the encoder (no load at install that could fail); the others wait, and
    the released one's step carries their prefetch orders."""
    for h in ("img-s1", "img-s2"):
        put(runtime, store, h, torch.randn(2, 2))
    s = make_scheduler(sync_lookup=True)  # answers at once: the test controls every step
    r1, r2 = request("r1", ("img-s1", 0, 2)), request("r2", ("img-s2", 0, 2))
    assert s.ensure_cache_available(r1, 0) is False  # looked up (a lookup is always waited for)
    assert s.item_state("img-s1") is ItemState.FOUND
    assert s.ensure_cache_available(r1, 0) is True  # found, nothing runs the workers: released
    assert s.item_state("img-s1") is ItemState.MISS and not s.has_cache_item("img-s1")
    assert s.ensure_cache_available(r2, 0) is False  # looked up
    assert s.ensure_cache_available(r2, 0) is False  # found, but one release per schedule() pass
    assert s.totals()["encode_stalled"] == 1
    s.update_state_after_alloc(r1, 0)  # vLLM planned the encoder for it
    assert s.build_connector_meta(step(2)).prefetch == [ItemRef("img-s2", 2)]  # the released step
    for r in (r1, r2):
        s.request_finished(r)
    assert s.build_connector_meta(step(8)).drop == ["img-s2"]
    assert all(v == 0 for v in s.held().values())


def test_workers_on_empty_steps_get_orders_and_nothing_is_released(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    put(runtime, store, "img-v2", torch.randn(2, 2))
    s = make_scheduler()
    s.update_connector_output(ECWorkerReport(workers=frozenset({"w0"}), empty_step_hooks=True))
    req = request("r1", ("img-v2", 0, 2))
    assert wait_answer(s, req) is False  # stalled-looking engine, but the workers run: wait
    meta = s.build_connector_meta(step(0))
    assert meta.prefetch == [ItemRef("img-v2", 2)] and meta.step_tokens == 0
    assert s.ensure_cache_available(req, 0) is False and s.totals()["encode_stalled"] == 0
    s.request_finished(req)
    s.build_connector_meta(step(0))
    assert all(v == 0 for v in s.held().values())


def test_preempted_request_looks_its_items_up_again(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    put(runtime, store, "img-p1", torch.randn(4, 4))
    s = make_scheduler()
    req = request("r1", ("img-p1", 0, 4))
    make_ready(s, req, "w0")
    assert s.ensure_cache_available(req, 0) is True
    s.update_state_after_alloc(req, 0)
    s.build_connector_meta(step(8))
    assert s.item_state("img-p1") is ItemState.INSTALLED
    assert s.ensure_cache_available(req, 2) is True  # running, mid-placeholder: never waits for it
    runtime.run(store.delete(["img-p1"]), 5)  # the store loses it while the request runs
    req.num_preemptions = 1  # vLLM preempted it: its encoder input was freed
    assert s.ensure_cache_available(req, 0) is False  # asked again, not trusted
    assert s.totals()["readmissions"] == 1
    assert wait_answer(s, req) is True and s.item_state("img-p1") is ItemState.MISS  # now a miss: encode
    assert not s.has_cache_item("img-p1")
    s.request_finished(req)
    assert all(v == 0 for v in s.held().values())


def test_failed_prefetch_becomes_a_miss_and_other_copies_are_dropped(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    put(runtime, store, "img-z", torch.randn(4, 4))
    s = make_scheduler()
    s.build_connector_meta(step(8))
    req = request("r1", ("img-z", 0, 4))
    wait_answer(s, req)
    s.build_connector_meta(step(8))
    s.update_connector_output(ECWorkerReport(workers=frozenset({"w0"}), failed={"img-z": "timeout"}))
    assert s.ensure_cache_available(req, 0) is True and not s.has_cache_item("img-z")  # encoder runs
    assert s.build_connector_meta(step(8)).drop == ["img-z"]
    s.request_finished(req)
    assert all(v == 0 for v in s.held().values())


def test_staging_budget_full_sends_the_item_to_the_encoder_instead_of_waiting(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    for h in ("img-b1", "img-b2"):
        put(runtime, store, h, torch.randn(2, 2))
    s = make_scheduler(max_inflight_loads=1)
    s.build_connector_meta(step(8))
    r1, r2 = request("r1", ("img-b1", 0, 2)), request("r2", ("img-b2", 0, 2))
    wait_answer(s, r1)
    s.build_connector_meta(step(8))  # img-b1 ordered: the budget is full
    assert wait_answer(s, r2) is True and s.item_state("img-b2") is ItemState.MISS
    assert not s.has_cache_item("img-b2") and s.totals()["encode_budget"] == 1
    for r in (r1, r2):
        s.request_finished(r)
    assert s.build_connector_meta(step(8)).drop == ["img-b1"]
    assert all(v == 0 for v in s.held().values())


def test_producer_reports_saving_items_and_confirms_them_in_the_store(
    runtime: Runtime, store: TensorStore, make_scheduler: Any
) -> None:
    s = make_scheduler(producer=True, consumer=False)
    req = request("e1", ("img-p", 0, 4), ("img-p", 8, 4), status="FINISHED_STOPPED")
    assert s.ensure_cache_available(req, 0) is True
    s.update_state_after_alloc(req, 0)
    assert s.request_finished(req) == (False, {SAVING_PARAM: ["img-p"]})
    assert s.has_pending_push_work() is True
    put(runtime, store, "img-p", torch.randn(4, 4))
    deadline = time.monotonic() + 5
    while s.has_pending_push_work():
        assert time.monotonic() < deadline
    assert s.totals()["saves_confirmed"] == 1
    aborted = request("e2", ("img-q", 0, 4), status="FINISHED_ABORTED")
    assert s.request_finished(aborted) == (False, None)


def test_unconfirmed_save_stops_holding_the_engine_after_the_deadline(make_scheduler: Any) -> None:
    s = make_scheduler(producer=True, consumer=False, arrival_timeout="50ms")
    s.update_state_after_alloc(request("e1", ("img-never", 0, 4)), 0)
    deadline = time.monotonic() + 5
    while s.has_pending_push_work():
        assert time.monotonic() < deadline
    assert s.totals()["saves_unconfirmed"] == 1
    assert all(v == 0 for v in s.held().values())


def test_worker_reports_merge_per_worker() -> None:
    a = ECWorkerReport(frozenset({"a"}), {"x": frozenset({"a"})}, {}, {"loaded": 1})
    b = ECWorkerReport(
        frozenset({"b"}), {"x": frozenset({"b"}), "y": frozenset({"b"})}, {"z": "miss"}, {"loaded": 2}
    )
    merged = a.aggregate(b)
    assert merged.workers == {"a", "b"}
    assert merged.ready == {"x": frozenset({"a", "b"}), "y": frozenset({"b"})}
    assert merged.failed == {"z": "miss"} and merged.stats == {"loaded": 3}
    assert a.ready == {"x": frozenset({"a"})}  # never merged in place


def test_an_announced_item_that_never_lands_is_polled_with_backoff(runtime: Runtime, url: str) -> None:
    """E said it is saving the item, but it never lands (E's store died): PD looks again sooner at first and
    then ever later (5 ms doubling to 100 ms), so a 3 s wait costs a few dozen lookups, not 600."""
    now = [100.0]
    settings = Settings.from_extra_config({"backend_url": url, "arrival_timeout": "3s"})
    lookup = open_lookup_client(LookupConfig(backend_url=url), EXISTS, runtime=runtime)
    s = ECSchedulerSide(settings, lookup, producer=False, consumer=True, clock=lambda: now[0])
    try:
        s.build_connector_meta(step(8))
        req = request("r1", ("img-never", 0, 4), params={SAVING_PARAM: ["img-never"]})
        assert wait_answer(s, req) is False and s.item_state("img-never") is ItemState.ARRIVING
        while now[0] < 103.5 and s.item_state("img-never") is ItemState.ARRIVING:
            now[0] += 0.001  # a 1 ms engine step
            asked, answered = s.totals()["lookups"], lookup.metrics.completed
            admitted = s.ensure_cache_available(req, 0)
            assert admitted is (s.item_state("img-never") is ItemState.MISS)  # True only once it gave up
            deadline = time.monotonic() + 5  # a hang guard
            while s.totals()["lookups"] > asked and lookup.metrics.completed == answered:
                assert time.monotonic() < deadline
                time.sleep(0.0005)  # each look is a real store call: let the loop answer it
        assert s.item_state("img-never") is ItemState.MISS  # gave up at the deadline: the encoder runs
        assert s.totals()["arrival_timeouts"] == 1
        assert 10 <= s.totals()["lookups"] <= 45, s.totals()["lookups"]  # 3 s of 1 ms steps: ~35, never ~600
    finally:
        s.close()


def test_workers_and_lookups_open_the_store_with_connect_timeout(
    runtime: Runtime, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``connect_timeout`` (not the serving-path ``store_timeout``) bounds the start-up connection."""
    seen: list[tuple[float, float | None]] = []
    original = TensorStore.open.__func__  # type: ignore[attr-defined]

    async def spy(
        cls: Any, url: str, *, timeout: float = 5.0, connect_timeout: float | None = None, **more: Any
    ) -> Any:
        seen.append((timeout, connect_timeout))
        return await original(cls, url, timeout=timeout, connect_timeout=connect_timeout, **more)

    monkeypatch.setattr(TensorStore, "open", classmethod(spy))
    worker = make_worker(runtime, url, store_timeout="200ms", connect_timeout="7s")
    worker.close()
    settings = Settings.from_extra_config(
        {"backend_url": url, "lookup_timeout": "300ms", "connect_timeout": "7s"}
    )
    open_lookup_client(LookupConfig.from_settings(settings), EXISTS, runtime=runtime).close()
    # A lookup's store calls may run a little past its deadline: the client's deadline decides a timeout.
    assert seen == [(0.2, 7.0), (0.3 + STORE_SLACK_S, 7.0)]
