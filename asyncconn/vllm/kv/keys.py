"""Store keys for KV values: a vLLM block hash plus everything that makes the bytes incompatible.

vLLM's block hash names a *token prefix*; it says nothing about the bytes its KV takes. Two instances of
different models, KV dtypes, layouts, block sizes or tensor-parallel splits compute different bytes for the
same prefix, so a key built from the hash alone would let one load the other's KV as garbage. Here the
incompatibility-making facts are folded into a namespace digest once, and each key is
``digest(namespace, rank, hash of the value's last block)``: the hash chain of the last block covers the
whole prefix, so one key names a value of ``blocks_per_value`` consecutive blocks.

The scheduler side (lookups) and the worker side (loads, saves) must compute identical keys from what each
of them knows, so the namespace uses only facts both sides read from the ``VllmConfig`` and the
``KVCacheConfig`` -- never the worker's tensors (a mismatch there is caught by the frame's dtype/shape check
and becomes a load error, never a wrong tensor).

Keys are bytes: the lookup client turns them into store keys with :func:`asyncconn.lookup.store_key`
(``key_prefix + hex``), and the savers write under exactly that name.

The rank is part of a key because each rank holds other heads -- except on a model whose KV is the same on
every rank (MLA's latent rows, :func:`asyncconn.vllm.kv.groups.replicated`): there every rank's key is rank
0's, so a value is stored once (:meth:`KeySpace.saves_on` says only rank 0 saves it), every rank loads that
one copy, and a lookup asks one key per value.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from asyncconn.exceptions import ConfigError
from asyncconn.lookup.protocol import store_key
from asyncconn.vllm.kv.groups import replicated

__all__ = ["KEY_FORMAT", "KeySpace", "KVIdentity"]

#: Bumped whenever the value layout changes, so old values can never be read as new ones. 2: frames pad
#: their header to 64 bytes (``codec.FORMAT_VERSION`` 2); a new namespace makes the values an earlier build
#: wrote plain misses, not failed loads.
KEY_FORMAT = 2
_DIGEST = 16


@dataclass(frozen=True)
class KVIdentity:
    """What must match for two instances to share KV bytes."""

    model: str
    revision: str
    dtype: str
    layout: str
    block_size: int
    num_kv_heads: int
    head_size: int
    layers: tuple[str, ...]
    tp_size: int
    blocks_per_value: int
    #: Every rank holds the same KV (MLA): one key per value, rank 0's. Not part of the namespace: rank 0's
    #: key and bytes are what they were before, and a non-MLA identity's digest stays unchanged.
    replicated: bool = False

    @classmethod
    def from_vllm(
        cls, vllm_config: Any, kv_cache_config: Any, *, tp_size: int, blocks_per_value: int
    ) -> KVIdentity:
        """Read the identity from vLLM's configs (the same call on the scheduler and on every worker)."""
        groups = list(kv_cache_config.kv_cache_groups)
        if not groups:
            raise ConfigError("KV connector: the KV cache config has no groups")
        spec = groups[0].kv_cache_spec
        model = vllm_config.model_config
        layers = tuple(name for group in groups for name in group.layer_names)
        return cls(
            model=str(model.model),
            revision=str(getattr(model, "revision", None) or ""),
            dtype=str(spec.dtype).removeprefix("torch."),
            layout=str(getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default"),
            block_size=int(spec.block_size),
            num_kv_heads=int(getattr(spec, "num_kv_heads", 0)),
            head_size=int(getattr(spec, "head_size", 0)),
            layers=layers,
            tp_size=tp_size,
            blocks_per_value=blocks_per_value,
            replicated=replicated(groups),
        )


class KeySpace:
    """Key derivation for one identity and one ``key_prefix``."""

    def __init__(self, identity: KVIdentity, key_prefix: str = "") -> None:
        if identity.blocks_per_value <= 0 or identity.tp_size <= 0 or identity.block_size <= 0:
            raise ConfigError(f"KV connector: impossible key identity {identity}")
        self.identity = identity
        self.key_prefix = key_prefix
        facts = asdict(identity)
        del facts["replicated"]  # which ranks' keys exist, not what the bytes are (see KVIdentity)
        blob = json.dumps({"format": KEY_FORMAT, **facts}, sort_keys=True).encode()
        self.namespace = hashlib.blake2b(blob, digest_size=_DIGEST).digest()
        self.tokens_per_value = identity.block_size * identity.blocks_per_value
        #: Distinct keys per value: one per rank, or one for all ranks when the KV is replicated (MLA).
        self.keys_per_value = 1 if identity.replicated else identity.tp_size
        # Per key rank, a hasher already fed the namespace and the rank: a key is a copy plus one update
        # (the worker derives a key per saved value on vLLM's thread, so this is on its hot path).
        self._seeded: list[hashlib.blake2b] = []
        for rank in range(self.keys_per_value):
            h = hashlib.blake2b(self.namespace, digest_size=_DIGEST)
            h.update(rank.to_bytes(4, "little"))
            self._seeded.append(h)

    def of_layers(self, layers: Sequence[str]) -> KeySpace:
        """The key space of a value holding only ``layers`` (a part of a hybrid model's value, see
        :mod:`asyncconn.vllm.kv.parts`): the layers are in the namespace, so its keys never name a value of
        other layers -- itself when ``layers`` are all of them (the same keys as ever)."""
        if tuple(layers) == self.identity.layers:
            return self
        return KeySpace(replace(self.identity, layers=tuple(layers)), self.key_prefix)

    @property
    def tp_size(self) -> int:
        return self.identity.tp_size

    @property
    def blocks_per_value(self) -> int:
        return self.identity.blocks_per_value

    @property
    def replicated(self) -> bool:
        return self.identity.replicated

    def saves_on(self, rank: int) -> bool:
        """Whether rank ``rank`` saves values: every rank its own heads, or rank 0 alone when every rank
        holds the same KV (the others load rank 0's copy)."""
        return rank == 0 or not self.identity.replicated

    def value_key(self, last_block_hash: bytes, rank: int) -> bytes:
        """The lookup key (bytes) of one value: the blocks ending at ``last_block_hash``, rank ``rank``
        (rank 0's for every rank when the KV is replicated)."""
        h = self._hasher(rank)
        h.update(bytes(last_block_hash))
        digest: bytes = h.digest()
        return digest

    def store_key(self, last_block_hash: bytes, rank: int) -> str:
        """The name the value is stored under (what the lookup client asks the store about)."""
        return store_key(self.key_prefix, self.value_key(last_block_hash, rank))

    def store_keys(self, last_block_hashes: Iterable[bytes], rank: int) -> list[str]:
        """:meth:`store_key` of each hash, for one rank: the same names, without the per-key overhead."""
        name = self.namer(rank)
        return [name(value_hash) for value_hash in last_block_hashes]

    def namer(self, rank: int) -> Callable[[bytes], str]:
        """``store_key(hash, rank)`` as a function of the hash alone (safe to call from any thread: each
        call copies the pre-seeded hasher)."""
        seeded, prefix = self._hasher(rank), self.key_prefix  # a private seed: never updated itself

        def name(last_block_hash: bytes) -> str:
            h = seeded.copy()
            h.update(last_block_hash)
            return prefix + h.hexdigest()

        return name

    def _hasher(self, rank: int) -> hashlib.blake2b:
        """A fresh hasher already fed ``namespace`` and ``rank`` (``blake2b(namespace || rank || ...)``)."""
        if not 0 <= rank < self.identity.tp_size:
            raise ConfigError(f"KV connector: rank {rank} outside tp_size {self.identity.tp_size}")
        return self._seeded[rank if rank < self.keys_per_value else 0].copy()

    def value_hashes(self, block_hashes: Sequence[bytes]) -> list[bytes]:
        """The block hash that names each complete value of a request: every ``blocks_per_value``-th hash."""
        step = self.identity.blocks_per_value
        return [bytes(block_hashes[i + step - 1]) for i in range(0, len(block_hashes) - step + 1, step)]

    def lookup_keys(self, value_hashes: Sequence[bytes]) -> list[bytes]:
        """Keys asked for a prefix lookup: each value's distinct keys (every rank's, or the one shared key
        of replicated KV), value by value.

        A PREFIX answer counts leading keys present, so ``answer // keys_per_value`` values are present for
        every rank: a value whose shard is missing on one rank ends the hit there.
        """
        return [self.value_key(h, rank) for h in value_hashes for rank in range(self.keys_per_value)]
