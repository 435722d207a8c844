"""vLLM's real engine (its CPU build here, the CUDA build on a GPU) with asyncconn's connectors.

Engines run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one at a time, on tiny random-weight
models built at test time (cached: :func:`asyncconn_tools.tiny_models.build_model`). The first engine of a
session costs ~15 s (imports, model inspection), later ones a few seconds.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.engines import engine_env

engine_env()

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="session")
def text_model() -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model("text")


@pytest.fixture(scope="session")
def vision_model() -> Path:
    from asyncconn_tools.tiny_models import build_model

    return build_model("vision")


def shared_prefix_prompts(n: int = 4, prefix: int = 96, suffix: int = 100, seed: int = 1) -> list[list[int]]:
    """``n`` prompts sharing a ``prefix``-token start, each with its own suffix (token ids < 1000)."""
    rng = random.Random(seed)
    head = [rng.randrange(5, 1000) for _ in range(prefix)]
    return [head + [rng.randrange(5, 1000) for _ in range(suffix)] for _ in range(n)]


@pytest.fixture(scope="session")
def kv_reference(text_model: Path) -> Iterator[dict[str, Any]]:
    """Tokens and per-block KV of :data:`kvcase.PROMPTS` from an engine without a connector."""
    from asyncconn_tools.engines import Probe, close_llm, make_llm
    from tests.engine.kvcase import FULL_BLOCKS, PROMPTS, generate

    llm = make_llm(text_model)
    try:
        tokens = generate(llm, PROMPTS)
        probe = Probe(llm)
        kv = [probe.prompt_kv(p) for p in PROMPTS]
        assert all(len(blocks) == FULL_BLOCKS for blocks in kv)
        yield {"tokens": tokens, "kv": kv}
    finally:
        close_llm(llm)


@pytest.fixture
def engines() -> Iterator[list[Any]]:
    """A list the test appends its LLMs to; every one still open is closed afterwards."""
    from asyncconn_tools.engines import close_llm

    opened: list[Any] = []
    try:
        yield opened
    finally:
        for llm in opened:
            close_llm(llm)
