"""Configuration half of the engine simulator: a weightless model directory, vLLM's config objects, the
real V1 ``Scheduler``.

Kept apart from the runner so that the one place that knows how to coax vLLM's config validation into
accepting a model with no weights and no GPU is small and readable (vLLM's own test recipe).
Every vLLM import is local to a function: importing this module costs nothing, importing vLLM ~8 s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from asyncconn_tools.sim.errors import SimulationError

__all__ = [
    "ConnectorSpec",
    "SimShape",
    "build_kv_cache_config",
    "build_scheduler",
    "build_vllm_config",
    "layer_names",
    "make_model_dir",
]

_EC_ROLES = frozenset({"ec_producer", "ec_consumer", "ec_both"})
_KV_ROLES = frozenset({"kv_producer", "kv_consumer", "kv_both"})


@dataclass(frozen=True)
class SimShape:
    """The simulated model's geometry: what the KV tensors and the fake encoder outputs look like.

    ``num_kv_heads`` is the whole model's; with ``num_workers`` > 1 each worker holds an equal slice of
    the heads, as tensor parallelism does, so it must divide evenly. ``mla``: the one KV cache group is an
    ``MLAAttentionSpec`` and every worker holds all of it, as every rank holds the same latent KV of an MLA
    model (DeepSeek-V2/V3).
    """

    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 4
    hidden_size: int = 32
    block_size: int = 16
    num_blocks: int = 64
    vocab_size: int = 1000
    mla: bool = False


@dataclass(frozen=True)
class ConnectorSpec:
    """One connector, named as in ``--kv-transfer-config`` / ``--ec-transfer-config``.

    ``class_name`` + ``module_path`` resolve the class; ``role`` is vLLM's ``kv_role``/``ec_role`` string.
    A class name already in vLLM's EC registry wins over ``module_path`` (vLLM's rule, not ours).
    """

    class_name: str
    module_path: str | None
    role: str
    extra_config: dict[str, Any] = field(default_factory=dict)


def make_model_dir(directory: str | Path, shape: SimShape | None = None) -> Path:
    """Write a tiny OPT decoder ``config.json`` into ``directory`` and return it.

    Nothing is ever downloaded: vLLM only inspects the config to pick a model class and its limits.
    """
    shape = shape or SimShape()
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    num_heads = max(shape.num_kv_heads, 1)
    config = {
        "architectures": ["OPTForCausalLM"],
        "model_type": "opt",
        "hidden_size": shape.hidden_size,
        "word_embed_proj_dim": shape.hidden_size,
        "num_hidden_layers": shape.num_layers,
        "num_attention_heads": num_heads,
        "ffn_dim": shape.hidden_size * 4,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": 4096,
        "do_layer_norm_before": True,
        "activation_function": "relu",
        "bos_token_id": 2,
        "eos_token_id": 2,
        "pad_token_id": 1,
        "torch_dtype": "float16",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def layer_names(shape: SimShape) -> list[str]:
    """OPT's attention layer names, so connectors keyed by layer name see realistic keys."""
    return [f"model.decoder.layers.{i}.self_attn.attn" for i in range(shape.num_layers)]


def build_vllm_config(
    model_dir: Path,
    shape: SimShape,
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    kv: ConnectorSpec | None,
    ec: ConnectorSpec | None,
    kv_load_failure_policy: str = "fail",
    kv_events: bool = False,
) -> Any:
    """Build a ``VllmConfig`` on the CPU device with the optional KV/EC transfer configs; ``kv_events`` turns
    vLLM's KV cache events on (publisher ``null``: a test replaces the scheduler's publisher to read them)."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        ECTransferConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    if kv is not None and kv.role not in _KV_ROLES:
        raise SimulationError(f"kv role {kv.role!r} is not one of {sorted(_KV_ROLES)}")
    if kv_load_failure_policy not in {"fail", "recompute"}:
        raise SimulationError(
            f"kv_load_failure_policy {kv_load_failure_policy!r} is not 'fail' or 'recompute'"
        )
    if ec is not None and ec.role not in _EC_ROLES:
        raise SimulationError(f"ec role {ec.role!r} is not one of {sorted(_EC_ROLES)}")
    try:
        model_config = ModelConfig(
            model=str(model_dir), skip_tokenizer_init=True, dtype="float16", max_model_len=max_model_len
        )
        kv_config = (
            None
            if kv is None
            else KVTransferConfig(
                kv_connector=kv.class_name,
                kv_connector_module_path=kv.module_path,
                kv_role=cast(Any, kv.role),
                kv_connector_extra_config=dict(kv.extra_config),
                kv_load_failure_policy=cast(Any, kv_load_failure_policy),
            )
        )
        # vLLM refuses an ec_producer on a text-only model ("requires a multimodal model"); validate as
        # ec_both and restore the real role below. The scheduler's encoder-only flag is set separately.
        ec_config = (
            None
            if ec is None
            else ECTransferConfig(
                ec_connector=ec.class_name,
                ec_connector_module_path=ec.module_path,
                ec_role=cast(Any, "ec_both" if ec.role == "ec_producer" else ec.role),
                ec_connector_extra_config=dict(ec.extra_config),
            )
        )
        config = VllmConfig(
            model_config=model_config,
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=True,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(
                block_size=shape.block_size, enable_prefix_caching=enable_prefix_caching
            ),
            device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_config,
            ec_transfer_config=ec_config,
            kv_events_config=(
                KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None
            ),
        )
    except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
        raise SimulationError(f"vLLM rejected the simulator config: {exc}") from exc
    if ec is not None and config.ec_transfer_config is not None:
        config.ec_transfer_config.ec_role = cast(Any, ec.role)
    config.cache_config.num_gpu_blocks = shape.num_blocks
    # The simulator runs its workers in this process, as vLLM's uniprocess executor does (vLLM's CPU
    # platform turned it into "mp", which the connectors read as workers in processes of their own).
    config.parallel_config.distributed_executor_backend = "uni"
    return config


def build_kv_cache_config(shape: SimShape) -> Any:
    """A one-group ``KVCacheConfig``: every layer shares the same full-attention (or MLA) spec and block
    table."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
    )

    kind = MLAAttentionSpec if shape.mla else FullAttentionSpec
    spec = kind(
        block_size=shape.block_size,
        num_kv_heads=shape.num_kv_heads,
        head_size=shape.head_size,
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=shape.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(layer_names(shape), spec)],
    )


def build_scheduler(
    vllm_config: Any,
    kv_cache_config: Any,
    shape: SimShape,
    *,
    encoder_cache_size: int,
    encoder_budget: int,
    encoder_only: bool,
) -> Any:
    """The real ``Scheduler``, then the two fixes a text-only config needs to exercise multimodal paths.

    A text-only model gets a zero-sized encoder cache and a zero encoder budget, which would defer every
    multimodal request forever; so both are replaced. ``encoder_only`` flips the flag an
    ``mm_encoder_only`` model config would set: the E instance of E->PD stops a request as soon as its
    prompt is consumed instead of sampling.
    """
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    scheduler = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=shape.block_size,
        log_stats=True,
    )
    scheduler.encoder_cache_manager = EncoderCacheManager(cache_size=encoder_cache_size)
    scheduler.max_num_encoder_input_tokens = encoder_budget
    scheduler.is_mm_encoder_only = encoder_only
    return scheduler
