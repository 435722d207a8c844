"""Sleep mode: the KV connector declines it, and vLLM then refuses to start rather than corrupt KV.

vLLM 0.33 frees the KV cache at sleep and maps fresh memory at wake-up (``Worker.sleep``/``wake_up`` call
the connector's ``unregister_kv_caches``/``restore_kv_caches`` around it); the worker's loads and deferred
saves would keep using the tensors registered at start-up. ``AsyncConnKVConnector.supports_sleep_mode``
says no, and ``VllmConfig`` (``_verify_kv_transfer_compat``) turns that into a start-up ``ValueError`` when
``enable_sleep_mode`` is set. vLLM 0.32 has no such hook: there the method just exists and says no. The
0.33 half runs on scripts/lane-vllm033.sh; which half runs is decided by the base class, not a version.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

from asyncconn.vllm import AsyncConnKVConnector

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

VLLM_ASKS = hasattr(KVConnectorBase_V1, "supports_sleep_mode")  # vLLM 0.33's connector sleep hooks


def _ours(role: str = "kv_both") -> Any:
    return KVTransferConfig(
        kv_connector="AsyncConnKVConnector",
        kv_connector_module_path="asyncconn.vllm",
        kv_role=role,
        kv_connector_extra_config={"backend_url": "memory://sleep-mode"},
    )


@pytest.mark.parametrize("role", ["kv_both", "kv_producer", "kv_consumer"])
def test_the_connector_declines_sleep_mode_in_every_role(role: str) -> None:
    # A classmethod on the class vLLM loads: it is asked before any connector instance exists.
    assert AsyncConnKVConnector.supports_sleep_mode(_ours(role)) is False


@pytest.mark.skipif(not VLLM_ASKS, reason="this vLLM has no sleep-mode hook for KV connectors (before 0.33)")
def test_vllm_refuses_sleep_mode_with_this_connector_at_start_up(sim_model_dir: Path, tmp_path: Path) -> None:
    model_config = ModelConfig(model=str(sim_model_dir), skip_tokenizer_init=True, dtype="float16")
    # Set after construction: ModelConfig itself refuses the flag on the CPU platform, and what is tested
    # here is the connector check VllmConfig runs on a platform that has sleep mode.
    model_config.enable_sleep_mode = True
    cpu = DeviceConfig("cpu")
    with pytest.raises(ValueError, match="AsyncConnKVConnector does not support sleep mode"):
        VllmConfig(model_config=model_config, device_config=cpu, kv_transfer_config=_ours())
    # The control: vLLM's ExampleConnector keeps the base's default (True) and starts, so the refusal above
    # is our answer, not the CPU platform or the hand-set flag.
    example = KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(tmp_path)},
    )
    started = VllmConfig(model_config=model_config, device_config=cpu, kv_transfer_config=example)
    assert started.model_config.enable_sleep_mode
