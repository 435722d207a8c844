"""Shared fixtures. Real servers are started here on free loopback ports and always stopped."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

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


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[object]:
    """One 3-master Redis Cluster for the session (tests use distinct key prefixes)."""
    from tests.servers_distributed import RedisCluster

    if not (HAVE_REDIS and shutil.which("redis-cli")):
        pytest.fail("redis-server/redis-cli are not installed; the README's test command installs them")
    cluster = RedisCluster().start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def mooncake_master() -> Iterator[object]:
    """One mooncake_master (with its HTTP metadata server) for the session.

    A missing extra fails the test rather than skipping it: the README's test command installs it, and a
    skipped real-server test proves nothing.
    """
    master = _start_mooncake_master()
    try:
        yield master
    finally:
        master.stop()


@pytest.fixture
def private_master() -> Iterator[object]:
    """A mooncake_master of the test's own, for tests that freeze, kill or restart it (thawed and stopped
    afterwards, whatever the test did). A missing extra fails, as for the session master."""
    master = _start_mooncake_master()
    try:
        yield master
    finally:
        master.resume()
        master.stop()


def _start_mooncake_master() -> Any:
    import mooncake.store  # noqa: F401

    from tests.servers_distributed import MooncakeMaster, find_mooncake_master

    if find_mooncake_master() is None:
        pytest.fail("mooncake_master is not installed (pip install 'asyncconn[mooncake]')")
    return MooncakeMaster().start()
