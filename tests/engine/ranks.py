"""Several workers of one engine (vLLM's multiprocess executor: tensor or pipeline parallel ranks): what each
holds and what its KV connector did, read through ``collective_rpc``. The scheduler runs in the test's
process; the workers do not."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from asyncconn_tools.engines import request_block_hashes, runner_kv_caches
from tests.engine.kvcase import generate


def block_hashes(llm: Any, prompt: Sequence[int]) -> list[Any]:
    """vLLM's hashes of the full blocks of ``prompt``, as the engine's scheduler computes them."""
    return request_block_hashes(llm.llm_engine.engine_core.engine_core, prompt)


def _cached_ids_by_group(llm: Any, prompt: Sequence[int]) -> list[list[int | None]]:
    """Per full block of ``prompt``: the cached block id in each KV cache group (None: not cached there)."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    groups = len(scheduler.kv_cache_config.kv_cache_groups)
    pool = scheduler.kv_cache_manager.block_pool
    out: list[list[int | None]] = []
    for block_hash in block_hashes(llm, prompt):
        row: list[int | None] = []
        for g in range(groups):
            found = pool.get_cached_block(block_hash, [g])
            row.append(None if not found else found[0].block_id)
        out.append(row)
    return out


def _rank_blocks(worker: Any, ids: list[list[int]]) -> dict[str, tuple[int, torch.Tensor]]:
    """In a worker process (``collective_rpc``): each of its layers' KV cache group (in this worker's own KV
    cache config: a pipeline stage names only its layers) and its KV at that group's block ids."""
    caches = runner_kv_caches(worker.model_runner)
    groups = worker.model_runner.kv_cache_config.kv_cache_groups
    return {
        name: (g, caches[name][ids[g]].clone())
        for g, group in enumerate(groups)
        for name in group.layer_names
        if name in caches
    }


def _rank_connector(worker: Any) -> dict[str, int]:
    """In a worker process: the KV connector's (tensor parallel) rank, the worker's pipeline stage, save and
    load totals, and what the connector still holds."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.distributed.parallel_state import get_pp_group

    side = get_kv_transfer_group().worker_side
    side.poll()
    caches = runner_kv_caches(worker.model_runner)
    return {
        "rank": side.rank,
        "stage": get_pp_group().rank_in_group,
        "windowed": int(side.windowed),
        "saved": side.saver.saved,
        "loaded": side.loader.loaded,
        "load_failures": sum(side.loader.failures.values()),
        "held": sum(side.held().values()),
        "null_written": int(any(bool(cache[0].any()) for cache in caches.values())),
    }


def settled(
    llm: Any, probe: Callable[[Any], dict[str, int]] | None = None, timeout: float = 60.0
) -> list[dict[str, int]]:
    """Step the engine until it holds no request (every worker reported its saves), then each worker's
    connector figures, in worker order: ``probe`` run in each worker (default :func:`_rank_connector`)."""
    import time

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    deadline = time.monotonic() + timeout
    while scheduler.requests or scheduler.has_requests():
        assert time.monotonic() < deadline, f"engine still holds {sorted(scheduler.requests)}"
        llm.llm_engine.step()
        time.sleep(0.002)
    ranks: list[dict[str, int]] = llm.collective_rpc(probe or _rank_connector)
    return ranks


def run_prompts(llm: Any, prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Generate each prompt alone; tokens, and per prompt which blocks of it each layer holds in the prefix
    cache (``held``: layer -> block indexes in the prompt; a window's group holds only some) with every
    worker's KV of its own layers at those blocks (``ranks``: per worker, layer -> one row per held block)."""
    tokens: list[list[int]] = []
    kv: list[dict[str, Any]] = []
    for prompt in prompts:
        tokens += generate(llm, [prompt])
        cached = _cached_ids_by_group(llm, prompt)
        held = [  # per group: the blocks (index in the prompt) cached in it, and their ids
            [(b, row[g]) for b, row in enumerate(cached) if row[g] is not None] for g in range(len(cached[0]))
        ]
        per_rank = llm.collective_rpc(_rank_blocks, args=([[i for _, i in group] for group in held],))
        kv.append(
            {
                "held": {n: [b for b, _ in held[g]] for rank in per_rank for n, (g, _) in rank.items()},
                "ranks": [{n: blocks for n, (_, blocks) in rank.items()} for rank in per_rank],
            }
        )
    return tokens, kv
