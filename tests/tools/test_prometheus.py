"""The tools' one Prometheus text reader: totals per name, and one series by a label (values with commas)."""

from __future__ import annotations

from asyncconn_tools import prometheus

TEXT = """# HELP vllm:prompt_tokens_cached_by_source_total Prompt tokens by source.
# TYPE vllm:prompt_tokens_cached_by_source_total counter
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="/m/a,b",source="host"} 768.0
vllm:prompt_tokens_cached_by_source_total{engine="1",model_name="/m/a,b",source="host"} 32.0
vllm:prompt_tokens_cached_by_source_total{engine="0",model_name="/m/a,b",source="disk"} 16.0
lmcache_mp_lookup_hit_l2_tokens_total 5
vllm:num_requests_running{engine="0"} not-a-number
"""


def test_totals_sum_label_sets_and_skip_comments_and_bad_values() -> None:
    assert prometheus.totals(TEXT) == {
        "vllm:prompt_tokens_cached_by_source_total": 816.0,
        "lmcache_mp_lookup_hit_l2_tokens_total": 5.0,
    }
    assert prometheus.totals(TEXT, lambda name: name.startswith("lmcache_")) == {
        "lmcache_mp_lookup_hit_l2_tokens_total": 5.0
    }


def test_one_series_by_a_label_whatever_the_other_labels_hold() -> None:
    assert prometheus.by_label(TEXT, "vllm:prompt_tokens_cached_by_source_total", "source") == {
        "host": 800.0,
        "disk": 16.0,
    }
    assert prometheus.by_label(TEXT, "lmcache_mp_lookup_hit_l2_tokens_total", "source") == {"": 5.0}
    assert prometheus.by_label(TEXT, "absent", "source") == {}
