"""vLLM's real engine with its own ``OffloadingConnector`` (``TieringOffloadingSpec``: CPU tier + asyncconn's
tier on a ``file://`` store), the operator's configuration of ``examples/vllm_offload_tier.json``: a second
engine, with an empty GPU cache and an empty CPU tier, gets the prompts' KV from the store, byte for byte.

The connector's GPU worker is CUDA-only (vLLM's CPU build refuses it), so this runs only on an NVIDIA GPU
with vLLM's CUDA build; it is skipped everywhere else. The tier itself is proven on CPU by
tests/vllm/offload/ (vLLM's ``TieringOffloadingManager`` driving it in-process against real stores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncconn_tools.engines import Probe, close_llm, make_llm
from tests.engine.kvcase import PROMPTS, assert_same_kv, generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="vLLM's OffloadingConnector worker needs an NVIDIA GPU"
    ),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_offload_tier.json"


def _offload_config(store: str) -> Any:
    from vllm.config import KVTransferConfig

    data = json.loads(EXAMPLE.read_text())
    extra = data["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 64 << 20
    extra["secondary_tiers"][0]["backend_url"] = store
    return KVTransferConfig(**data)


def _tier(llm: Any) -> Any:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    (tier,) = scheduler.connector.connector_scheduler.manager.secondary_tiers
    return tier


def test_a_fresh_engine_gets_the_prompts_kv_from_the_store(
    text_model: Path, kv_reference: dict[str, Any], engines: list[Any], tmp_path: Path
) -> None:
    config = _offload_config(f"file://{tmp_path}/store")
    first = make_llm(text_model, kv=config)
    engines.append(first)
    assert generate(first, PROMPTS) == kv_reference["tokens"]
    for _ in range(3):  # a few more steps: the last GPU -> CPU stores complete and cascade to the store
        generate(first, [[7] * 40], max_tokens=4)
    written = _tier(first).io.counts.written
    assert written > 0
    engines.remove(first)
    close_llm(first)  # the tier's shutdown waits for its running writes

    second = make_llm(text_model, kv=_offload_config(f"file://{tmp_path}/store"))
    engines.append(second)
    assert generate(second, PROMPTS) == kv_reference["tokens"]
    tier = _tier(second)
    assert tier.io.counts.read > 0 and tier.io.counts.read_corrupt == 0  # the KV came from the store
    probe = Probe(second)
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
