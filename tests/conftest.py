"""Shared fixtures. Real servers are started here on free loopback ports and always stopped."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest

from tests.servers import RedisServer

HAVE_REDIS = shutil.which("redis-server") is not None


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """One redis-server for the session (tests use distinct key prefixes or flush)."""
    if not HAVE_REDIS:
        pytest.fail("redis-server is not installed; the README's test command installs it")
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def fresh_redis() -> Iterator[RedisServer]:
    """A private redis-server for tests that pause, kill or restart it."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def runtime() -> Iterator[object]:
    """A private loop runtime, closed after the test."""
    from asyncconn.runtime import Runtime

    rt = Runtime(name="test-loop").start()
    try:
        yield rt
    finally:
        rt.close()
