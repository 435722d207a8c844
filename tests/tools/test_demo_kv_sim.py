"""``run_kv_demo``: the second wave loads the first wave's KV, and the loaded bytes are the computed ones."""

from __future__ import annotations

from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.exceptions import ConfigError
from asyncconn_tools.demo.kv_sim import run_kv_demo
from tests.vllm.kv.test_support import store_url

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


def test_demo_memory_store(sim_model_dir: Any) -> None:
    result = run_kv_demo(store_url(), model_dir=sim_model_dir)
    assert result["kv_bytes_equal"] is True and result["bytes_compared"] > 0
    assert result["wave1"]["tokens_loaded_from_store"] == 0
    assert result["wave2"]["tokens_loaded_from_store"] == 8 * 128  # every shared prefix, whole blocks
    assert result["wave2"]["tokens_recomputed"] == 8 * 24


def test_demo_redis_store_four_block_values(sim_model_dir: Any, redis_server: Any) -> None:
    result = run_kv_demo(
        redis_server.url, model_dir=sim_model_dir, num_requests=4, prefix_tokens=80, blocks_per_value=4
    )
    assert result["kv_bytes_equal"] is True
    # 80-token prefixes hold one whole 64-token value; the rest of each prompt is recomputed
    assert result["wave2"]["tokens_loaded_from_store"] == 4 * 64
    assert result["backend_url"].startswith("redis://")


def test_demo_bad_url_is_a_config_error(sim_model_dir: Any) -> None:
    with pytest.raises(ConfigError):
        run_kv_demo("nosuchscheme://x", model_dir=sim_model_dir)
