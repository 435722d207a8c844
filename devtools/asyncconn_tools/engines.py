"""vLLM's real engine, in process, with asyncconn's connectors: what the demo, tests and benchmarks run.

``make_llm`` builds a ``vllm.LLM`` on one of the tiny models (:mod:`asyncconn_tools.tiny_models`) with the
settings vLLM's CPU build needs (block size a multiple of 32, a bounded KV cache, eager mode), and
:class:`Probe` reaches into a live in-process engine for the checks a connector has to pass: the KV bytes of
a prompt's cached blocks, the connectors' resource counts, and how often the vision encoder ran. The engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): an engine is built in a few seconds after
the first, and everything in it can be inspected. One engine at a time: :func:`close_llm` before the next.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "BLOCK_SIZE",
    "Probe",
    "close_llm",
    "config_from_json",
    "ec_config",
    "ec_params",
    "engine_env",
    "forward_ec_params",
    "kv_config",
    "make_llm",
    "request_block_hashes",
    "runner_kv_caches",
    "token_ids",
]

#: vLLM's CPU attention wants block sizes that are multiples of 32.
BLOCK_SIZE = 32


def engine_env() -> None:
    """The environment an in-process CPU engine needs; set before vLLM is imported."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE") == "":  # vLLM's CPU platform crashes on an empty value
        del os.environ["VLLM_CPU_KVCACHE_SPACE"]


def kv_config(role: str = "kv_both", **extra: Any) -> Any:
    """vLLM's ``KVTransferConfig`` for ``AsyncConnKVConnector`` (``extra`` is its ``extra_config``)."""
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="AsyncConnKVConnector",
        kv_connector_module_path="asyncconn.vllm",
        kv_role=role,
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=dict(extra),
    )


def ec_config(role: str, **extra: Any) -> Any:
    """vLLM's ``ECTransferConfig`` for ``AsyncConnECConnector``."""
    from vllm.config import ECTransferConfig

    return ECTransferConfig(
        ec_connector="AsyncConnECConnector",
        ec_connector_module_path="asyncconn.vllm",
        ec_role=role,
        ec_connector_extra_config=dict(extra),
    )


def config_from_json(text: str, **extra: Any) -> Any:
    """vLLM's ``ECTransferConfig`` or ``KVTransferConfig`` from the JSON an operator passes to ``vllm serve``
    (e.g. ``examples/vllm_ec_consumer.json``), with ``extra`` overriding keys of its ``extra_config``."""
    from vllm.config import ECTransferConfig, KVTransferConfig

    data = json.loads(text)
    if "ec_connector" in data:
        data["ec_connector_extra_config"] = {**data.get("ec_connector_extra_config", {}), **extra}
        return ECTransferConfig(**data)
    data["kv_connector_extra_config"] = {**data.get("kv_connector_extra_config", {}), **extra}
    return KVTransferConfig(**data)


def make_llm(
    model: Path | str,
    *,
    kv: Any = None,
    ec: Any = None,
    kv_cache_bytes: int = 64 << 20,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    max_num_batched_tokens: int | None = None,
    **overrides: Any,
) -> Any:
    """An in-process ``vllm.LLM`` on ``model`` with the given connector configs (None: no connector)."""
    engine_env()
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": max_model_len,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_num_seqs": max_num_seqs,
        "disable_log_stats": False,
        "seed": 0,
    }
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if kv is not None:
        kwargs["kv_transfer_config"] = kv
    if ec is not None:
        kwargs["ec_transfer_config"] = ec
    if "Blip2" in (Path(model) / "config.json").read_text():
        kwargs["limit_mm_per_prompt"] = {"image": 1}
    kwargs.update(overrides)
    # vLLM's engine start runs full collections (its model loader, then freeze_gc_heap, which freezes the
    # heap once the engine is up). Freezing first keeps them off what was already there (torch, vLLM, a
    # test session's modules), which they can only traverse: the engine's shutdown unfreezes everything,
    # so what this freezes is collectable again once the engine is closed.
    gc.freeze()
    return LLM(**kwargs)


def close_llm(llm: Any) -> None:
    """Shut an in-process engine down (its connectors close with it) and let its memory go."""
    with contextlib.suppress(AttributeError):
        llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def runner_kv_caches(runner: Any) -> dict[str, torch.Tensor]:
    """Layer name -> that layer's paged KV tensor, of a model runner (this process's, or a worker's in a
    ``collective_rpc`` function)."""
    out: dict[str, torch.Tensor] = {}
    for name, layer in runner.compilation_config.static_forward_context.items():
        cache = getattr(layer, "kv_cache", None)
        if isinstance(cache, list | tuple):
            cache = cache[0] if cache else None
        if isinstance(cache, torch.Tensor) and cache.numel():
            out[name] = cache
    return out


