"""The chaos run: both connectors on vLLM's real scheduler, a real redis-server and lookup server, faults.

The first test is the claim (every invariant holds under every kind of fault, nothing leaks); the others
show the harness can fail: a connector that writes wrong KV, and one that leaks a thread, are caught.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

import pytest
import torch

from asyncconn.cli.main import main
from asyncconn_tools.chaos import ChaosConfig, run_chaos
from asyncconn_tools.chaos.faults import DATA_FAULTS, SERVER_FAULTS

# vLLM's real scheduler (the offline engine), a real redis-server and lookup server.
pytestmark = [pytest.mark.vllm, pytest.mark.redis, pytest.mark.interface]  # the simulator: no model runner


def test_every_invariant_holds_under_every_kind_of_fault() -> None:
    report = run_chaos(ChaosConfig(duration=25.0, seed=11, fault_interval=0.6))
    assert report.violations == []
    assert report.leaks == []
    assert set(report.faults_injected) == set(SERVER_FAULTS + DATA_FAULTS), report.faults_injected
    assert report.faults_healed == {k: v for k, v in report.faults_injected.items() if k in SERVER_FAULTS}
    assert report.values_damaged > 0
    assert report.requests >= 100 and report.finished["length"] >= 50
    assert report.finished["abort"] > 0 and sum(report.aborted_at.values()) == report.finished["abort"]
    assert report.embedding_rows_checked > 0 and report.kv_requests_loaded > 0 and report.kv_checks > 0
    assert report.max_step_ms < 1000.0  # the step bound the report would have listed as a violation


def test_wrong_kv_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: every loaded KV value is off by one. The harness must report it, not pass."""
    from asyncconn.vllm.kv.layout import CacheLayout

    scatter = CacheLayout.scatter

    def off_by_one(self: Any, value: torch.Tensor, ref: Any) -> None:
        scatter(self, value + 1, ref)

    monkeypatch.setattr(CacheLayout, "scatter", off_by_one)
    report = run_chaos(ChaosConfig(duration=6.0, seed=3, faults=()))
    assert report.kv_requests_loaded > 0
    assert any("KV of" in v for v in report.violations), report.violations[:3]
    assert not report.ok


def test_a_leaked_thread_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sabotage: the E connector starts a thread it never stops. The end-of-run census must see it."""
    from asyncconn.vllm.ec import connector as ec_connector

    stop = threading.Event()
    original = ec_connector.AsyncConnECConnector.__init__

    def leaky(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        threading.Thread(target=stop.wait, name="leaked-by-test", daemon=True).start()

    monkeypatch.setattr(ec_connector.AsyncConnECConnector, "__init__", leaky)
    try:
        report = run_chaos(ChaosConfig(duration=2.0, seed=4, faults=()))
    finally:
        stop.set()
    assert any("leaked-by-test" in leak for leak in report.leaks), report.leaks
    assert report.violations == []


def test_cli_prints_the_report_and_exits_by_it(capsys: pytest.CaptureFixture[str]) -> None:
    levels = {n: logging.getLogger(n).level for n in ("asyncconn", "backends", "vllm")}
    assert (
        main(
            [
                "chaos",
                "--duration",
                "3",
                "--faults",
                "corrupt,redis_pause",
                "--fault-interval",
                "0.5",
                "--json",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["requests"] > 0 and data["leaks"] == []
    assert main(["chaos", "--faults", "meteor_strike"]) == 2
    # It quiets the library's loggers while it runs and puts them back (later tests capture their records).
    assert {n: logging.getLogger(n).level for n in levels} == levels


def test_a_lookup_server_that_exits_is_restarted_like_a_supervisor_would() -> None:
    """The lookup server exits when the store is unreachable as it starts (a restart overlapping a
    ``redis_kill``); the injector restarts it -- never during a ``lookup_kill`` window, at most once a
    second -- so the run does not end waiting for a server that is gone."""
    import random
    import time

    from asyncconn_tools.chaos.faults import FaultInjector, _Active

    class FakeLookup:
        def __init__(self) -> None:
            self.proc: object | None = object()
            self.alive = False  # it has exited
            self.starts = 0

        def start(self, *, wait: bool = True) -> None:
            self.starts += 1

        def wait_ready(self) -> None:
            pass

    lookup = FakeLookup()
    injector = FaultInjector(
        rng=random.Random(1),
        runtime=None,  # type: ignore[arg-type]
        backend=None,  # type: ignore[arg-type]
        redis_server=None,
        lookup_server=lookup,  # type: ignore[arg-type]
        keys=list,
        interval=1e9,
        kinds=(),
    )
    now = time.monotonic()
    injector._active = _Active("lookup_kill", now + 100)
    injector.tick(now)
    assert lookup.starts == 0  # killed on purpose: it comes back when the fault ends
    injector._active = None
    injector.tick(now)
    injector.tick(now + 0.5)
    assert lookup.starts == 1 and injector.lookup_restarts == 1  # once, then not before a second has passed
    injector.tick(now + 1.5)
    assert lookup.starts == 2
    injector.heal_all()  # the drain phase: restarted at once, whatever the pace
    assert lookup.starts == 3


@pytest.mark.redis
def test_heal_all_closes_the_control_connection_of_slow_bursts(fresh_redis: Any) -> None:
    """The ``CLIENT PAUSE`` bursts use a control connection of the injector's own; the drain phase closes
    it (a restart of the lookup server must not, and must not be needed for it)."""
    import random

    import redis

    from asyncconn_tools.chaos.faults import FaultInjector

    injector = FaultInjector(
        rng=random.Random(1),
        runtime=None,  # type: ignore[arg-type]
        backend=None,  # type: ignore[arg-type]
        redis_server=fresh_redis,
        lookup_server=None,
        keys=list,
        interval=1e9,
        kinds=(),
    )
    injector._slow_burst()
    control = injector._control
    assert control is not None
    probe = redis.Redis(host="127.0.0.1", port=fresh_redis.port)
    try:
        assert int(probe.info("clients")["connected_clients"]) == 2  # the probe and the control connection
        injector.heal_all()
        assert injector._control is None
        assert int(probe.info("clients")["connected_clients"]) == 1
    finally:
        probe.close()
