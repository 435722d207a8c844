"""vLLM's OpenAI server with two data-parallel engines (``--data-parallel-size 2``), the example config over
``redis://`` with a host tier, driven over HTTP.

Under data parallelism a dense model's ranks are independent engines, each in its own process with its own
scheduler, worker and connector (vLLM appends ``_dp<rank>`` to the connector's ``engine_id``); the store is
what they share. Requests are sent to one rank or the other with vLLM's ``X-data-parallel-rank`` header;
vLLM's prefix caching is off, so a prompt seen before can only come from the store or a tier, and the
metrics are read per engine (``engine`` label):

1. rank 0 computes the prompts and saves them; rank 1 has loaded nothing yet;
2. rank 1 serves the same prompts from the store: every full value's tokens are external hits of rank 1,
   the first ones counted under the store's source (its tier is empty), and the text is rank 0's;
3. rank 1 again: now its own tier holds them (the loads filled it), so every one counts as ``host``. vLLM's
   CPU platform runs even one worker in a process of its own under ``vllm serve``: the tier is followed by
   its reports (:mod:`asyncconn.vllm.kv.tiernews`), not by claims in the scheduler's process.
It would fail if the ranks' keys differed (step 2 computes), if rank 1's tier were not counted (step 3), or if
the connector did not start inside a DP engine.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.openai_server import OpenAIServer
from tests.engine.kvcase import PROMPTS
from tests.servers import RedisServer

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SOURCES = "vllm:prompt_tokens_cached_by_source_total"


def _config(redis_server: RedisServer) -> dict[str, Any]:
    config: dict[str, Any] = json.loads((EXAMPLES / "vllm_kv_offload.json").read_text())
    extra = config["kv_connector_extra_config"]
    extra.update(backend_url=redis_server.url, key_prefix="kv-dp-server:", host_cache_bytes="64MiB")
    return config


@pytest.fixture(scope="module")
def server(
    text_model: Path, redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[OpenAIServer]:
    server = OpenAIServer(
        model=text_model,
        log_path=tmp_path_factory.mktemp("openai-dp-server") / "server.log",
        kv_transfer_config=_config(redis_server),
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
        extra_args=["--data-parallel-size", "2", "--no-enable-prefix-caching"],
        env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    )
    with server.running(start_timeout=240, stop_timeout=30):
        yield server


def _complete(server: OpenAIServer, rank: int) -> list[str]:
    body = {"model": str(server.model), "prompt": PROMPTS, "max_tokens": 8, "temperature": 0}
    request = urllib.request.Request(
        server.base_url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "X-data-parallel-rank": str(rank)},
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        choices = json.loads(reply.read())["choices"]
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]


def _engine(server: OpenAIServer, name: str, rank: int) -> float:
    return server.metrics_by(name, "engine").get(str(rank), 0.0)


def _sources(server: OpenAIServer, rank: int) -> dict[str, float]:
    by_source = server.metrics_by(SOURCES, "source", where={"engine": str(rank)})
    return {k: v for k, v in by_source.items() if v and k != "device"}


def test_two_data_parallel_engines_share_the_store_and_keep_their_own_tiers(
    server: OpenAIServer, redis_server: RedisServer
) -> None:
    assert server.proc is not None and server.proc.poll() is None, server.log_tail()
    per_value = 32 * _config(redis_server)["kv_connector_extra_config"]["kv_blocks_per_value"]
    full = len(PROMPTS) * (len(PROMPTS[0]) // per_value) * per_value
    hits = "vllm:external_prefix_cache_hits_total"

    computed = _complete(server, 0)
    assert _engine(server, "asyncconn:kv_saves_total", 0) > 0
    assert _engine(server, hits, 1) == 0 and _sources(server, 1) == {}

    assert _complete(server, 1) == computed
    assert _engine(server, hits, 1) == full, "rank 1 did not load what rank 0 saved"
    first = _sources(server, 1)
    # Its own tier held nothing: the first values came from redis. The prompts share a prefix (and vLLM's
    # prefix cache is off): a later request may find values an earlier one's load put in the tier.
    assert set(first) <= {"external_unspecified", "host"} and sum(first.values()) == full
    assert first.get("external_unspecified", 0) > 0
    assert _engine(server, "asyncconn:kv_load_failures_total", 1) == 0

    assert _complete(server, 1) == computed
    assert _engine(server, hits, 1) == 2 * full
    second = {k: v - first.get(k, 0) for k, v in _sources(server, 1).items() if v - first.get(k, 0)}
    assert second == {"host": full}, "rank 1's tier did not serve (or was not counted)"
    assert _engine(server, "asyncconn:kv_host_hits_total", 1) > 0
