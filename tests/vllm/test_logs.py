"""asyncconn's log lines inside vLLM: vLLM's handler and format (process, pid, level, time), never twice."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator

import pytest
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging

from asyncconn.config import Settings
from asyncconn.vllm import logs
from asyncconn.vllm.logs import attach_handlers, follow_vllm_logging, log_start

pytestmark = pytest.mark.interface

#: vLLM's text format: "(ProcessName pid=123) INFO 11-28 01:02:03 [file.py:42] message".
VLLM_LINE = re.compile(r"^\(\S+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d \[test_logs\.py:\d+\] hello 7$")


@pytest.fixture
def vllm_logging() -> Iterator[logging.Logger]:
    """vLLM's logging configured as its processes configure it; everything it touched restored after."""
    vllm_logger = logging.getLogger("vllm")
    saved = (list(vllm_logger.handlers), vllm_logger.level, vllm_logger.propagate)
    factory = logging.getLogRecordFactory()
    configure_logging(LoggingConfig(configure_logging=True, log_level="INFO"))
    try:
        yield vllm_logger
    finally:
        vllm_logger.handlers[:] = saved[0]
        vllm_logger.setLevel(saved[1])
        vllm_logger.propagate = saved[2]
        logging.setLogRecordFactory(factory)


def test_asyncconn_lines_get_vllms_format_with_time_level_and_pid(vllm_logging: logging.Logger) -> None:
    target, root = logging.Logger("asyncconn-under-test"), logging.Logger("root-under-test")
    assert attach_handlers(vllm_logging, target, root)
    assert target.handlers == vllm_logging.handlers and target.level == logging.INFO
    (handler,) = [h for h in target.handlers if h.name == "vllm"]  # the one vLLM's dictConfig names
    fmt = handler.formatter._fmt if handler.formatter is not None else ""
    assert fmt is not None and all(f in fmt for f in ("%(asctime)s", "%(levelname)s", "%(process)d"))
    record = target.makeRecord(target.name, logging.INFO, __file__, 1, "hello %d", (7,), None)
    assert VLLM_LINE.match(handler.format(record)), handler.format(record)


def test_nothing_is_attached_twice_or_over_a_configured_root(vllm_logging: logging.Logger) -> None:
    target, root = logging.Logger("asyncconn-under-test"), logging.Logger("root-under-test")
    assert attach_handlers(vllm_logging, target, root)
    assert attach_handlers(vllm_logging, target, root)  # a second connector: no second handler
    assert len(target.handlers) == len(vllm_logging.handlers)
    configured = logging.Logger("root-configured")
    configured.addHandler(logging.NullHandler())
    other = logging.Logger("asyncconn-other")
    assert not attach_handlers(vllm_logging, other, configured)  # else: each line twice
    assert not other.handlers
    assert not attach_handlers(logging.Logger("no-vllm-handler"), other, root)  # VLLM_CONFIGURE_LOGGING=0


def test_the_connectors_call_attaches_to_the_asyncconn_logger(
    vllm_logging: logging.Logger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as in vLLM: nothing on the root logger
    ours = [logging.getLogger(name) for name in ("asyncconn", "asyncconn_backends")]
    levels = [logger.level for logger in ours]
    for logger in ours:
        monkeypatch.setattr(logger, "handlers", [])
        logger.setLevel(logging.NOTSET)
    try:
        assert follow_vllm_logging()
        assert all(logger.handlers == vllm_logging.handlers for logger in ours)
    finally:
        for logger, level in zip(ours, levels, strict=True):
            logger.setLevel(level)  # (setLevel, not an attribute: it also clears the loggers' caches)


def test_the_start_up_line_names_store_role_and_changed_settings_never_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = "redis://:inline-secret@10.0.0.5:6379/0"
    settings = Settings.from_extra_config({"backend_url": url, "lookup_timeout": "500ms", "key_prefix": "a"})
    with caplog.at_level(logging.INFO, logger="asyncconn.vllm"):
        log_start("KV", "scheduler (kv_both)", settings, lookups="the store")
    (line,) = [r.getMessage() for r in caplog.records if r.name == "asyncconn.vllm"]
    assert "asyncconn KV connector started: role=scheduler (kv_both), store=redis://" in line
    assert "10.0.0.5:6379/0" in line and "lookups=the store" in line
    assert "lookup_timeout=0.5" in line and "key_prefix='a'" in line and "store_timeout" not in line
    assert "inline-secret" not in line


def test_an_inline_password_warns_once_and_points_at_password_env(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(logs, "_warned", set())
    settings = Settings.from_extra_config({"backend_url": "redis://:inline-secret@10.0.0.5:6379/0"})
    with caplog.at_level(logging.WARNING, logger="asyncconn.vllm"):
        logs.warn_inline_password(settings, "kv_connector_extra_config")
        logs.warn_inline_password(settings, "kv_connector_extra_config")
        logs.warn_inline_password(Settings(), "ec_connector_extra_config")  # no password: nothing
    (line,) = [r.getMessage() for r in caplog.records]
    assert "password_env" in line and "password_file" in line and "kv_connector_extra_config" in line
    assert "inline-secret" not in line
