"""vLLM's OpenAI server, started with ``examples/vllm_kv_offload.json``, in vLLM's default multiprocess mode
with two tensor-parallel CPU workers, driven over HTTP. One server start serves both tests, in this order:

1. The connector's figures read from ``/metrics``. Local prefix caching is off, so a prompt seen before can
   only be served from the store: the second pass of the same prompts must report external hits (vLLM's
   counter and ours) and give the same greedy text. The example config runs here with a host tier
   (``host_cache_bytes``): vLLM's hits by source must count tokens under ``host`` -- the two workers'
   tiers reported to the scheduler across processes -- and no more than both tiers served. With vLLM's KV
   events on, a router replaying the publisher sees every value in the store and in both workers' tiers.
2. SIGTERM while requests stream: the server and everything it started go away within a bound, and leave
   nothing behind. What an operator does to stop or roll a server is send SIGTERM (systemd, Kubernetes,
   ``docker stop``). The server runs with ``--shutdown-timeout``, the drain mode docs/deployment.md
   recommends: vLLM finishes the requests in flight, then tears the engine down, which is when the
   connector's own shutdown runs (with saves still pending). The test reads from ``/proc``, before the
   signal, every process of the server's tree (API server, engine core, both workers, multiprocessing's
   resource tracker), the TCP ports they listen on and the ``/dev/shm`` files they map, and checks
   afterwards that none is left. It does not read the connector's log.

The server's start (four Python processes importing vLLM) is most of what these tests cost, hence one start
for both: the SIGTERM test ends the server, so it runs last.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.openai_server import OpenAIServer, alive, listening_ports, shm_entries
from tests.engine import routers
from tests.engine.kvcase import PROMPTS
from tests.servers import RedisServer

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: vLLM's drain window after SIGTERM (``--shutdown-timeout``): the streams below end well within it.
DRAIN_S = 30
#: The bound on the server's exit after SIGTERM: the drain, vLLM's 5 s grace for its workers to exit, its
#: 4 s after SIGTERMing them, and slack for a loaded 2-core CI box.
EXIT_BOUND_S = DRAIN_S + 25
STREAMS = 4
MAX_TOKENS = 128  # long enough that no stream can end before SIGTERM, short enough to drain


def _config(redis_server: RedisServer) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((EXAMPLES / "vllm_kv_offload.json").read_text())
    config["kv_connector_extra_config"]["backend_url"] = redis_server.url
    config["kv_connector_extra_config"]["key_prefix"] = "kv-server:"
    config["kv_connector_extra_config"]["host_cache_bytes"] = "64MiB"
    return config


@pytest.fixture(scope="module")
def kv_events() -> tuple[list[str], int]:
    """vLLM's KV events on the server (ZMQ, free ports): its arguments and the replay port."""
    return routers.events_flag()


