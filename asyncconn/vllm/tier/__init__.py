"""asyncconn stores as a secondary tier of vLLM's OffloadingConnector (docs/offloading-tier.md).

vLLM loads the tier by class name and module path from ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "AsyncConnTier", "module_path": "asyncconn.vllm.tier",
                         "backend_url": "redis://10.0.0.5:6379/0"}]

``AsyncConnTier`` subclasses vLLM's ``SecondaryTierManager``, so it loads (and imports vLLM) on first
attribute access; the modules it is made of (settings, names, lookups, io) import no vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncconn.vllm.tier.manager import AsyncConnTier

__all__ = ["AsyncConnTier"]


def __getattr__(name: str) -> Any:
    if name == "AsyncConnTier":
        from asyncconn.vllm.tier.manager import AsyncConnTier

        return AsyncConnTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
