"""KV cache groups as the KV connector sees them: which kinds it stores, and vLLM's null block.

vLLM's hybrid KV cache manager gives each attention kind its own KV cache groups, all drawing on one block
pool. A full-attention group holds every block of a request. A sliding-window (or chunked-local) group
holds only the blocks its layers can still read: the others are handed back to the pool while the request
runs and their places in the request's block table are taken by vLLM's *null block* -- block 0, which no
request owns and which must never be read or written for a request. A loaded value may therefore cover a
position at which a windowed group has the null block: that group's layers are not written there (vLLM
will not read them), and a value is never saved from a null block.

Mamba and other state-space groups keep one running state per request rather than per-block KV; a value
of blocks cannot hold them, so such models are refused at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["NULL_BLOCK_ID", "has_null", "real_blocks"]

#: The id of vLLM's null block (``BlockPool.null_block``: the pool's first block, never allocated).
NULL_BLOCK_ID = 0


def has_null(block_ids: Sequence[Sequence[int]]) -> bool:
    """Whether any group of a value has the null block at one of its positions."""
    return any(NULL_BLOCK_ID in group for group in block_ids)


def real_blocks(block_ids: Sequence[Sequence[int]]) -> set[int]:
    """The block ids of a value, every group, without the null block (what a load error may name)."""
    return {b for group in block_ids for b in group if b != NULL_BLOCK_ID}
