"""A bad ``kv_connector_extra_config`` stops vLLM while it builds its configuration, before any engine
process starts or the model loads, with one message; through vLLM's own config objects and factory."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.config.compilation import CUDAGraphMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from asyncconn.exceptions import ConfigError
from asyncconn.vllm import logs
from asyncconn.vllm.checks import check_extra_config

pytestmark = pytest.mark.interface


def kv_config(extra: dict[str, Any]) -> Any:
    return KVTransferConfig(
        kv_connector="AsyncConnKVConnector",
        kv_connector_module_path="asyncconn.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )


def hook(extra: dict[str, Any]) -> bool:
    """What ``VllmConfig.__post_init__`` calls (vllm/config/vllm.py, "Check if KV connector requires
    PIECEWISE mode"): the class the factory resolves, asked with the extra config."""
    config = kv_config(extra)
    connector_cls = KVConnectorFactory.get_connector_class(config)
    return bool(connector_cls.requires_piecewise_for_cudagraph(config.kv_connector_extra_config))


def test_the_config_time_hook_rejects_a_typo_with_one_message_and_accepts_good_settings() -> None:
    with pytest.raises(ConfigError) as info:
        hook({"backend_url": "memory://x", "lookup_timeuot": "1s"})
    message = str(info.value)
    assert message.startswith("kv_connector_extra_config: unknown key 'lookup_timeuot' (accepted: ")
    assert info.value.__cause__ is None and info.value.__suppress_context__  # nothing chained: one story
    assert hook({"backend_url": "memory://x", "lookup_timeout": "250ms"}) is False


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({"lookup_timeout": "soon"}, "kv_connector_extra_config: 'lookup_timeout': bad value 'soon'"),
        ({"sync_lookup": [1]}, "kv_connector_extra_config: 'sync_lookup'"),
        ({"backend_url": "nosuch://h"}, "kv_connector_extra_config: 'backend_url'"),
        ({"backend_url": "redis://h/0?password_env=ASYNCCONN_UNSET_FOR_TEST"}, "ASYNCCONN_UNSET_FOR_TEST"),
    ],
)
def test_keys_types_urls_and_password_sources_are_checked(
    extra: dict[str, Any], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ASYNCCONN_UNSET_FOR_TEST", raising=False)
    with pytest.raises(ConfigError) as info:
        hook(extra)
    assert expected in str(info.value)


def test_an_unreadable_password_file_is_named_and_an_inline_password_warned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = tmp_path / "no-such-secret"
    with pytest.raises(ConfigError, match="no-such-secret"):
        hook({"backend_url": f"redis://h:6379/0?password_file={missing}"})
    monkeypatch.setattr(logs, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="asyncconn.vllm"):
        assert hook({"backend_url": "redis://:s3cr3t-inline@h:6379/0"}) is False
    (line,) = [r.getMessage() for r in caplog.records if r.name == "asyncconn.vllm"]
    assert "password_env" in line and "password_file" in line and "s3cr3t-inline" not in line


def test_vllm_config_construction_fails_at_once_with_our_message(
    sim_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real ``VllmConfig``: what ``vllm serve`` builds in its front-end process before it starts the
    engine. The CPU platform turns CUDA graphs off, so the branch that asks the connector is opened as on
    CUDA, where full CUDA graphs are vLLM's default."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "support_static_graph_mode", lambda: True)
    monkeypatch.setattr(CUDAGraphMode, "has_full_cudagraphs", lambda self: True)
    model = ModelConfig(
        model=str(sim_model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=256
    )
    bad = kv_config({"backend_url": "memory://x", "store_timeout": "-1s"})
    with pytest.raises(ValueError) as info:  # pydantic's ValidationError wraps it ("Value error, <ours>")
        VllmConfig(model_config=model, device_config=DeviceConfig("cpu"), kv_transfer_config=bad)
    text = str(info.value)
    assert text.count("kv_connector_extra_config: 'store_timeout': bad value '-1s'") == 1, text


def test_the_ec_wording_names_its_own_field() -> None:
    with pytest.raises(ConfigError, match=r"^ec_connector_extra_config: unknown key 'bakend_url'"):
        check_extra_config({"bakend_url": "memory://x"}, "ec_connector_extra_config")
