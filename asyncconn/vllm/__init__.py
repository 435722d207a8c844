"""Thin adapters between vLLM's connector interfaces and asyncconn's engines.

vLLM loads them by module path::

    ECTransferConfig(ec_connector="AsyncConnECConnector", ec_connector_module_path="asyncconn.vllm", ...)
    KVTransferConfig(kv_connector="AsyncConnKVConnector", kv_connector_module_path="asyncconn.vllm", ...)

Each connector class is a facade that builds exactly one scheduler-side or worker-side object and
delegates to it; the logic lives in plain classes testable without an engine. Importing this package does
not import vLLM: the connector classes (which subclass vLLM's bases) load on first attribute access.

Request lifecycle contract (what happens to in-flight work at each event; tested in tests/vllm):

=====================  ==========================  ==========================  ==========================
event                  in-flight lookup            in-flight load              in-flight save
=====================  ==========================  ==========================  ==========================
finished (normal)      discarded                   n/a (loads end first)       KV: blocks held until the
                                                                               save ends, then reported in
                                                                               ``finished_sending``
aborted                discarded, never served     cancelled; staging freed    as finished
preempted              discarded; asked anew on    cancelled; staging freed    waited for (bounded) in
                       re-admission                                            ``handle_preemptions``
=====================  ==========================  ==========================  ==========================
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncConnECConnector", "AsyncConnKVConnector"]

_LAZY = {
    "AsyncConnECConnector": "asyncconn.vllm.ec_connector",
    "AsyncConnKVConnector": "asyncconn.vllm.kv_connector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncconn.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
