"""KV cache groups as the KV connector sees them: which kinds it stores, and vLLM's null block.

vLLM's hybrid KV cache manager gives each attention kind its own KV cache groups, all drawing on one block
pool. A full-attention group holds every block of a request. A sliding-window (or chunked-local) group
holds only the blocks its layers can still read: the others are handed back to the pool while the request
runs and their places in the request's block table are taken by vLLM's *null block* -- block 0, which no
request owns and which must never be read or written for a request. A loaded value may therefore cover a
position at which a windowed group has the null block: that group's layers are not written there (vLLM
will not read them), and a value is never saved from a null block.

With such groups a value is stored in two *parts* (:class:`GroupLayout`): the whole-life groups' layers
for every prefix block, and the windowed groups' layers only for the blocks inside the window at the
cut (where the request stopped storing) -- the blocks a later request resuming there reads
(:class:`Window`, vLLM's own rule). A model whose groups are all whole-life has one part, every layer.

Mamba and other state-space groups keep one running state per request rather than per-block KV; a value
of blocks cannot hold them, so such models are refused at start-up.

MLA groups (DeepSeek-V2/V3 latent KV) hold one latent row per token and layer, not a slice of the heads:
every tensor-parallel rank computes and keeps the same bytes. A model whose groups are all MLA is
:func:`replicated` -- its values are stored once, under rank-independent keys
(:class:`asyncconn.vllm.kv.keys.KeySpace`), saved by rank 0 and loaded by every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from asyncconn.exceptions import ConfigError

__all__ = [
    "NULL_BLOCK_ID",
    "GroupLayout",
    "Part",
    "Window",
    "check_groups",
    "check_sync_loads",
    "has_null",
    "real_blocks",
    "replicated",
]

#: Group kinds whose blocks a request keeps for its whole life (every prefix block is stored and loaded).
_WHOLE = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
#: Group kinds whose blocks vLLM frees once they leave the layers' window (null blocks in their tables).
_WINDOWED = frozenset({"SlidingWindowSpec", "ChunkedLocalAttentionSpec"})

#: Group kinds whose KV is the same on every tensor-parallel rank (no head split: MLA's latent rows).
_REPLICATED = frozenset({"MLAAttentionSpec"})

#: The id of vLLM's null block (``BlockPool.null_block``: the pool's first block, never allocated).
NULL_BLOCK_ID = 0


def has_null(block_ids: Sequence[Sequence[int]]) -> bool:
    """Whether any group of a value has the null block at one of its positions."""
    return any(NULL_BLOCK_ID in group for group in block_ids)


def real_blocks(block_ids: Sequence[Sequence[int]]) -> set[int]:
    """The block ids of a value, every group, without the null block (what a load error may name)."""
    return {b for group in block_ids for b in group if b != NULL_BLOCK_ID}


def replicated(kv_cache_groups: Sequence[Any]) -> bool:
    """Whether every rank holds the same KV: every group is MLA (exact class name, as in
    :func:`check_groups`). One group of another kind (a head slice per rank) makes a value per-rank."""
    groups = list(kv_cache_groups)
    return bool(groups) and all(type(g.kv_cache_spec).__name__ in _REPLICATED for g in groups)


@dataclass(frozen=True)
class Window:
    """Which blocks the windowed groups' layers read once a request has computed ``tokens`` tokens.

    vLLM pads a request's table with the null block for the tokens a group skips
    (``get_num_skipped_tokens`` of ``SlidingWindowManager`` and ``ChunkedLocalAttentionManager``) and gives
    real blocks, to be loaded, from there on; a sliding-window prefix hit of ``n`` blocks needs the last
    ``cdiv(sliding_window - 1, block_size)`` of them (``find_longest_cache_hit``), the same blocks. Each
    entry is ``(kind, size, extra)``: ``("sliding", sliding_window, extra_retained_tokens)`` or
    ``("chunked", attention_chunk_size, 0)``.
    """

    rules: tuple[tuple[str, int, int], ...]
    block_size: int

    def first_block(self, tokens: int) -> int:
        """The first block some windowed group reads at ``tokens`` computed tokens (the earliest of them)."""
        return min(self._skipped(rule, tokens) for rule in self.rules) // self.block_size

    @staticmethod
    def _skipped(rule: tuple[str, int, int], tokens: int) -> int:
        kind, size, extra = rule
        if kind == "sliding":
            return max(0, tokens - size + 1 - extra)
        return tokens // size * size

    @classmethod
    def of(cls, specs: Sequence[Any], block_size: int) -> Window:
        rules = []
        for spec in specs:
            if type(spec).__name__ == "SlidingWindowSpec":
                extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
                rules.append(("sliding", int(spec.sliding_window), extra))
            else:
                rules.append(("chunked", int(spec.attention_chunk_size), 0))
        return cls(tuple(rules), block_size)


@dataclass(frozen=True)
class Part:
    """The layers one stored value holds: the whole-life groups' (every prefix block), or the windowed
    groups' (``windowed``: only the blocks inside the window at the cut)."""

    layers: list[str]
    windowed: bool


