"""One name per concept: the preemption wait has its own setting, and the settings and URL parameters that
bound or name the same thing at two layers compose as docs/configuration.md says ("How prefixes compose",
"Which timeout applies")."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from asyncconn import config as config_module
from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError
from asyncconn.lookup.protocol import store_key

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text()
REDIS = "redis://127.0.0.1:6379/0"


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config_module, "_warned", set())


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    records = [r for r in caplog.records if r.name == "asyncconn.config"]
    return [r.getMessage() for r in records if r.levelno >= logging.WARNING]


# -- preempt_timeout ----------------------------------------------------------------------------------------
def test_preempt_timeout_defaults_to_what_store_timeout_gave_it() -> None:
    """Behaviour does not change: the preemption wait was ``store_timeout``, 5 s unless set."""
    settings = Settings.from_extra_config({})
    assert settings.preempt_timeout == settings.store_timeout == 5.0


def test_preempt_timeout_is_its_own_setting() -> None:
    settings = Settings.from_extra_config({"preempt_timeout": "250ms", "store_timeout": "2s"})
    assert (settings.preempt_timeout, settings.store_timeout) == (0.25, 2.0)
    assert Settings.from_extra_config({"store_timeout": "1s"}).preempt_timeout == 5.0


@pytest.mark.parametrize("value", [0, "0s", -1, "inf", True, None, "soon"])
def test_preempt_timeout_is_checked_like_every_duration(value: object) -> None:
    with pytest.raises(ConfigError, match="'preempt_timeout'"):
        Settings.from_extra_config({"preempt_timeout": value})


def test_an_unknown_key_is_still_refused() -> None:
    with pytest.raises(ConfigError, match="unknown key 'preemption_timeout'"):
        Settings.from_extra_config({"preemption_timeout": "1s"})


# -- which timeout applies ----------------------------------------------------------------------------------
def test_store_timeout_past_the_urls_timeout_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Raising ``store_timeout`` alone past a Redis URL's ``timeout`` (5 s by default) changes nothing: the
    smaller bound ends a call. Said once per process, however often the settings are parsed."""
    caplog.set_level(logging.WARNING, logger="asyncconn.config")
    for _ in range(3):
        Settings.from_extra_config({"backend_url": REDIS, "store_timeout": "10s"})
    (line,) = _warnings(caplog)
    assert "store_timeout 10s" in line and "timeout 5s (its default)" in line and "timeout=" in line


def test_store_timeout_past_an_explicit_url_timeout_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="asyncconn.config")
    Settings.from_extra_config({"backend_url": f"{REDIS}?timeout=2s", "store_timeout": "3s"})
    (line,) = _warnings(caplog)
    assert "timeout 2s:" in line and "(its default)" not in line


@pytest.mark.parametrize(
    "extra",
    [
        {"backend_url": REDIS},  # both defaults: 5 s and 5 s
        {"backend_url": REDIS, "store_timeout": "5s"},
        {"backend_url": REDIS, "store_timeout": "1s"},  # the connector's bound is the tighter: intended
        {"backend_url": f"{REDIS}?timeout=30s", "store_timeout": "10s"},  # both raised
        {"backend_url": "memory://x", "store_timeout": "60s"},  # no URL timeout to shadow it
        {"backend_url": "file:///tmp/asyncconn-names-test", "store_timeout": "60s"},
    ],
)
def test_no_warning_when_store_timeout_is_what_applies(
    extra: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="asyncconn.config")
    Settings.from_extra_config(extra)
    assert _warnings(caplog) == []


# -- how prefixes compose -----------------------------------------------------------------------------------
def test_the_documented_key_is_the_one_the_code_makes() -> None:
    """URL ``prefix`` outside the braces, ``key_prefix`` inside, then the key (docs' example, verbatim)."""
    from asyncconn_backends.redis.layout import main_key

    value_hash = bytes.fromhex("3f2a9c0e5b7d41e8a6c2f09d1b3e7a54")
    key = main_key("tenantA:", store_key("kv:", value_hash))
    assert key == "tenantA:{kv:3f2a9c0e5b7d41e8a6c2f09d1b3e7a54}"
    assert f"\n{key}\n" in CONFIG_DOC


def test_the_two_prefixes_and_timeouts_are_explained_where_they_are_listed() -> None:
    for section in ("## How prefixes compose", "## Which timeout applies"):
        assert section in CONFIG_DOC
    for anchor in ("(#how-prefixes-compose)", "(#which-timeout-applies)"):
        assert CONFIG_DOC.count(anchor) >= 2, anchor  # from the settings table and the URL tables
