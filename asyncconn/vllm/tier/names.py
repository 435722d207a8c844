"""Store names of offloaded chunks: a namespace of everything that makes a chunk's bytes incompatible,
then vLLM's offload key.

vLLM's ``OffloadKey`` (a block hash and a KV-cache group index) names a token prefix, not bytes: two
instances of different models, dtypes, block sizes, chunkings or parallel splits compute other bytes for
the same prefix. The facts that decide the bytes are folded into a digest, as vLLM's own file tier does
for its directory name (``FileMapper``), plus the size of the primary tier's chunk row (all workers'
pages and the padding, exactly what is stored) and a format tag. The ``offload:`` part keeps the names
apart from the KV connector's (``key_prefix`` + hex) and the EC connector's values in a shared store.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

__all__ = ["NAME_FORMAT", "TierNames", "namespace"]

#: Bumped whenever what a chunk's value holds changes, so values of an earlier build are plain misses.
NAME_FORMAT = 1
_DIGEST_HEX = 24


def namespace(offloading_config: Any, row_bytes: int) -> str:
    """The digest of what must match for two instances to share chunks (vLLM's ``OffloadingConfig``)."""
    cfg = offloading_config
    parallel = cfg.parallel
    facts = {
        "format": NAME_FORMAT,
        "model": cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names), g.group_id] for g in cfg.groups],
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "world_size": parallel.world_size,
        "tp": parallel.tp_size,
        "pp": parallel.pp_size,
        "pcp": parallel.pcp_size,
        "dcp": parallel.dcp_size,
        "replicated_layout": bool(cfg.replicated_layout),
        "canonical_layout": bool(cfg.canonical_layout),
        "kv_cache_layout": cfg.kv_cache_layout,
        "row_bytes": row_bytes,
    }
    text = json.dumps(facts, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:_DIGEST_HEX]


class TierNames:
    """``key_prefix + "offload:" + namespace + ":" + hex(offload key)`` for each chunk."""

    __slots__ = ("_head",)

    def __init__(self, digest: str, key_prefix: str = "") -> None:
        self._head = f"{key_prefix}offload:{digest}:"

    def name(self, key: bytes) -> str:
        return self._head + key.hex()

    def names(self, keys: Any) -> list[str]:
        head = self._head
        return [head + key.hex() for key in keys]
