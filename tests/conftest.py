"""Shared fixtures. Real servers are started here on free loopback ports and always stopped.

The offline engine's fixtures (``make_sim``) are here too, for tests/vllm, tests/sim and tests/tools. vLLM
reads its environment at import time, so the two variables are set when this conftest is imported, before
any test module imports vLLM; the import itself (~8 s) happens once per session, and only for tests that
ask for it.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.servers import RedisServer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

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


@pytest.fixture
def unwatched_directories(monkeypatch: pytest.MonkeyPatch) -> None:
    """``file://`` stores that cannot watch their directories (``FileBackend.watch_removals`` answers False),
    as where a change is made on another host of a network filesystem: a file a test deletes or writes
    behind the stores' backs is then heard only by a recheck or a lookup."""
    from asyncconn_backends.file import FileBackend

    monkeypatch.setattr(FileBackend, "watch_removals", lambda self: False)


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


@pytest.fixture(scope="session")
def vllm_scheduler_module() -> Any:
    """vLLM's scheduler module, imported once per session (the README's test command installs vLLM)."""
    import vllm.v1.core.sched.scheduler as module

    return module


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory, vllm_scheduler_module: Any) -> Path:
    """One weightless model directory for the whole session."""
    from asyncconn_tools.sim.engine import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("sim-model"))


@pytest.fixture
def make_sim(sim_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """Factory for :class:`EngineSim` instances; every one is closed at teardown, whatever the test did."""
    from asyncconn_tools.sim.engine import EngineSim

    sims: list[EngineSim] = []

    def factory(**kwargs: Any) -> EngineSim:
        sim = EngineSim(sim_model_dir, **kwargs)
        sims.append(sim)
        return sim

    try:
        yield factory
    finally:
        for sim in sims:
            sim.close()


# Fixtures that mean a test needs a server or vLLM: such tests get the marker automatically, so
# `pytest -m "not redis and not mooncake and not vllm"` runs the quick subset with no server installed.
_MARKER_OF_FIXTURE = {
    "redis_server": "redis",
    "fresh_redis": "redis",
    "redis_cluster": "redis",
    "private_cluster": "redis",  # tests/backends/test_redis_cluster.py
    "password_server": "redis",  # tests/backends/test_redis.py
    "protected": "redis",  # tests/test_secrets.py
    "secret_redis": "redis",  # tests/test_security.py
    "mooncake_master": "mooncake",
    "private_master": "mooncake",
    "vllm_scheduler_module": "vllm",
    "sim_model_dir": "vllm",
    "make_sim": "vllm",
}


_IMPORTS_VLLM = re.compile(r"^(import vllm|from vllm[ .])", re.MULTILINE)


@functools.cache
def _imports_vllm(path: Path) -> bool:
    """A test module that imports vLLM at module level (to subclass its connector bases) is vLLM's whole."""
    return path.suffix == ".py" and bool(_IMPORTS_VLLM.search(path.read_text()))


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # Deselecting vllm must not import it: such modules are not even collected then.
    if "not vllm" in (config.option.markexpr or "") and _imports_vllm(collection_path):
        return True
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    long_ok = os.environ.get("ASYNCCONN_LONG_TESTS") == "1"
    for item in items:
        if not long_ok and item.get_closest_marker("long") is not None:
            item.add_marker(pytest.mark.skip(reason="minutes long: ASYNCCONN_LONG_TESTS=1 runs it"))
        if _imports_vllm(item.path):
            item.add_marker(pytest.mark.vllm)
        for fixture in getattr(item, "fixturenames", ()):
            marker = _MARKER_OF_FIXTURE.get(fixture)
            if marker is not None:
                item.add_marker(getattr(pytest.mark, marker))
