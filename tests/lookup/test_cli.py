"""``asyncconn lookup-server`` and ``asyncconn bench lookup`` as a user runs them (real subprocesses)."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import zmq

from asyncconn.lookup.protocol import encode_mooncake_lookup
from tests.servers import RedisServer, free_port

ASYNCCONN = [sys.executable, "-m", "asyncconn"]  # the CLI as a user runs it


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_lookup_server_serves_and_stops_cleanly() -> None:
    proc = subprocess.Popen(
        [
            *ASYNCCONN,
            "lookup-server",
            "--backend",
            "memory://cli",
            "--bind",
            "tcp://127.0.0.1:*",
            "--block-size",
            "8",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("listening on tcp://127.0.0.1:")
        with _req(line.split()[-1]) as sock:
            sock.send_multipart(encode_mooncake_lookup(16, [b"a" * 32, b"b" * 32]))
            assert sock.recv() == b"\x00\x00\x00\x00"  # empty store: no hit
            sock.send_multipart([b"reset"])
            assert sock.recv() == b"\x00"  # no wipe: refused, never a false "ok"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        _reap(proc)


@contextlib.contextmanager
def _req(endpoint: str) -> Iterator[zmq.Socket]:
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


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_lookup_server_bad_backend_exits_2() -> None:
    done = subprocess.run(
        [*ASYNCCONN, "lookup-server", "--backend", "nosuch://x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "nosuch" in done.stderr


@pytest.mark.redis
def test_lookup_server_waits_for_a_store_that_comes_up_later() -> None:
    """``--wait-for-store``: started before its redis-server, it retries (one stderr line per try) and
    serves once the store is up, on the same address it was given."""
    redis = RedisServer()  # a port chosen now, the server started later
    proc = subprocess.Popen(
        [
            *ASYNCCONN,
            "lookup-server",
            "--backend",
            f"{redis.url}?timeout=1",
            "--bind",
            "tcp://127.0.0.1:*",
            "--wait-for-store",
            "60s",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stderr.readline()
        assert "unreachable" in line and "trying again" in line, line
        assert proc.poll() is None
        redis.start()
        line = proc.stdout.readline()
        assert line.startswith("listening on tcp://127.0.0.1:"), line
        with _req(line.split()[-1]) as sock:
            sock.send_multipart(encode_mooncake_lookup(16, [b"a" * 32]))
            assert sock.recv() == b"\x00\x00\x00\x00"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        _reap(proc)
        redis.stop()


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_lookup_server_gives_up_on_a_store_that_stays_down() -> None:
    started = time.monotonic()
    done = subprocess.run(
        [
            *ASYNCCONN,
            "lookup-server",
            "--backend",
            f"redis://127.0.0.1:{free_port()}/0?timeout=1",
            "--wait-for-store",
            "1s",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert time.monotonic() - started >= 1.0
    retries = [line for line in done.stderr.splitlines() if "trying again" in line]
    assert len(retries) >= 2, done.stderr  # 0.1s, 0.2s, 0.4s, ... until the second has passed
    assert "cannot open" in done.stderr.splitlines()[-1]


@pytest.mark.slow
def test_bench_lookup_json_smoke() -> None:
    done = subprocess.run(
        [
            *ASYNCCONN,
            "bench",
            "lookup",
            "--json",
            "--rounds",
            "2",
            "--steps",
            "3",
            "--blocking-steps",
            "1",
            "--waiting",
            "16",
            "--duration",
            "0.2",
            "--throughput-rounds",
            "1",
            "--outstanding",
            "200",
        ],
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["caller"]["submit"]["n"] == 32
    assert result["scheduler"]["async"]["admitted"] > 0
    assert result["throughput"]["pipelined_lookups_per_s"] > 0 and result["throughput"]["ratio"] > 0
    assert result["memory"]["counts_after_discard"] == {
        "entries": 0,
        "queued": 0,
        "inflight": 0,
        "transport": 0,
    }