@pytest.fixture(scope="module")
def server(
    text_model: Path,
    redis_server: RedisServer,
    tmp_path_factory: pytest.TempPathFactory,
    kv_events: tuple[list[str], int],
) -> Iterator[OpenAIServer]:
    """The example config's server, two TP workers, prefix caching off, KV events on, drain mode on
    SIGTERM."""
    server = OpenAIServer(
        model=text_model,
        log_path=tmp_path_factory.mktemp("openai-server") / "server.log",
        kv_transfer_config=_config(redis_server),
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        extra_args=[
            "--tensor-parallel-size",
            "2",
            "--no-enable-prefix-caching",
            "--shutdown-timeout",
            str(DRAIN_S),
            *kv_events[0],
        ],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    with server.running(start_timeout=240, stop_timeout=30):
        yield server


def _post(base: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def test_openai_server_with_the_example_config_two_workers_and_metrics(
    server: OpenAIServer, text_model: Path, redis_server: RedisServer, kv_events: tuple[list[str], int]
) -> None:
    assert server.proc is not None and server.proc.poll() is None, server.log_tail()
    base = server.base_url
    body = {"model": str(text_model), "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    first = [
        c["text"] for c in sorted(_post(base, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    ]
    before = server.metrics()
    sources_before = server.metrics_by("vllm:prompt_tokens_cached_by_source_total", "source")
    second = [
        c["text"] for c in sorted(_post(base, "/v1/completions", body)["choices"], key=lambda c: c["index"])
    ]
    after = server.metrics()
    sources = server.metrics_by("vllm:prompt_tokens_cached_by_source_total", "source")
    assert second == first
    per_value = 32 * _config(redis_server)["kv_connector_extra_config"].get("kv_blocks_per_value", 1)
    full = len(PROMPTS) * (len(PROMPTS[0]) // per_value) * per_value
    assert full > 0
    external = (
        after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
    )
    assert external == full, "the second pass was not served from the store"
    assert after["asyncconn:kv_tokens_loaded_total"] > before.get("asyncconn:kv_tokens_loaded_total", 0)
    assert after["asyncconn:kv_saves_total"] > 0
    assert after.get("asyncconn:kv_save_failures_total", 0) == 0
    # The latency histograms: the second pass's lookups and loads were observed, the first pass's saves.
    for name in ("lookup_latency", "load_latency"):
        series = f"asyncconn:kv_{name}_seconds_count"
        assert after.get(series, 0) > before.get(series, 0), series
    assert after.get("asyncconn:kv_save_latency_seconds_count", 0) > 0
    # By source: the tiers' share as ``host`` (both ranks' tiers held the value when the load was planned),
    # the rest under the store's. A value counted as host is never read from the store: the tiers passed
    # on to the store (misses) at most the reads of the values counted under the store's source, 2 ranks.
    gained = {k: v - sources_before.get(k, 0.0) for k, v in sources.items() if v - sources_before.get(k, 0.0)}
    host = gained.pop("host", 0.0)
    assert host > 0, f"no hit counted as host: {gained}"
    assert set(gained) <= {"external_unspecified"} and host + sum(gained.values()) == full
    misses = after.get("asyncconn:kv_host_misses_total", 0) - before.get("asyncconn:kv_host_misses_total", 0)
    assert misses <= sum(gained.values()) // per_value * 2
    assert after["asyncconn:kv_host_hits_total"] > before.get("asyncconn:kv_host_hits_total", 0)
    # What a router sees: every full value of the prompts in the store, and -- the tiers hold 64 MiB, far
    # more than these prompts -- in both workers' tiers, published from their reports across processes,
    # each with its 32 tokens of a prompt.
    batches = routers.replayed_batches(kv_events[1])
    held = routers.residency(batches)
    store, host = held.get(("CPU", "asyncconn:redis"), set()), held.get(("CPU", "asyncconn:host"), set())
    ends = [(p, end) for p in PROMPTS for end in range(per_value, len(p) + 1, per_value)]
    assert len(store) == len({tuple(p[:end]) for p, end in ends}) and host == store  # a value is its prefix
    tier_events = [
        e
        for b in batches
        for e in b.events
        if getattr(e, "ownership", None) == "asyncconn:host" and hasattr(e, "token_ids")
    ]
    assert {tuple(e.token_ids) for e in tier_events} == {tuple(p[end - per_value : end]) for p, end in ends}


def _stream(base: str, model: str, prompt: list[int], first: threading.Event, out: dict[str, Any]) -> None:
    """One streamed completion; ``out`` gets the chunks received and whether ``[DONE]`` arrived."""
    body = {
        "model": model,
        "prompt": [prompt],
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    request = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    out.update(chunks=0, done=False, error=None)
    try:
        with urllib.request.urlopen(request, timeout=EXIT_BOUND_S + 30) as reply:
            for line in reply:
                if line.startswith(b"data: [DONE]"):
                    out["done"] = True
                elif line.startswith(b"data:"):
                    out["chunks"] += 1
                    first.set()
    except Exception as exc:  # whatever the client saw is part of the report
        out["error"] = repr(exc)[:300]
    finally:
        first.set()


@pytest.mark.slow
def test_sigterm_with_streams_in_flight_leaves_no_process_socket_or_shm(
    server: OpenAIServer, text_model: Path
) -> None:
    assert server.proc is not None and server.proc.poll() is None, server.log_tail()
    streams: list[dict[str, Any]] = [{} for _ in range(STREAMS)]
    started = [threading.Event() for _ in range(STREAMS)]
    threads = [
        threading.Thread(
            target=_stream,
            args=(server.base_url, str(text_model), list(range(5 + i, 1005 + i)), started[i], streams[i]),
            daemon=True,
        )
        for i in range(STREAMS)
    ]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(120), "no stream started"
    assert all(s.get("error") is None and not s.get("done") for s in streams), streams

    tree = server.tree()
    ports = listening_ports(tree)
    shm = shm_entries(tree)
    assert len(tree) >= 4, f"expected the API server, its engine core and two workers: {tree}"
    assert server.port in ports

    signalled = time.monotonic()
    server.signal(signal.SIGTERM)
    try:
        code = server.proc.wait(EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the server did not exit {EXIT_BOUND_S}s after SIGTERM:\n{server.log_tail()}")
    took = time.monotonic() - signalled
    print(f"the server exited {took:.1f}s after SIGTERM (code {code})")
    for thread in threads:
        thread.join(30)

    # Within the drain window every stream in flight ran to its end.
    assert all(s["done"] and s["error"] is None for s in streams), (streams, server.log_tail())
    assert code == 0, server.log_tail()

    # The tree's other processes (resource tracker included) follow their parent within seconds.
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {pid for pid in tree if alive(pid)}
    assert not left, f"processes left {took:.1f}s after SIGTERM: {sorted(left)}"
    assert not listening_ports() & ports, "a port the server listened on is still listening"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
        pass
    deadline = time.monotonic() + 10  # multiprocessing's resource tracker unlinks what it tracked
    while any(os.path.exists(p) for p in shm) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in shm if os.path.exists(p)], "shared memory left in /dev/shm"
