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
