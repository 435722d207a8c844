"""The tier's keys: parsed like the connectors' keys of the same names, connector-only keys refused,
errors that name the key and never a password, and every key documented."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from asyncconn.config import DEFAULT_BACKEND_URL
from asyncconn.exceptions import ConfigError
from asyncconn.vllm.tier.settings import TierSettings

DOC = (Path(__file__).resolve().parents[3] / "docs" / "configuration.md").read_text()


def test_defaults_and_shared_parsing() -> None:
    assert TierSettings.from_tier_config({}) == TierSettings()
    assert TierSettings().backend_url == DEFAULT_BACKEND_URL
    config = {"store_timeout": "250ms", "lookup_max_pending": "7", "max_inflight_transfers": 3}
    config["locality"] = "REMOTE"
    s = TierSettings.from_tier_config(config)
    assert (s.store_timeout, s.lookup_max_pending, s.max_inflight_transfers) == (0.25, 7, 3)
    assert s.locality == "REMOTE"


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"pinned_pool_bytes": "1GiB"}, "unknown key 'pinned_pool_bytes'"),
        ({"store_timeout": 0}, "'store_timeout'"),
        ({"max_inflight_transfers": 0}, "'max_inflight_transfers'"),
        ({"max_inflight_transfers": True}, "'max_inflight_transfers'"),
        ({"locality": "NEAR"}, "'locality'"),
        ({"backend_url": "nosuch://x"}, "'backend_url'"),
    ],
)
def test_a_bad_key_or_value_is_named(config: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=r"^secondary_tiers\[AsyncConnTier\]: ") as info:
        TierSettings.from_tier_config(config)
    assert named in str(info.value)


def test_a_password_never_reaches_the_error() -> None:
    with pytest.raises(ConfigError) as info:
        TierSettings.from_tier_config({"backend_url": "redis://:hunter2-secret@127.0.0.1:1/0?timeout=soon"})
    assert "hunter2-secret" not in str(info.value) and info.value.__cause__ is None


@pytest.mark.parametrize("key", [k for k, _, _ in TierSettings.documentation()])
def test_every_key_is_documented(key: str) -> None:
    assert f"| `{key}` |" in DOC, f"docs/configuration.md does not document tier key {key!r}"
