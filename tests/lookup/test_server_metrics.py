"""The lookup server's opt-in Prometheus endpoint: real server, real lookups, scraped over HTTP.

Counters move with the lookups, every ``ServerStats`` field is a series, the endpoint serves only
``GET /metrics``, and after ``close`` nothing listens on the port and no thread is left behind.
"""

from __future__ import annotations

import contextlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from asyncconn.exceptions import ConfigError
from asyncconn.lookup import LookupServer, ServerStats, store_key
from asyncconn.lookup.exporter import COUNTERS, GAUGES, LATENCY, PREFIX
from asyncconn.lookup.protocol import encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.servers import free_port

HASHES = [bytes([i]) * 32 for i in range(4)]
DOCS = Path(__file__).resolve().parents[2] / "docs"
EXPORTED = {PREFIX + n + "_total" for n in COUNTERS} | {PREFIX + n for n in GAUGES} | {PREFIX + LATENCY[0]}


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="lookup-metrics-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


def _start(rt: Runtime, **kw: object) -> LookupServer:
    async def go() -> LookupServer:
        store = await TensorStore.open("memory://lookup-metrics")
        await store.backend.put([(store_key("kv/", h), b"v") for h in HASHES[:2]])
        server = LookupServer(store, "tcp://127.0.0.1:*", key_prefix="kv/", block_size=16, **kw)  # type: ignore[arg-type]
        try:
            await server.start()
        except BaseException:
            await store.close()
            raise
        return server

    return rt.run(go())


def _stop(rt: Runtime, server: LookupServer) -> None:
    async def go() -> None:
        await server.close()
        await server.store.close()

    rt.run(go(), timeout=10)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {
        sample.name + (f"{{le={sample.labels['le']}}}" if "le" in sample.labels else ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@contextlib.contextmanager
def _req(endpoint: str) -> Iterator[zmq.Socket[bytes]]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 5000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        yield sock
    finally:
        sock.close(0)
        ctx.term()


def _listening(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(2)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_every_server_counter_is_a_series() -> None:
    assert set(COUNTERS) | {"connections"} == {f.name for f in fields(ServerStats)}
    assert {source for source, _, _ in GAUGES.values()} == {"stats", "held"}
    assert all(name.startswith("asyncconn_lookup_") for name in (PREFIX + n for n in [*COUNTERS, *GAUGES]))


def test_the_operations_doc_names_every_series_and_no_other() -> None:
    named = set(re.findall(r"`(asyncconn_lookup_[a-z_]+)`", (DOCS / "operations.md").read_text()))
    assert named == EXPORTED


def test_the_counters_move_with_lookups_and_nothing_is_left_after_close(rt: Runtime) -> None:
    threads_before = set(threading.enumerate())
    port = free_port()
    server = _start(rt, metrics_port=port)
    try:
        assert server.metrics_url == f"http://127.0.0.1:{port}/metrics"
        first = _scrape(server.metrics_url)
        assert EXPORTED - {PREFIX + LATENCY[0]} <= set(first) and first[PREFIX + LATENCY[0] + "_count"] == 0
        assert first["asyncconn_lookup_requests_total"] == 0
        assert first["asyncconn_lookup_lookups_total"] == 0
        assert first["asyncconn_lookup_held_bytes"] == 0
        assert server.endpoint is not None
        with _req(server.endpoint) as sock:
            for _ in range(3):
                sock.send_multipart(encode_mooncake_lookup(64, HASHES))
                assert sock.recv() == b"\x00\x00\x00\x20"  # two leading blocks of 16 tokens
            sock.send_multipart([b"reset"])
            assert sock.recv() == b"\x00"  # refused, and counted
            sock.send_multipart([b"nonsense"])
            assert sock.recv() == b"\x00"  # malformed, and counted
            after = _scrape(server.metrics_url)
            assert after["asyncconn_lookup_requests_total"] == 5
            assert after["asyncconn_lookup_lookups_total"] == 3
            assert after["asyncconn_lookup_resets_total"] == 1
            assert after["asyncconn_lookup_errors_total"] == 1
            assert after["asyncconn_lookup_batches_total"] >= 4
            assert after["asyncconn_lookup_connections"] == 1
            assert after["asyncconn_lookup_connections_refused_total"] == 0
            assert after["asyncconn_lookup_running_batches"] == 0
            # Every request answered through a batch (the lookups, the reset, the malformed one) held for a
            # time: each in the histogram, cumulative up to +Inf.
            latency = {k: v for k, v in after.items() if k.startswith("asyncconn_lookup_latency_seconds")}
            assert latency["asyncconn_lookup_latency_seconds_count"] == 5
            assert latency["asyncconn_lookup_latency_seconds_bucket{le=+Inf}"] == 5
            assert 0 < latency["asyncconn_lookup_latency_seconds_sum"] < 5
            cumulative = [v for k, v in latency.items() if "_bucket" in k]
            assert cumulative == sorted(cumulative) and len(cumulative) == 16
        # Only GET/HEAD /metrics.
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(server.metrics_url.removesuffix("metrics") + "other", timeout=5)
        assert info.value.code == 404
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(urllib.request.Request(server.metrics_url, data=b"x"), timeout=5)
        assert info.value.code == 405
        # A client that connects and never sends a request does not hold up the close below.
        idle = socket.create_connection(("127.0.0.1", port), timeout=5)
    finally:
        started = time.monotonic()
        _stop(rt, server)
    assert time.monotonic() - started < 5
    assert server.metrics_url is None
    assert idle.recv(1) == b""  # cut off by close
    idle.close()
    assert not _listening(port)
    assert set(threading.enumerate()) <= threads_before


def test_metrics_are_off_by_default(rt: Runtime) -> None:
    server = _start(rt)
    try:
        assert server.metrics_url is None
    finally:
        _stop(rt, server)


def test_a_metrics_port_in_use_fails_start_and_releases_the_server(rt: Runtime) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match="cannot serve metrics"):
            _start(rt, metrics_port=port)


@pytest.mark.parametrize("port", [-1, 65536, True, 1.5])
def test_a_bad_metrics_port_is_refused_at_construction(port: object) -> None:
    with pytest.raises(ConfigError, match="metrics_port"):
        LookupServer(None, metrics_port=port)  # type: ignore[arg-type]


@pytest.mark.slow  # starts a Python subprocess: seconds
def test_the_cli_flag_serves_metrics_and_stops_cleanly() -> None:
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            "memory://cli-metrics",
            "--bind",
            "tcp://127.0.0.1:*",
            "--metrics-port",
            str(port),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        endpoint = proc.stdout.readline().split()[-1]
        metrics = proc.stdout.readline().strip()
        assert metrics == f"metrics on http://127.0.0.1:{port}/metrics"
        url = metrics.split()[-1]
        assert _scrape(url)["asyncconn_lookup_lookups_total"] == 0
        with _req(endpoint) as sock:
            sock.send_multipart(encode_mooncake_lookup(16, HASHES[:1]))
            assert sock.recv() == b"\x00\x00\x00\x00"
        assert _scrape(url)["asyncconn_lookup_lookups_total"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert not _listening(port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