def request_block_hashes(core: Any, prompt: Sequence[int]) -> list[Any]:
    """vLLM's hashes of the full blocks of ``prompt``, as engine core ``core``'s scheduler computes them (it
    runs in this process also when the workers do not)."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    request = Request(
        "probe", list(prompt), SamplingParams(max_tokens=1), None, block_hasher=core.request_block_hasher
    )
    return list(request.block_hashes)


class Probe:
    """Read-only views into a live in-process engine, for checks a connector has to pass."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.core = llm.llm_engine.engine_core.engine_core
        self.scheduler = self.core.scheduler
        self.worker = self.core.model_executor.driver_worker.worker
        self.runner = self.worker.model_runner

    # -- KV ------------------------------------------------------------------------------------------
    def kv_caches(self) -> dict[str, torch.Tensor]:
        """Layer name -> that layer's paged KV tensor (CPU layout: ``[blocks, kv_heads, block, 2*head]``)."""
        return runner_kv_caches(self.runner)

    def block_hashes(self, prompt: Sequence[int]) -> list[Any]:
        """vLLM's hashes of the full blocks of ``prompt``, as this engine computes them."""
        return request_block_hashes(self.core, prompt)

    def cached_block_ids(self, prompt: Sequence[int]) -> list[int | None]:
        """The block id holding each full block of ``prompt`` in the prefix cache (None: not cached)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        ids: list[int | None] = []
        for block_hash in self.block_hashes(prompt):
            found = pool.get_cached_block(block_hash, [0])
            ids.append(None if not found else found[0].block_id)
        return ids

    def prompt_kv(self, prompt: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """A copy of every layer's KV of each cached full block of ``prompt`` (prefix, stops at a gap)."""
        caches = self.kv_caches()
        blocks: list[dict[str, torch.Tensor]] = []
        for block_id in self.cached_block_ids(prompt):
            if block_id is None:
                break
            blocks.append({name: cache[block_id].clone() for name, cache in caches.items()})
        return blocks

    def kv_groups(self) -> list[tuple[str, list[str]]]:
        """(spec kind, layer names) of each KV cache group, in group order (one group without the hybrid
        manager; one per attention kind and layer slice with it)."""
        config = self.scheduler.kv_cache_config
        return [(type(g.kv_cache_spec).__name__, list(g.layer_names)) for g in config.kv_cache_groups]

    def prompt_kv_by_group(self, prompt: Sequence[int]) -> list[dict[str, torch.Tensor | None]]:
        """Per full block of ``prompt``: every layer's KV of that block as cached in the layer's group, or
        None where that group holds no cached block for it (a sliding-window group outside its window)."""
        pool = self.scheduler.kv_cache_manager.block_pool
        caches = self.kv_caches()
        groups = self.kv_groups()
        blocks: list[dict[str, torch.Tensor | None]] = []
        for block_hash in self.block_hashes(prompt):
            row: dict[str, torch.Tensor | None] = {}
            for g, (_, layers) in enumerate(groups):
                found = pool.get_cached_block(block_hash, [g])
                for name in layers:
                    row[name] = None if not found else caches[name][found[0].block_id].clone()
            blocks.append(row)
        return blocks

    def settle(self, timeout: float = 30.0) -> None:
        """Step the engine until it holds no request (saves that delay block frees included)."""
        import time

        deadline = time.monotonic() + timeout
        while self.scheduler.requests or self.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine still holds {sorted(self.scheduler.requests)} after {timeout}s")
            self.llm.llm_engine.step()
            time.sleep(0.002)

    def ec_saves_done(self, timeout: float = 30.0) -> None:
        """Wait until E's worker has seen every embedding save end (an idle engine runs no worker hook)."""
        import time

        connector = self.ec_worker_connector()
        if connector is None:
            return
        worker = connector.worker_side
        deadline = time.monotonic() + timeout
        while True:
            worker.end_step()
            if not worker.has_pending_saves():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"EC saves still pending after {timeout}s")
            time.sleep(0.005)

    def free_blocks(self) -> tuple[int, int]:
        """(free, total) KV blocks of the engine's pool: equal when nothing is held."""
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.get_num_free_blocks(), pool.num_gpu_blocks - 1  # block 0 is vLLM's null block

    # -- connectors ----------------------------------------------------------------------------------
    def kv_scheduler_connector(self) -> Any:
        return getattr(self.scheduler, "connector", None)

    def ec_scheduler_connector(self) -> Any:
        return getattr(self.scheduler, "ec_connector", None)

    def kv_worker_connector(self) -> Any:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        return get_kv_transfer_group() if has_kv_transfer_group() else None

    def ec_worker_connector(self) -> Any:
        from vllm.distributed.ec_transfer import get_ec_transfer, has_ec_transfer

        return get_ec_transfer() if has_ec_transfer() else None

    # -- metrics -------------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        """vLLM's counters and gauges by name (summed over label sets)."""
        out: dict[str, float] = {}
        for metric in self.llm.get_metrics():
            value = getattr(metric, "value", None)
            if isinstance(value, int | float):
                out[metric.name] = out.get(metric.name, 0) + value
        return out

    @contextlib.contextmanager
    def encoder_outputs(self) -> Iterator[list[torch.Tensor]]:
        """Record a copy of every embedding the vision encoder produces while the block runs.

        Why: "the encoder did not run for a stored item" must be a count that a regression changes, and
        "the store holds what E computed" a byte comparison against what the encoder really returned.
        """
        model = self.runner.get_model()
        seen: list[torch.Tensor] = []
        original = model.embed_multimodal

        def recorded(**kwargs: Any) -> Any:
            out = original(**kwargs)
            seen.extend(t.detach().clone() for t in out)
            return out

        model.embed_multimodal = recorded
        try:
            yield seen
        finally:
            del model.embed_multimodal


def token_ids(outputs: Sequence[Any]) -> list[list[int]]:
    """The generated token ids of each of ``vllm.LLM.generate``'s outputs."""
    return [list(out.outputs[0].token_ids) for out in outputs]


def ec_params(outputs: Sequence[Any]) -> list[Mapping[str, Any] | None]:
    """E's ``ec_transfer_params`` per request: what a proxy forwards to PD (``forward_ec_params``)."""
    return [getattr(out, "ec_transfer_params", None) for out in outputs]


def forward_ec_params(params: Mapping[str, Any] | None, **sampling: Any) -> Any:
    """PD's ``SamplingParams`` carrying E's params, as a disaggregated proxy sends them."""
    from vllm import SamplingParams

    extra = {"ec_transfer_params": dict(params)} if params else None
    return SamplingParams(extra_args=extra, **sampling)
