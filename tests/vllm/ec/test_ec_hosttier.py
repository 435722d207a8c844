"""The EC worker's host tier: an item it saved is prefetched from the tier after the store lost it, and the
tier's counters reach the worker's stats."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.vllm.ec.metadata import ECStepMetadata, ItemRef
from asyncconn.vllm.prom import EC_COUNTERS
from asyncconn.vllm.totals import HOST_COUNTERS
from tests.vllm.ec.test_units import make_worker, settle

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


def test_a_saved_item_is_prefetched_from_the_host_tier(runtime: Runtime) -> None:
    url = f"memory://ec-tier-{uuid.uuid4().hex[:8]}"
    behind = runtime.run(TensorStore.open(url), 5)  # the same store, without the tier
    worker = make_worker(runtime, url, host_cache_bytes="1MiB")
    tier = worker.store.host_tier
    assert tier is not None
    emb = torch.randn(6, 32)
    worker.save_caches({"img": emb}, "img")
    deadline = time.monotonic() + 5
    while worker.has_pending_saves() and time.monotonic() < deadline:
        worker.end_step()
        time.sleep(0.001)
    assert worker.report().stats["saves_done"] == 1
    assert runtime.run(behind.delete([worker.key("img")]), 5) == 1  # only the tier has it now
    cache: dict[str, torch.Tensor] = {}
    worker.start_load_caches(cache, ECStepMetadata(prefetch=[ItemRef("img", 6)]))
    report = settle(worker, {"img"})
    assert report.failed == {} and tier.stats.hits == 1
    worker.end_step()  # the tier's counters reach the worker's stats (and asyncconn:ec_host_* on /metrics)
    stats = worker.report().stats
    assert {k: v for k, v in stats.items() if k.startswith("host_")} == {
        "host_hits": 1,
        "host_bytes_hit": tier.stats.bytes_hit,
    }
    assert tier.stats.bytes_hit > emb.numel() * emb.element_size()  # the framed value: header + payload
    assert set(HOST_COUNTERS) <= set(EC_COUNTERS)
    worker.start_load_caches(cache, ECStepMetadata(install=[ItemRef("img", 6)]))
    assert torch.equal(cache["img"], emb)
    worker.close()
    runtime.run(behind.close(), 5)
