"""``asyncconn demo`` (the main job): every part in vLLM's real engine, every check passing."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from asyncconn.cli.main import main

pytestmark = pytest.mark.vllm


def test_the_demo_runs_real_engines_and_every_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    ec, kv, hybrid = json.loads(capsys.readouterr().out)
    for summary in (ec, kv, hybrid):
        assert summary["checks"] and all(summary["checks"].values()), (summary["checks"], summary["figures"])
    # The demo's checks tie every PD encode to a stalled engine's release; most images were loaded.
    assert ec["figures"]["embeddings loaded by PD"] > ec["figures"]["images encoded on PD"]
    assert kv["figures"]["tokens vLLM counted as loaded (external prefix cache hits)"] > 0
    assert hybrid["figures"]["tokens vLLM counted as loaded (external prefix cache hits)"] > 0


def test_the_demo_refuses_a_store_engines_cannot_share(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "memory://"]) == 2
    assert "memory://demo" in capsys.readouterr().err


def test_the_demo_on_a_real_mooncake_store_keeps_what_each_engine_saved(
    capsys: pytest.CaptureFixture[str], mooncake_master: Any
) -> None:
    """Mooncake keeps values in the memory segments of live clients, and the demo's engines close one after
    another: the demo's own client holds the memory for the run (the engines join with ``segment=0``).
    Without it engine 2 loaded nothing -- engine 1's segment left with it -- and a check failed."""
    url = mooncake_master.url(
        segment="128MiB", buffer="32MiB", timeout="5s", prefix=f"demo-{uuid.uuid4().hex[:8]}/"
    )
    # The EC part only: the KV connector on a real Mooncake store, one engine after another, is
    # tests/engine/test_kv_engine.py's [mooncake] case; EC on Mooncake in the real engine is only here.
    assert main(["demo", "--backend", url, "--parts", "ec", "--json"]) == 0  # the store, not the model
    (ec,) = json.loads(capsys.readouterr().out)
    assert ec["checks"] and all(ec["checks"].values()), (ec["checks"], ec["figures"])
    # A prefetch can still be in flight when the released request has finished, and PD then releases the
    # next one too (the demo's checks count each release): more than half loaded, not all but one.
    assert ec["figures"]["embeddings loaded by PD"] > ec["figures"]["images encoded on PD"]
