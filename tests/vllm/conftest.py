"""Fixtures for tests that drive vLLM's real scheduler through :mod:`asyncconn.vllm.sim`.

vLLM reads its environment at import time, so the two variables are set when this conftest is imported,
before any test module imports vLLM; the import itself (~8 s) happens once per session.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


@pytest.fixture(scope="session")
def vllm_scheduler_module() -> Any:
    """vLLM's scheduler module, imported once per session (the README's test command installs vLLM)."""
    import vllm.v1.core.sched.scheduler as module

    return module


@pytest.fixture(scope="session")
def sim_model_dir(tmp_path_factory: pytest.TempPathFactory, vllm_scheduler_module: Any) -> Path:
    """One weightless model directory for the whole session."""
    from asyncconn.vllm.sim import make_model_dir

    return make_model_dir(tmp_path_factory.mktemp("sim-model"))


@pytest.fixture
def make_sim(sim_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """Factory for :class:`EngineSim` instances; every one is closed at teardown, whatever the test did."""
    from asyncconn.vllm.sim import EngineSim

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
