"""The operator's JSON (``examples/vllm_offload_tier.json``) through vLLM's own plumbing: ``KVTransferConfig``
-> ``OffloadingConnector`` (scheduler role) -> ``build_offloading_config`` -> ``TieringOffloadingSpec`` ->
``SecondaryTierFactory`` loads asyncconn's tier by ``type`` + ``module_path`` with the entry's keys.
The worker role needs CUDA (tests/engine/test_offload_tier_engine.py, on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from asyncconn.vllm.tier import AsyncConnTier
from asyncconn_tools.sim.config import ConnectorSpec, SimShape, build_kv_cache_config, build_vllm_config

pytestmark = pytest.mark.interface

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_offload_tier.json"


def test_the_example_config_loads_the_tier_into_vllms_offloading_connector(
    sim_model_dir: Path, tmp_path: Any
) -> None:
    config = json.loads(EXAMPLE.read_text())
    extra = config["kv_connector_extra_config"]
    extra["cpu_bytes_to_use"] = 1 << 20
    (entry,) = extra["secondary_tiers"]
    entry["backend_url"] = f"file://{tmp_path}/store"  # the example's Redis, swapped for a directory
    shape = SimShape()
    vllm_config = build_vllm_config(
        sim_model_dir,
        shape,
        max_num_seqs=4,
        max_num_batched_tokens=256,
        max_model_len=512,
        enable_prefix_caching=True,
        kv=ConnectorSpec(config["kv_connector"], None, config["kv_role"], extra),
        ec=None,
    )
    connector = OffloadingConnector(vllm_config, KVConnectorRole.SCHEDULER, build_kv_cache_config(shape))
    try:
        manager: Any = connector.connector_scheduler.manager  # type: ignore[union-attr]
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, AsyncConnTier)
        assert tier.settings.key_prefix == "tier:" and tier.settings.max_inflight_transfers == 16
        assert tier.settings.backend_url == entry["backend_url"]
        assert tier.block_size_bytes == manager.primary_tier.get_kv_memoryview().strides[0]
    finally:
        connector.shutdown()
    assert tier.io.store._closing
