"""classify(): every exception a fetch or put can end with maps to one failure reason."""

from __future__ import annotations

import logging

import pytest

from asyncconn.exceptions import (
    BackendTimeout,
    BackendUnavailable,
    FrameCorrupt,
    FrameMismatch,
    FrameTooLarge,
    PoolTooSmall,
    RuntimeClosed,
)
from asyncconn.transfer import Failure
from asyncconn.transfer.failures import classify


@pytest.mark.parametrize(
    ("exc", "reason"),
    [
        (BackendTimeout("slow"), Failure.TIMEOUT),
        (BackendUnavailable("down"), Failure.STORE_ERROR),
        (RuntimeClosed("closed"), Failure.STORE_ERROR),
        (FrameTooLarge("huge"), Failure.TOO_LARGE),
        (PoolTooSmall("huge"), Failure.TOO_LARGE),
        (FrameCorrupt("bad"), Failure.CORRUPT),
        (FrameMismatch("wrong dtype"), Failure.CORRUPT),
    ],
)
def test_known_exceptions_map_to_their_reason(exc: Exception, reason: Failure) -> None:
    got, detail = classify(exc)
    assert got is reason
    assert type(exc).__name__ in detail


def test_a_foreign_exception_is_a_logged_store_error(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR, logger="asyncconn.transfer.failures"):
        got, detail = classify(ValueError("a third-party backend bug"))
    assert got is Failure.STORE_ERROR and "ValueError" in detail
    assert "unexpected exception" in caplog.text
