"""The host tier's counters reach the KV worker's stats (and so ``asyncconn:kv_host_*`` on /metrics)."""

from __future__ import annotations

import collections
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from asyncconn.store import TensorStore
from asyncconn.vllm.kv.metadata import HOST_COUNTERS, LOCAL_COUNTERS, AsyncConnKVStats, worker_totals

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


async def test_worker_totals_report_the_tiers_counters_and_the_log_omits_them_when_zero() -> None:
    saver = SimpleNamespace(saved=0, saved_bytes=0, failures=collections.Counter())
    loader = SimpleNamespace(failures=collections.Counter())
    plain = await TensorStore.open("memory://")
    assert plain.host_tier is None
    assert not set(AsyncConnKVStats().reduce()) & set(HOST_COUNTERS)  # tier off: not in vLLM's log line
    assert worker_totals(saver, loader, plain, 32).take() == {}
    store = await TensorStore.open("memory://", host_cache_bytes=1 << 20)
    totals = worker_totals(saver, loader, store, 32)
    value = torch.randn(16)
    await store.put([("a", value)])
    out = torch.empty(16)
    assert await store.get_into("a", out) and await store.get_into("a", out)
    assert not await store.get_into("b", out)
    taken = totals.take()
    held = store.host_tier.lru.peek("a")  # type: ignore[union-attr]
    assert held is not None
    size = held.extent.size
    assert taken == {"host_hits": 2, "host_misses": 1, "host_bytes_hit": 2 * size}
    assert totals.take() == {}
    await store.put([("big", torch.randn(1 << 19))])  # 2 MiB: over the 1 MiB bound, not kept
    assert totals.take() == {"host_bypassed": 1}
    stats = AsyncConnKVStats()
    for name, change in taken.items():
        stats.add(name, change)
    assert stats.reduce()["host_hits"] == 2
    await plain.close()
    await store.close()


async def test_worker_totals_report_the_local_stores_counters(tmp_path: Path) -> None:
    saver = SimpleNamespace(saved=0, saved_bytes=0, failures=collections.Counter())
    loader = SimpleNamespace(failures=collections.Counter())
    assert not set(AsyncConnKVStats().reduce()) & set(LOCAL_COUNTERS)  # off: not in vLLM's log line
    store = await TensorStore.open("memory://", local_url=f"file://{tmp_path}")
    totals = worker_totals(saver, loader, store, 32)
    layered = store.layered
    assert layered is not None
    value = torch.randn(16)
    await store.put([("near", value)])
    await layered.local.delete(["near"])
    out = torch.empty(16)
    assert await store.get_into("near", out)  # from the shared store, then written locally
    assert await store.get_into("near", out)  # locally
    assert totals.take() == {"local_hits": 1, "local_misses": 1, "local_fills": 1}
    assert totals.take() == {}
    await store.close()
