"""vLLM's own multi-tier offloading manager (``TieringOffloadingSpec`` -> ``TieringOffloadingManager`` with
its CPU primary tier), built in-process with asyncconn's tier as its one secondary tier, loaded the way an
operator's config loads it (``type`` + ``module_path`` through vLLM's ``SecondaryTierFactory``).

The primary tier's host memory is vLLM's real shared mmap; what the GPU worker would copy into it is
written here by hand (the worker needs CUDA), so a chunk's bytes are known and can be compared after a
round trip through the store. Every wait is a bounded poll of vLLM's own step calls.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from asyncconn.vllm.tier import AsyncConnTier

ROW = 4096  # bytes of one chunk (one block of one worker): a page, so no padding
_engines = itertools.count()


def offloading_config(tier: dict[str, Any], *, num_chunks: int, model: str = "tiny") -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("layer.0",), group_id=0),),
        worker_kv_bytes_per_block=ROW,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": num_chunks * ROW, "secondary_tiers": [tier]},
        engine_id=f"asyncconn-tier-test-{os.getpid()}-{next(_engines)}",
        model=OffloadingModelConfig(name=model, dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def tier_entry(url: str, **keys: Any) -> dict[str, Any]:
    """An operator's ``secondary_tiers`` entry for asyncconn's tier."""
    return {"type": "AsyncConnTier", "module_path": "asyncconn.vllm.tier", "backend_url": url, **keys}


def keys_of(tag: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(f"{tag}-{i}".encode().ljust(32, b"."), 0) for i in range(n)]


class Tiered:
    """One TieringOffloadingManager with asyncconn's tier, and the moves of vLLM's scheduler around it."""

    def __init__(self, url: str, *, num_chunks: int = 4, model: str = "tiny", **tier_keys: Any) -> None:
        self.spec = TieringOffloadingSpec(
            offloading_config(tier_entry(url, **tier_keys), num_chunks=num_chunks, model=model)
        )
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager = manager
        (tier,) = manager.secondary_tiers
        assert isinstance(tier, AsyncConnTier)
        self.tier = tier
        self._requests = itertools.count()
        self._closed = False

    # -- the GPU side's part, by hand --------------------------------------------------------------------
    def _write_rows(self, chunk_ids: Sequence[int], payloads: Sequence[bytes]) -> None:
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            for chunk, payload in zip(chunk_ids, payloads, strict=True):
                flat[int(chunk) * ROW : (int(chunk) + 1) * ROW] = payload

    def _read_rows(self, chunk_ids: Sequence[int]) -> list[bytes]:
        with self.manager.primary_tier.get_kv_memoryview().cast("B") as flat:
            return [bytes(flat[int(c) * ROW : (int(c) + 1) * ROW]) for c in chunk_ids]

    def request(self) -> ReqContext:
        ctx = ReqContext(req_id=f"req-{next(self._requests)}")
        self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: ReqContext) -> None:
        self.manager.on_request_finished(ctx)

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def offload(self, keys: Sequence[OffloadKey], payloads: Sequence[bytes]) -> None:
        """A request's chunks stored GPU -> primary (written by hand) and cascaded to the tier."""
        ctx = self.request()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None and list(out.keys_to_store) == list(keys), "primary refused the chunks"
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        self._write_rows(out.store_spec.chunk_ids, payloads)
        self.manager.complete_store(keys, ctx, True)
        self.finish(ctx)

    def settle(self, within: float = 20.0) -> None:
        """Step until no transfer or presence check is outstanding (fails rather than hangs)."""
        deadline = time.monotonic() + within
        while self.manager.has_pending_work() or self.tier.has_pending_work():
            assert time.monotonic() < deadline, f"still pending after {within}s: {self.tier.pending()}"
            self.step()
            time.sleep(0.005)
        self.step()

    def lookup(self, ctx: ReqContext, keys: Sequence[OffloadKey], within: float = 20.0) -> list[LookupResult]:
        """Each key's answer once it is final (HIT or MISS), stepping as vLLM's scheduler does.

        Also returns the answers seen on the way, per key, as ``self.seen``.
        """
        self.seen: dict[OffloadKey, list[LookupResult]] = {k: [] for k in keys}
        deadline = time.monotonic() + within
        final: dict[OffloadKey, LookupResult] = {}
        while len(final) < len(keys):
            assert time.monotonic() < deadline, f"no final answer after {within}s: {self.seen}"
            for key in keys:
                if key in final:
                    continue
                result = self.manager.lookup(key, ctx)
                self.seen[key].append(result)
                if result in (LookupResult.HIT, LookupResult.MISS):
                    final[key] = result
            self.step()
            time.sleep(0.005)
        return [final[k] for k in keys]

    def load(self, ctx: ReqContext, keys: Sequence[OffloadKey]) -> list[bytes]:
        """What the GPU would load for ``keys`` (all HIT): the primary rows vLLM hands the worker."""
        spec = self.manager.prepare_load(keys, ctx)
        assert isinstance(spec, CPULoadStoreSpec)
        rows = self._read_rows(spec.chunk_ids)
        self.manager.complete_load(keys, ctx)
        return rows

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.manager.shutdown()
