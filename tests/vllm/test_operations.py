"""What an operator sees: saves counted apart from failed saves, failures by cause, lookup timeouts
counted and logged with the counter's value, store reachability as a gauge, and every series that
docs/operations.md names."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from asyncconn.config import Settings
from asyncconn.exceptions import BackendUnavailable
from asyncconn.lookup import PREFIX, LookupClient
from asyncconn.runtime import Runtime
from asyncconn.transfer import CpuDevice
from asyncconn.vllm.ec.worker import ECWorkerSide
from asyncconn.vllm.kv.keys import KeySpace
from asyncconn.vllm.kv.metadata import COUNTERS, GAUGES, HISTOGRAMS, AsyncConnKVMetadata, SaveSpec, ValueRef
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from asyncconn.vllm.kv.worker import KVWorkerSide
from asyncconn.vllm.prom import EC_COUNTERS, EC_GAUGES, ec_prom_metrics, kv_prom_metrics
from tests.lookup.fakes import FakeTransport, wait_until
from tests.vllm.kv.scheduling import fake_request
from tests.vllm.kv.test_scheduler import IDENTITY
from tests.vllm.kv.test_worker_loads import _worker

pytestmark = pytest.mark.interface

OPERATIONS_DOC = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()


@pytest.fixture
def runtime() -> Iterator[Runtime]:
    rt = Runtime(name="operations").start()
    yield rt
    rt.close()


def _save(worker: KVWorkerSide, rid: str, hashes: Sequence[bytes]) -> None:
    refs = tuple(ValueRef(h, (0,), ((i + 1,),)) for i, h in enumerate(hashes))
    worker.save(AsyncConnKVMetadata(saves=[SaveSpec(rid, refs)]))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sending, _ = worker.get_finished({rid}, step_tokens=1)
        if sending and rid in sending:
            return
        time.sleep(0.002)
    raise AssertionError(f"the saves of {rid} never finished")


def test_kv_saves_are_counted_when_confirmed_and_failed_saves_apart(runtime: Runtime) -> None:
    worker, _, _ = _worker(runtime, 1)
    try:
        worker.stats()  # whatever registration counted
        _save(worker, "ok", [bytes([1]) * 32, bytes([2]) * 32])
        stats = worker.stats()
        assert stats is not None
        data = stats.data
        assert data["saves"] == 2 and data["saves_submitted"] == 2 and data["save_failures"] == 0
        assert data["tokens_saved"] == 2 * 16 and data["bytes_saved"] > 0

        backend = worker.store.backend

        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise BackendUnavailable("connection refused")

        real_put, real_exists = backend.put, backend.exists
        backend.put = backend.exists = refused  # type: ignore[method-assign]  # the store goes away
        _save(worker, "down", [bytes([3]) * 32, bytes([4]) * 32, bytes([5]) * 32])
        stats = worker.stats()
        assert stats is not None
        data = stats.data
        assert data["saves"] == 0 and data["saves_submitted"] == 3  # a failed save is not a save
        assert data["save_failures"] == 3 and data["save_failures_store_error"] == 3
        assert data["store_outages"] == 1 and data["store_unreachable"] == 1
        assert stats.reduce()["save_failures_store_error"] == 3

        backend.put, backend.exists = real_put, real_exists  # type: ignore[method-assign]
        _save(worker, "back", [bytes([6]) * 32])
        stats = worker.stats()
        assert stats is not None
        assert stats.data["saves"] == 1 and stats.data["store_unreachable"] == -1  # the gauge comes down
        assert worker.stats() is None  # a quiet step builds nothing
    finally:
        worker.close()


def test_kv_scheduler_counts_lookup_timeouts_and_the_line_quotes_the_counter(
    runtime: Runtime, caplog: pytest.LogCaptureFixture
) -> None:
    transport = FakeTransport()  # never answers
    client = LookupClient(transport, PREFIX, runtime=runtime, timeout=0.05)
    side = KVSchedulerSide(KeySpace(IDENTITY), lookup=client, save=False)
    try:
        with caplog.at_level(logging.WARNING, logger="asyncconn.lookup.client"):
            for rid in ("a", "b", "c"):
                assert side.get_num_new_matched_tokens(fake_request(rid), 0) == (None, False)
            wait_until(lambda: client.metrics.timeouts == 3)
        stats = side.stats()
        assert stats is not None and stats.data["lookup_timeouts"] == 3
        lines = [r.getMessage() for r in caplog.records if r.name == "asyncconn.lookup.client"]
        assert lines, "lookup timeouts were not logged"
        found = (re.search(r"(\d+) lookup timeouts since start", line) for line in lines)
        totals = [int(m.group(1)) for m in found if m]
        assert totals and totals[-1] <= client.metrics.timeouts and max(totals) <= 3
        assert side.stats() is None  # nothing new: nothing reported twice
    finally:
        side.close()


def test_ec_saves_are_counted_when_confirmed_and_failed_saves_apart(runtime: Runtime) -> None:
    settings = Settings.from_extra_config({"backend_url": "memory://ec-ops", "pinned_pool_bytes": "16MiB"})
    worker = ECWorkerSide(settings, producer=True, consumer=False, runtime=runtime, device=CpuDevice())
    try:

        async def refused(*args: Any, **kwargs: Any) -> Any:
            raise BackendUnavailable("connection refused")

        backend = worker.store.backend
        real = backend.put, backend.exists
        backend.put = backend.exists = refused  # type: ignore[method-assign]
        cache = {f"img-{i}": torch.randn(2, 4) for i in range(3)}
        for mm_hash in cache:
            worker.save_caches(cache, mm_hash)
        wait_until(lambda: (worker.end_step(), not worker.has_pending_saves())[1])
        counts = worker.report().stats
        assert counts["saves_submitted"] == 3 and counts.get("saves", 0) == 0
        assert counts["save_failed"] == 3 and counts["save_failed_store_error"] == 3
        assert counts["store_outages"] == 1 and counts["store_unreachable"] == 1
        backend.put, backend.exists = real  # type: ignore[method-assign]
        worker.save_caches({"img-ok": torch.randn(2, 4)}, "img-ok")
        wait_until(lambda: (worker.end_step(), not worker.has_pending_saves())[1])
        counts = worker.report().stats
        assert counts["saves"] == 1 and counts["saved_bytes"] > 0 and counts["store_unreachable"] == -1
    finally:
        worker.close()


def _sample(name: str) -> float | None:
    return REGISTRY.get_sample_value(name, {"engine": "0"})


def test_the_reachability_gauge_follows_the_changes() -> None:
    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    config = type("C", (), {"kv_transfer_config": None, "ec_transfer_config": None})()
    prom = kv_prom_metrics(config, types, ["engine"], {0: ["0"]})
    prom.observe({"store_unreachable": 1, "store_outages": 1, "lookup_timeouts": 4}, 0)
    prom.observe({"store_unreachable": 1, "store_outages": 1}, 0)  # a second worker
    assert _sample("asyncconn:kv_store_unreachable") == 2
    prom.observe({"store_unreachable": -2}, 0)
    assert _sample("asyncconn:kv_store_unreachable") == 0
    assert _sample("asyncconn:kv_store_outages_total") == 2
    assert _sample("asyncconn:kv_lookup_timeouts_total") == 4
    ec = ec_prom_metrics(config, types, ["engine"], {0: ["0"]})
    ec.observe({"store_unreachable": 1, "save_failed_timeout": 2, "saves_submitted": 5}, 0)
    assert _sample("asyncconn:ec_store_unreachable") == 1
    assert _sample("asyncconn:ec_save_failed_timeout_total") == 2


def test_every_series_the_operations_doc_names_is_exported() -> None:
    exported = {f"asyncconn:kv_{n}_total" for n in COUNTERS} | {f"asyncconn:kv_{n}" for n in GAUGES}
    exported |= {f"asyncconn:ec_{n}_total" for n in EC_COUNTERS} | {f"asyncconn:ec_{n}" for n in EC_GAUGES}
    exported |= {f"asyncconn:kv_{n}_seconds{part}" for n in HISTOGRAMS for part in ("", "_bucket")}
    named = set(re.findall(r"`(asyncconn:(?:kv|ec)_[a-z_]+)`", OPERATIONS_DOC))
    named |= set(re.findall(r"\((asyncconn:(?:kv|ec)_[a-z_]+)\[", OPERATIONS_DOC))  # inside PromQL
    assert named, "docs/operations.md names no series"
    assert named <= exported, sorted(named - exported)
    for gauge in (*GAUGES, *EC_GAUGES):
        assert f"_{gauge}`" in OPERATIONS_DOC
    for histogram in HISTOGRAMS:
        assert f"`asyncconn:kv_{histogram}_seconds`" in OPERATIONS_DOC


def test_kv_failure_causes_are_counters() -> None:
    for cause in ("timeout", "store_error", "corrupt", "miss", "too_large", "device_error"):
        assert f"load_failures_{cause}" in COUNTERS and f"save_failures_{cause}" in COUNTERS
    assert "not_cached" not in " ".join(COUNTERS)
