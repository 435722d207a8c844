"""The KV connector in vLLM's real engine: a fresh engine loads another's shared prefixes, byte for byte.

Equal greedy tokens are not proof (KV scaled by 1.001 keeps them), so every test also compares the KV bytes
of each loaded block with the blocks a connector-less reference engine computed, and counts the tokens vLLM
itself says came from the connector (``vllm:external_prefix_cache_hits``).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.demo.keeper import kept_store
from asyncconn_tools.engines import BLOCK_SIZE, Probe, close_llm, kv_config, make_llm
from tests.engine.kvcase import (
    FULL_BLOCKS,
    PROMPTS,
    assert_idle,
    assert_same_kv,
    generate,
    record_forwards,
    sampling,
    save_prompts,
)
from tests.servers import LookupServerProcess, RedisServer
from tests.servers_distributed import MooncakeMaster

pytestmark = pytest.mark.vllm


def run_pair(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], **extra: Any
) -> tuple[Probe, dict[str, float]]:
    """Engine 1 computes and saves; a fresh engine 2 loads. Returns engine 2's probe and metrics."""
    first = make_llm(text_model, kv=kv_config(**extra))
    engines.append(first)
    assert generate(first, PROMPTS) == kv_reference["tokens"]
    probe1 = Probe(first)
    assert_idle(probe1)
    saver = probe1.kv_worker_connector().worker_side.saver
    assert saver.saved > 0 and not saver.failures
    close_llm(first)
    engines.remove(first)

    second = make_llm(text_model, kv=kv_config(**extra))
    engines.append(second)
    assert generate(second, PROMPTS) == kv_reference["tokens"]
    probe = Probe(second)
    assert_idle(probe)
    return probe, probe.metrics()


@pytest.fixture(
    params=[
        "file",
        "file-4-blocks-per-value",
        "file-sync-loads",
        "redis",
        "lookup-server",
        pytest.param("mooncake", marks=pytest.mark.mooncake),
        pytest.param("mooncake-sync-loads", marks=pytest.mark.mooncake),
    ]
)
def store_config(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict[str, Any]]:
    prefix = f"kv-engine-{request.param}:"
    if request.param.startswith("mooncake"):
        # Engine 1 closes before engine 2 starts, and Mooncake keeps values in live clients' segments: one
        # client holds the memory for the test and the engines join without a segment (as the demo does).
        master: MooncakeMaster = request.getfixturevalue("mooncake_master")
        url = master.url(
            segment="128MiB", buffer="32MiB", timeout="5s", prefix=f"{prefix}{uuid.uuid4().hex[:8]}/"
        )
        with kept_store(url) as engines_url:
            yield {"backend_url": engines_url, "kv_sync_loads": request.param.endswith("sync-loads")}
        return
    redis_server: RedisServer = request.getfixturevalue("redis_server")
    if request.param == "file":
        yield {"backend_url": f"file://{tmp_path / 'store'}"}
    elif request.param == "file-4-blocks-per-value":  # 4 of the 6 full blocks stored, the tail computed
        yield {"backend_url": f"file://{tmp_path / 'store'}", "kv_blocks_per_value": 4}
    elif request.param == "file-sync-loads":  # loaded in the step that schedules the request
        yield {"backend_url": f"file://{tmp_path / 'store'}", "kv_sync_loads": True}
    elif request.param == "redis":
        yield {"backend_url": redis_server.url, "key_prefix": prefix}
    else:
        server = LookupServerProcess(redis_server.url, key_prefix=prefix, block_size=BLOCK_SIZE).start()
        try:
            yield {"backend_url": redis_server.url, "key_prefix": prefix, "lookup_server": server.endpoint}
        finally:
            server.stop()