@dataclass(frozen=True)
class GroupLayout:
    """The KV cache groups as a value holds them: every layer, in group order, and which group each is in."""

    layers: list[str]
    group_of_layer: dict[str, int]
    windowed: bool  # some group frees blocks while the request runs (see the module docstring)
    #: The parts a value is stored in, whole-life first: one (every layer) without windowed groups.
    parts: tuple[Part, ...] = ()
    window: Window | None = None  # the windowed groups' rule (None without any)
    #: vLLM's KV cache groups (more than one: the hybrid manager is on, and block ids are per group).
    num_groups: int = 1


def check_groups(kv_cache_config: Any) -> GroupLayout:
    """The layout of vLLM's KV cache groups, or a :class:`ConfigError` saying which group kind this
    connector cannot store and what to do.

    Kinds are matched by exact class name (not ``isinstance``): a new subclass in a later vLLM may lay out
    or free its blocks differently, and must be refused until it is known to fit.
    """
    if kv_cache_config is None:
        raise ConfigError("AsyncConnKVConnector needs vLLM's kv_cache_config (vLLM >= 0.32 passes it)")
    groups = list(kv_cache_config.kv_cache_groups)
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    bad = sorted({k for k in kinds if k not in _WHOLE | _WINDOWED})
    if bad:
        state = [k for k in bad if "Mamba" in k or "Linear" in k or "ShortConv" in k]
        what = (
            "a per-request recurrent state (Mamba / linear attention), not per-block KV that a value of "
            "blocks can hold"
            if state
            else "a KV layout this connector does not know"
        )
        raise ConfigError(
            f"AsyncConnKVConnector cannot store KV cache groups of kind {', '.join(bad)} ({what}); this "
            f"model's groups are {kinds}. Serve this model without a KV connector (vLLM's own prefix "
            "caching still works), or with one that supports these groups. Full-attention, MLA, "
            "sliding-window and chunked-local groups are supported."
        )
    block_sizes = sorted({int(g.kv_cache_spec.block_size) for g in groups})
    if len(block_sizes) != 1:
        raise ConfigError(
            f"AsyncConnKVConnector stores values of one block size; this model's KV cache groups {kinds} "
            f"have block sizes {block_sizes}. Start vLLM with --disable-hybrid-kv-cache-manager."
        )
    layers = [name for g in groups for name in g.layer_names]
    windowed = [g for g, k in zip(groups, kinds, strict=True) if k in _WINDOWED]
    whole_layers = [name for g, k in zip(groups, kinds, strict=True) if k in _WHOLE for name in g.layer_names]
    window_layers = [name for g in windowed for name in g.layer_names]
    parts = tuple(
        Part(part_layers, is_windowed)
        for part_layers, is_windowed in ((whole_layers, False), (window_layers, True))
        if part_layers
    )
    return GroupLayout(
        layers,
        {name: i for i, g in enumerate(groups) for name in g.layer_names},
        windowed=bool(windowed),
        parts=parts,
        window=Window.of([g.kv_cache_spec for g in windowed], block_sizes[0]) if windowed else None,
        num_groups=len(groups),
    )


def check_sync_loads(layout: GroupLayout, sync_loads: bool) -> None:
    """Refuse ``kv_sync_loads`` with several KV cache groups: vLLM 0.32 has no report for a failed sync load
    there (block ids are per group, and ``failed_recving`` covers only requests waiting for an asynchronous
    load), so one missing or corrupt value would either stop the engine or leave the step's output computed
    on top of bad blocks (:mod:`asyncconn.vllm.kv.failures`)."""
    if sync_loads and layout.num_groups > 1:
        raise ConfigError(
            "kv_connector_extra_config.kv_sync_loads is not supported with vLLM's hybrid KV cache manager "
            f"(this model has {layout.num_groups} KV cache groups): vLLM 0.32 cannot be told that a sync "
            "load failed on such a model. Drop kv_sync_loads (asynchronous loads report a failure per "
            "request), or start vLLM with --disable-hybrid-kv-cache-manager."
        )
