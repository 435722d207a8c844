"""The connectors' counters on vLLM's /metrics: names, per-engine labels, summed failures, re-registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from asyncconn.vllm.prom import ec_prom_metrics, kv_prom_metrics

TYPES = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
pytestmark = [pytest.mark.vllm, pytest.mark.interface]  # the factories build vLLM's own Prometheus metrics

CONFIG = SimpleNamespace(kv_transfer_config=None, ec_transfer_config=None)


def _value(name: str) -> float | None:
    return REGISTRY.get_sample_value(f"{name}_total", {"engine": "0"})


def test_ec_counters_sum_load_failures_per_reason() -> None:
    prom = ec_prom_metrics(CONFIG, TYPES, ["engine"], {0: ["0"]})
    prom.observe({"loaded": 3, "load_failed_miss": 2, "load_failed_corrupt": 1, "unknown": 9}, 0)
    assert _value("asyncconn:ec_loaded") == 3
    assert _value("asyncconn:ec_load_failed") == 3


def test_kv_counters_and_a_second_engine_in_the_process() -> None:
    kv_prom_metrics(CONFIG, TYPES, ["engine"], {0: ["0"]}).observe({"tokens_loaded": 64}, 0)
    again = kv_prom_metrics(CONFIG, TYPES, ["engine"], {0: ["0"]})  # registering twice must not raise
    again.observe({"tokens_loaded": 32, "saves": True}, 0)  # a bool is not a count
    assert _value("asyncconn:kv_tokens_loaded") == 32
    assert _value("asyncconn:kv_saves") == 0


def test_kv_latency_histograms_hold_the_connectors_bucket_counts() -> None:
    """The stats' bucket counts land whole in the Prometheus buckets of the same bounds (cumulative, as
    Prometheus reports them); ``_count`` sums them; a second interval adds to the first."""
    from asyncconn.vllm.kv.metadata import AsyncConnKVStats

    stats = AsyncConnKVStats()
    for seconds in (0.0004, 0.003, 0.003, 0.2, 9.0):  # <= 0.5 ms, <= 5 ms (two), <= 250 ms, over 5 s
        stats.observe("load_latency", seconds)
    stats.observe("lookup_latency", 0.0015)
    prom = kv_prom_metrics(CONFIG, TYPES, ["engine"], {0: ["0"]})
    prom.observe(stats.data, 0)
    prom.observe(stats.data, 0)  # the next interval's

    def bucket(name: str, le: str) -> float | None:
        return REGISTRY.get_sample_value(f"asyncconn:kv_{name}_seconds_bucket", {"engine": "0", "le": le})

    assert [
        bucket("load_latency", le) for le in ("0.00025", "0.0005", "0.005", "0.1", "0.25", "5.0", "+Inf")
    ] == [
        0,
        2,
        6,
        6,
        8,
        8,
        10,
    ]
    assert REGISTRY.get_sample_value("asyncconn:kv_load_latency_seconds_count", {"engine": "0"}) == 10
    assert bucket("lookup_latency", "0.001") == 0 and bucket("lookup_latency", "0.0025") == 2
    assert REGISTRY.get_sample_value("asyncconn:kv_save_latency_seconds_count", {"engine": "0"}) == 0
