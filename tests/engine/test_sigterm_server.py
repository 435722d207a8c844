"""SIGTERM to vLLM's OpenAI server with the KV connector while requests stream: the server and everything
it started go away within a bound, and leave nothing behind.

What an operator does to stop or roll a server is send SIGTERM (systemd, Kubernetes, ``docker stop``). The
server runs in vLLM's default multiprocess shape (API server, engine core, CPU worker, multiprocessing's
resource tracker) with ``examples/vllm_kv_offload.json`` on a ``file://`` store and ``--shutdown-timeout``,
the drain mode docs/deployment.md recommends: vLLM finishes the requests in flight, then tears the engine
down, which is when the connector's own shutdown runs (with saves still pending). The test reads from
``/proc``, before the signal, every process of the server's tree, the TCP ports they listen on and the
``/dev/shm`` files they map, and checks afterwards that none is left. It does not read the connector's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.openai_server import OpenAIServer, alive, listening_ports, shm_entries

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
#: vLLM's drain window after SIGTERM (``--shutdown-timeout``): the streams below end well within it.
DRAIN_S = 30
#: The bound on the server's exit after SIGTERM: the drain, vLLM's 5 s grace for its worker to exit, its
#: 4 s after SIGTERMing the worker, and slack for a loaded 2-core CI box.
EXIT_BOUND_S = DRAIN_S + 25
STREAMS = 4
MAX_TOKENS = 128  # long enough that no stream can end before SIGTERM, short enough to drain


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


def test_sigterm_with_streams_in_flight_leaves_no_process_socket_or_shm(
    text_model: Path, tmp_path: Path
) -> None:
    config = json.loads((EXAMPLES / "vllm_kv_offload.json").read_text())
    config["kv_connector_extra_config"]["backend_url"] = f"file://{tmp_path / 'store'}?max_bytes=1GiB"
    server = OpenAIServer(
        model=text_model,
        log_path=tmp_path / "server.log",
        kv_transfer_config=config,
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        extra_args=["--shutdown-timeout", str(DRAIN_S)],
    )
    tree: set[int] = set()
    try:
        server.start(timeout=240)
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
        assert len(tree) >= 3, f"expected the API server, its engine core and a worker: {tree}"
        assert server.port in ports

        signalled = time.monotonic()
        server.signal(signal.SIGTERM)
        assert server.proc is not None
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
    finally:
        server.stop(timeout=5)
        for pid in tree:  # never leave a server process to the next test, whatever failed above
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
