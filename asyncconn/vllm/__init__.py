"""Thin adapters between vLLM's connector interfaces and asyncconn's engines.

vLLM loads them by module path::

    ECTransferConfig(ec_connector="AsyncConnECConnector", ec_connector_module_path="asyncconn.vllm", ...)
    KVTransferConfig(kv_connector="AsyncConnKVConnector", kv_connector_module_path="asyncconn.vllm", ...)

Each connector class is a facade that builds exactly one scheduler-side or worker-side object and
delegates to it; the logic lives in plain classes testable without an engine. Importing this package does
not import vLLM: the connector classes (which subclass vLLM's bases) load on first attribute access.

Request lifecycle contract (what happens to in-flight work at each event; tested in tests/vllm):

KV connector (``AsyncConnKVConnector``):

==========  =============================  ==================================  ==================================
event       in-flight lookup               in-flight load                      in-flight save
==========  =============================  ==================================  ==================================
finished    n/a (answered before it runs)  n/a (loads end before it runs)      blocks held (``request_finished``
                                                                               returns True) until every save of
                                                                               the request ends or fails, then
                                                                               reported in ``finished_sending``
aborted     discarded; a late answer is    fetches cancelled, staging freed;   as finished
            never served                   blocks held until every worker
                                           reports the id once in
                                           ``finished_recving``
preempted   discarded; the store is asked  cannot happen (a request waiting    pending snapshot copies (CUDA
            again on re-admission          for KV is not running)              stream or CPU copy thread)
                                                                               waited for, bounded by
                                                                               ``preempt_timeout``, in
                                                                               ``handle_preemptions``
==========  =============================  ==================================  ==================================

KV events (vLLM's ``kv_events_config`` on; :mod:`asyncconn.vllm.kv.events`): a value a request planned to save
is announced (``BlockStored``) once every saving rank confirmed it, also after the request finished, was
aborted or preempted (its saves go on); the request's records go when it is reported in ``finished_sending``,
or at ``request_finished`` when no such report will come (no saves, or finished while loading).

EC connector (``AsyncConnECConnector``; saves are per item, not per request):

==========  =============================  ==================================  ==================================
event       in-flight lookup               prefetch (staged on the workers)    producer save
==========  =============================  ==================================  ==================================
finished    discarded                      dropped; staging freed on the next  continues in the background;
or aborted                                 step that runs the model            ``request_finished`` never returns
                                                                               True; E's ``has_pending_push_work``
                                                                               keeps the engine stepping until the
                                                                               item is seen in the store or
                                                                               ``arrival_timeout`` passes
preempted   none outstanding for a         items already staged stay valid;    as above
            running request; installed     nothing is installed unless every
            or missed items are looked     worker staged it, so an item lost
            up again on re-admission       meanwhile is encoded, never missed
==========  =============================  ==================================  ==================================
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["AsyncConnECConnector", "AsyncConnKVConnector"]

_LAZY = {
    "AsyncConnECConnector": "asyncconn.vllm.ec.connector",
    "AsyncConnKVConnector": "asyncconn.vllm.kv.connector",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncconn.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
