"""``asyncconn demo``: the EC part end to end (its checks must pass), the exit codes, and the bench."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.cli.main import main
from asyncconn_tools.cli import demo


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_demo_runs_e_and_pd_and_every_check_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--parts", "ec-sim,kv-sim", "--json"]) == 0
    ec, kv = json.loads(capsys.readouterr().out)
    for summary in (ec, kv):
        assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert kv["figures"]["wave 2 tokens loaded from the store"] > 0
    figures = ec["figures"]
    assert figures["items encoded on E"] == figures["distinct images"]
    assert figures["PD prefetch hits (admitted after prefetch)"] >= 1
    assert figures["bytes loaded by PD (all workers)"] > 0


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_demo_on_a_real_mooncake_store(capsys: pytest.CaptureFixture[str], mooncake_master: Any) -> None:
    """Both connectors, unchanged, on a real ``mooncake_master``: every check of the demo passes."""
    url = mooncake_master.url(
        segment="64MiB", buffer="32MiB", timeout="5s", prefix=f"demo-{uuid.uuid4().hex[:8]}/"
    )
    assert main(["demo", "--parts", "ec-sim,kv-sim", "--backend", url, "--json"]) == 0
    ec, kv = json.loads(capsys.readouterr().out)
    for summary in (ec, kv):
        assert summary["checks"] and all(summary["checks"].values()), summary["checks"]
    assert kv["figures"]["wave 2 tokens loaded from the store"] > 0
    assert ec["figures"]["PD prefetch hits (admitted after prefetch)"] >= 1


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_demo_on_a_given_backend_prints_a_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["demo", "--parts", "ec-sim", "--backend", f"file://{tmp_path / 'store'}"]) == 0
    out = capsys.readouterr().out
    assert "[PASS] PD's encoder ran for a stored image only on a stalled engine's release" in out
    assert "[FAIL]" not in out


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_a_failed_check_exits_1(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(demo.PARTS, "broken", f"{__name__}:_broken_part")
    assert main(["demo", "--parts", "broken"]) == 1
    assert "[FAIL] always fails" in capsys.readouterr().out


def _broken_part(backend_url: str, workdir: Path) -> dict[str, Any]:
    return {"title": "broken", "figures": {}, "checks": {"always fails": False}}


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--parts", "nope"]) == 2
    assert main(["demo", "--backend", "nosuchscheme://x"]) == 2
    assert "nosuchscheme" in capsys.readouterr().err


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_bench_measures_calls_and_steps(tmp_path: Path) -> None:
    from asyncconn_tools.bench.ec_sim import run_ec_bench

    summary = run_ec_bench(f"file://{tmp_path / 'store'}", tmp_path, rounds=1)
    figures = summary["figures"]
    assert figures["ensure_cache_available calls"] > 0 and figures["has_cache_item calls"] > 0
    assert "nan" not in figures["install step (+1824-token prefill): schedule() / runner p50 (us)"]


@pytest.mark.interface  # the simulator parts only: also run on vLLM 0.33 (scripts/lane-vllm033.sh)
def test_unnamed_memory_store_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--backend", "memory://"]) == 2
    assert "memory://demo" in capsys.readouterr().err
