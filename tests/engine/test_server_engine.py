"""vLLM's OpenAI server, started with ``examples/vllm_kv_offload.json``, in vLLM's default multiprocess mode
with two tensor-parallel CPU workers, driven over HTTP; the connector's figures read from ``/metrics``.

Local prefix caching is off, so a prompt seen before can only be served from the store: the second pass of
the same prompts must report external hits (vLLM's counter and ours) and give the same greedy text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.engine.kvcase import PROMPTS
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _post(base: str, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, value = line.rsplit(" ", 1)
        name = series.split("{", 1)[0]
        out[name] = out.get(name, 0.0) + float(value)
    return out


def test_openai_server_with_the_example_config_two_workers_and_metrics(
    text_model: Path, redis_server: RedisServer, tmp_path: Path
) -> None:
    config = json.loads((EXAMPLES / "vllm_kv_offload.json").read_text())
    config["kv_connector_extra_config"]["backend_url"] = redis_server.url
    config["kv_connector_extra_config"]["key_prefix"] = "kv-server:"
    port = free_port()
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: the engine core in its own process
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(text_model), "--port", str(port), "--dtype", "float32", "--block-size", "32",
        "--max-model-len", "1024", "--kv-cache-memory-bytes", str(64 << 20), "--enforce-eager",
        "--tensor-parallel-size", "2", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(config),
    ]  # fmt: skip
    log = (tmp_path / "server.log").open("wb")
    server = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "the server did not come up"
                time.sleep(1)
        model = str(text_model)
        body = {"model": model, "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
        first = [
            c["text"]
            for c in sorted(_post(base, "/v1/completions", body)["choices"], key=lambda c: c["index"])
        ]
        before = _metrics(base)
        second = [
            c["text"]
            for c in sorted(_post(base, "/v1/completions", body)["choices"], key=lambda c: c["index"])
        ]
        after = _metrics(base)
        assert second == first
        per_value = 32 * config["kv_connector_extra_config"].get("kv_blocks_per_value", 1)
        full = len(PROMPTS) * (len(PROMPTS[0]) // per_value) * per_value
        assert full > 0
        external = (
            after["vllm:external_prefix_cache_hits_total"] - before["vllm:external_prefix_cache_hits_total"]
        )
        assert external == full, "the second pass was not served from the store"
        assert after["asyncconn:kv_tokens_loaded_total"] > before.get("asyncconn:kv_tokens_loaded_total", 0)
        assert after["asyncconn:kv_saves_total"] > 0
        assert after.get("asyncconn:kv_save_failures_total", 0) == 0
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
