from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.servers import RedisServer, free_port


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncconn", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_check_ok_on_file_store(tmp_path: Path) -> None:
    r = _cli("check", f"file://{tmp_path}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("\n") == 1 and ": ok " in r.stdout and "get=" in r.stdout


@pytest.mark.parametrize(
    ("url", "expect"),
    [
        ("nosuch://x", "no storage backend for scheme 'nosuch'"),
        ("not a url", "not a store URL"),
        ("memory://?latency=bogus", "'latency'"),
    ],
)
@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_check_bad_input_exits_2_with_one_line(url: str, expect: str) -> None:
    r = _cli("check", url)
    assert r.returncode == 2
    assert expect in r.stdout and r.stdout.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_check_hung_store_exits_2_within_timeout() -> None:
    t = time.monotonic()
    r = _cli("check", "memory://?latency=60s", "--timeout", "1")
    assert r.returncode == 2 and "FAILED" in r.stdout
    assert time.monotonic() - t < 20  # bounded: not the store's 60 s


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_check_unreachable_redis_exits_2_and_hides_password() -> None:
    r = _cli("check", f"redis://:hunter2@127.0.0.1:{free_port()}/0", "--timeout", "2")
    assert r.returncode == 2 and "FAILED" in r.stdout
    assert "hunter2" not in r.stdout + r.stderr


def test_check_paused_redis_exits_2_within_timeout(fresh_redis: RedisServer) -> None:
    fresh_redis.pause()
    try:
        t = time.monotonic()
        r = _cli("check", fresh_redis.url, "--timeout", "1")
        assert r.returncode == 2
        assert time.monotonic() - t < 20
    finally:
        fresh_redis.resume()
    assert _cli("check", fresh_redis.url).returncode == 0


@pytest.mark.slow
@pytest.mark.parametrize("url", ["memory://", None])
def test_bench_backend_json(url: str | None) -> None:
    args = ["bench", "backend", "--sizes", "64KiB,1MiB", "--iterations", "4", "--json"]
    if url:
        args += ["--url", url]
    r = _cli(*args)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert [e["size"] for e in result["sizes"]] == [65536, 1 << 20]
    assert all(e["verified"] for e in result["sizes"])
    for e in result["sizes"]:
        assert e["put"]["gbps"] > 0 and e["get"]["latency"]["n"] == 4
    if url is None:
        assert result["scheme"] == "file" and "file_vs_plain_read" in result["sizes"][0]
    else:
        assert "memory_roundtrip" in result


@pytest.mark.slow
def test_bench_align_json(tmp_path: Path) -> None:
    r = _cli(
        "bench", "align", "--values", "4", "--size", "8KiB", "--ranks", "2,6", "--rounds", "1",
        "--dir", str(tmp_path), "--json",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    assert result["size"] == 8192 and [row["distance"] for row in result["copy"]][:2] == [0, 8]
    assert result["copy"][0]["slowdown"] == 1.0
    rows = {row["rank"]: row for row in result["ranks"]}
    assert (rows[2]["v1_header"], rows[2]["v2_header"], rows[6]["v1_header"], rows[6]["v2_header"]) == (
        40, 64, 72, 128
    )  # fmt: skip
    assert rows[2]["store"]["gbps"] > 0 and rows[6]["page_offset_0"]["v2_ms"] > 0
    assert list(tmp_path.iterdir()) == []  # its files are gone
    assert _cli("bench", "align", "--ranks", "17").returncode == 2


def test_bench_backend_redis_reports_vs_redis_benchmark(redis_server: RedisServer) -> None:
    r = _cli(
        "bench",
        "backend",
        "--url",
        redis_server.url,
        "--sizes",
        "1MiB",
        "--iterations",
        "8",
        "--clients",
        "2",
        "--json",
    )
    assert r.returncode == 0, r.stderr
    entry = json.loads(r.stdout)["sizes"][0]
    assert entry["verified"]
    assert entry["vs_redis_benchmark"]["get"] > 0 and entry["vs_redis_benchmark"]["put"] > 0


@pytest.mark.slow  # starts Python subprocesses: seconds each
def test_help_lists_commands() -> None:
    r = _cli("--help")
    assert r.returncode == 0 and "check" in r.stdout and "bench" in r.stdout