def test_a_fresh_engine_loads_the_shared_prefixes_byte_for_byte(
    text_model: Path, engines: list[Any], kv_reference: dict[str, Any], store_config: dict[str, Any]
) -> None:
    probe, metrics = run_pair(text_model, engines, kv_reference, **store_config)
    bpv = probe.kv_worker_connector().worker_side.keys.blocks_per_value
    assert bpv == store_config.get("kv_blocks_per_value", 1)
    stored = FULL_BLOCKS // bpv * bpv * BLOCK_SIZE  # whole values only: the tail blocks are computed
    # Every stored block came from the store or from blocks this engine had just loaded for another prompt.
    external, local = metrics["vllm:external_prefix_cache_hits"], metrics["vllm:prefix_cache_hits"]
    assert external + local == len(PROMPTS) * stored
    assert external >= stored > 0
    for prompt, want in zip(PROMPTS, kv_reference["kv"], strict=True):
        assert_same_kv(probe.prompt_kv(prompt), want)
    # A CPU engine reads values straight into their cache blocks from file:// when the page cache holds them
    # (a value it would have to wait for goes through staging) and from redis:// (its reads can be
    # abandoned); Mooncake lends the memory to its transfer engine, so its loads go through staging.
    loader = probe.kv_worker_connector().worker_side.loader
    assert loader.loaded > 0
    if store_config["backend_url"].startswith("mooncake"):
        assert loader.totals()["loaded_in_place"] == 0
    elif store_config["backend_url"].startswith("file"):
        assert loader.totals()["loaded_in_place"] > 0
    else:
        assert loader.totals()["loaded_in_place"] == loader.loaded
    # Run again, every prompt is in vLLM's own prefix cache (loaded from the store, or computed and saved by
    # this engine): nothing is saved again, not even as far as the store's "exists" check.
    saver = probe.kv_worker_connector().worker_side.saver
    before = (saver.saved, saver.skipped, saver.skipped_existing)
    assert generate(probe.llm, PROMPTS) == kv_reference["tokens"]
    assert_idle(probe)
    assert (saver.saved, saver.skipped, saver.skipped_existing) == before


def test_loads_start_before_the_forward_of_the_step_that_plans_them(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.32 calls ``start_load_kv`` for asynchronous loads after the forward, and a CPU forward has run
    to its end by then: the connector issues a step's loads when vLLM binds its metadata, so they run beside
    that step's forward (here another request's decode) instead of a step later -- and still land byte for
    byte."""
    url = f"file://{tmp_path / 'store'}"
    save_prompts(text_model, url)
    second = make_llm(text_model, kv=kv_config(backend_url=url))
    engines.append(second)
    probe = Probe(second)
    worker = probe.kv_worker_connector().worker_side
    events: list[str] = []
    issue = worker.issue_loads

    def issue_loads(meta: Any) -> None:
        if meta.loads and meta is not worker._issued:
            events.append("issue")
        issue(meta)

    monkeypatch.setattr(worker, "issue_loads", issue_loads)
    record_forwards(probe, events, monkeypatch)
    engine = second.llm_engine
    busy = [7 + (i * 37) % 900 for i in range(40)]  # shares no block with PROMPTS
    engine.add_request("busy", {"prompt_token_ids": busy}, sampling(64))
    for _ in range(3):
        engine.step()
    engine.add_request("loaded", {"prompt_token_ids": PROMPTS[0]}, sampling(8))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        events.append("step")
        tokens.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step() if o.finished})
    assert events.count("issue") == 1, events
    at = events.index("issue")
    assert events[at - 1 : at + 2] == ["step", "issue", "forward"], (
        events
    )  # inside the step, before its forward
    assert tokens["loaded"] == kv_reference["tokens"][0]
    assert probe.metrics()["vllm:external_prefix_cache_hits"] == FULL_BLOCKS * BLOCK_SIZE
    assert_same_kv(probe.prompt_kv(PROMPTS[0]), kv_reference["kv"][0])
    assert_idle(probe)


def test_sync_loads_land_before_the_forward_of_the_step_that_schedules_the_request(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kv_sync_loads``: vLLM schedules the request on top of its hit at once (it never waits in
    ``WAITING_FOR_REMOTE_KVS``), and every value is in its blocks before that step's forward reads them --
    the one step that loads is the step whose forward computes the prompt's tail."""
    from vllm.v1.request import RequestStatus

    url = f"file://{tmp_path / 'store'}"
    save_prompts(text_model, url)
    second = make_llm(text_model, kv=kv_config(backend_url=url, kv_sync_loads=True))
    engines.append(second)
    probe = Probe(second)
    worker = probe.kv_worker_connector().worker_side
    events: list[str] = []
    settle = worker._settle_sync_loads

    def settled() -> None:
        settle()
        events.append("loaded" if not worker.held()["req_loads"] else "not loaded")

    monkeypatch.setattr(worker, "_settle_sync_loads", settled)
    record_forwards(probe, events, monkeypatch)
    engine = second.llm_engine
    engine.add_request("loaded", {"prompt_token_ids": PROMPTS[0]}, sampling(8))
    scheduler = engine.engine_core.engine_core.scheduler
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        events.append("step")
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids) if out.finished else tokens
        for request in scheduler.requests.values():
            assert request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
    assert events.count("loaded") == 1, events
    at = events.index("loaded")
    assert events[at - 1 : at + 2] == ["step", "loaded", "forward"], events
    assert tokens == kv_reference["tokens"][0]
    assert probe.metrics()["vllm:external_prefix_cache_hits"] == FULL_BLOCKS * BLOCK_SIZE
    assert_same_kv(probe.prompt_kv(PROMPTS[0]), kv_reference["kv"][0])
    assert_idle(probe)
