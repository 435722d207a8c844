"""``asyncconn demo`` (the main job): both parts in vLLM's real engine, every check passing."""

from __future__ import annotations

import json

import pytest

from asyncconn.cli.main import main

pytestmark = pytest.mark.vllm


def test_the_demo_runs_real_engines_and_every_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json"]) == 0
    ec, kv = json.loads(capsys.readouterr().out)
    for summary in (ec, kv):
        assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert ec["figures"]["embeddings loaded by PD"] >= ec["figures"]["images"] - 1
    assert kv["figures"]["tokens vLLM counted as loaded (external prefix cache hits)"] > 0


def test_the_demo_refuses_a_store_engines_cannot_share(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "memory://"]) == 2
    assert "memory://demo" in capsys.readouterr().err
