"""Loads that progress without vLLM's thread: a healthy store never times out a load in vLLM's real engine,
however long the engine's steps are.

A serving engine runs long steps (a large prefill chunk beside the loads: tens of seconds on a busy small
host). Loads queued behind others (``max_inflight_loads``) used to start only from the worker's next poll,
i.e. the next step, so a long prompt could outlive ``load_timeout`` on a healthy store and be recomputed.
Here every step's forward is lengthened (a sleep after the tiny model's forward stands in for a large
prefill of a real model), a long prompt prefills chunk by chunk beside the loads, and only one store call
may run at a time: every value must still land, with no load error.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from asyncconn_tools.engines import BLOCK_SIZE, Probe, kv_config, make_llm
from tests.engine.kvcase import FULL_BLOCKS, PROMPTS, assert_idle, assert_same_kv, sampling, save_prompts
from tests.servers import RedisServer

pytestmark = pytest.mark.vllm

STEP_S = 0.12  # each forward's extra length: load_timeout is passed after three steps
LOAD_TIMEOUT_S = 0.3


def test_loads_beside_long_steps_do_not_time_out_on_a_healthy_store(
    text_model: Path,
    engines: list[Any],
    kv_reference: dict[str, Any],
    fresh_redis: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    save_prompts(text_model, fresh_redis.url)
    llm = make_llm(
        text_model,
        kv=kv_config(backend_url=fresh_redis.url, max_inflight_loads=1, load_timeout=f"{LOAD_TIMEOUT_S}s"),
        max_num_batched_tokens=64,
    )
    engines.append(llm)
    probe = Probe(llm)
    worker = probe.kv_worker_connector().worker_side
    forward = probe.runner._model_forward
    steps = 0

    def long_forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal steps
        out = forward(*args, **kwargs)
        steps += 1
        time.sleep(STEP_S)
        return out

    monkeypatch.setattr(probe.runner, "_model_forward", long_forward)
    errors: list[set[int]] = []
    report = worker.get_block_ids_with_load_errors

    def recorded() -> set[int]:
        failed = report()
        if failed:
            errors.append(failed)
        return failed

    monkeypatch.setattr(worker, "get_block_ids_with_load_errors", recorded)

    engine = llm.llm_engine
    big = [7 + (i * 37) % 900 for i in range(1200)]  # shares no block with PROMPTS; 64 tokens a step
    engine.add_request("big", {"prompt_token_ids": big}, sampling(4))
    engine.step()
    t0 = time.monotonic()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt}, sampling())
    tokens: dict[str, list[int]] = {}
    first_token: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.outputs[0].token_ids and out.request_id not in first_token:
                first_token[out.request_id] = time.monotonic() - t0
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)

    assert errors == [], f"load errors on a healthy store: {errors}"
    assert not worker.loader.failures, worker.loader.failures
    # The loads really ran beside long steps and took longer than load_timeout from submission.
    assert max(first_token[f"p{i}"] for i in range(len(PROMPTS))) > LOAD_TIMEOUT_S
    assert steps > 10
    for i, prompt in enumerate(PROMPTS):
        assert tokens[f"p{i}"] == kv_reference["tokens"][i]
        assert_same_kv(probe.prompt_kv(prompt), kv_reference["kv"][i])
    assert worker.loader.loaded >= FULL_BLOCKS  # every value of at least one whole prompt came from the store
    assert probe.metrics()["vllm:external_prefix_cache_hits"] >= FULL_BLOCKS * BLOCK_SIZE
    assert_idle(probe)
