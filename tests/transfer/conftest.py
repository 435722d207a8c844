"""Fixtures for the transfer tests: a private runtime (from tests/conftest.py) and stores on it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from asyncconn_backends.memory import MemoryBackend

from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.transfer.fakes import GatedBackend


@pytest.fixture
def store(runtime: Runtime) -> Iterator[TensorStore]:
    """A private memory store used on the test's runtime loop."""
    st = TensorStore(MemoryBackend(), timeout=5.0, name="memory://")
    yield st
    runtime.run(st.close(), timeout=5)


@pytest.fixture
def gated(runtime: Runtime) -> Iterator[GatedBackend]:
    """A gated fake store; the gate is opened at teardown so nothing is left waiting."""
    backend = GatedBackend()
    yield backend
    runtime.call_soon(backend.gate.set)


@pytest.fixture
def gated_store(gated: GatedBackend) -> TensorStore:
    return TensorStore(gated, timeout=5.0, name="gated")
