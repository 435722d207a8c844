"""Stand-ins for the vLLM base classes the KV worker side's data derive from, used only where vLLM is
not installed at all.

Why: the worker side (loads, saves, KV scatter and gather) is proven on GPU machines that cannot carry vLLM
(its wheel is far larger than what a run may bring along). The connector facades still import vLLM itself,
and wherever vLLM is installed :mod:`asyncconn.vllm.kv.metadata` uses vLLM's own classes, so what vLLM sees is
unchanged. These have the same shape: an empty metadata base, and a stats base holding ``data``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["KVConnectorMetadata", "KVConnectorStats", "KVConnectorWorkerMetadata"]


class KVConnectorMetadata:
    """vLLM's ``KVConnectorMetadata``: an empty base."""


class KVConnectorWorkerMetadata:
    """vLLM's ``KVConnectorWorkerMetadata``: what a worker sends its scheduler; subclasses ``aggregate``."""


@dataclass
class KVConnectorStats:
    """vLLM's ``KVConnectorStats``: a serializable ``data`` dict; subclasses define the rest."""

    data: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return self.data
