"""asyncconn stores as a secondary tier of vLLM's OffloadingConnector (docs/offloading-tier.md).

vLLM loads the tier by class name and module path from ``kv_connector_extra_config``::

    "secondary_tiers": [{"type": "AsyncConnTier", "module_path": "asyncconn.vllm.tier",
                         "backend_url": "redis://10.0.0.5:6379/0"}]

Importing this package imports vLLM (the tier subclasses its ``SecondaryTierManager``); nothing else in
asyncconn imports it.
"""

from asyncconn.vllm.tier.manager import AsyncConnTier

__all__ = ["AsyncConnTier"]
