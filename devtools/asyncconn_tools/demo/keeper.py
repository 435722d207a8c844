"""Keeping a store's values for the length of a demo whose engines run one after another.

Why: on a ``mooncake://`` store the values live in the memory segments that live clients contribute, and a
client that closes takes the values placed in its segment with it. The real-engine parts of ``asyncconn
demo`` close each engine before the next starts (in-process vLLM engines cannot overlap: vLLM keeps its
connectors in process-wide state), so engine 1's saves would be gone when engine 2 loads. The demo does
what a deployment does instead: one long-lived client contributes the memory (here the demo's own, with the
URL's ``segment``) and the engines join as pure clients (``segment=0``). Other stores keep their values by
themselves and are used as given.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn.url import with_param

__all__ = ["kept_store"]

#: Bound on opening and closing the demo's own client.
_TIMEOUT_S = 60.0


def _without_segment(url: str) -> str:
    """``url`` with ``segment=0``, whatever segment it named (the other parameters as written)."""
    return with_param(url, "segment", "0")


@contextlib.contextmanager
def kept_store(url: str) -> Iterator[str]:
    """Yield the URL the engines should use, with every value they save kept until the block ends."""
    if not url.startswith("mooncake://"):
        yield url
        return
    runtime = get_runtime()
    holder = runtime.run(TensorStore.open(url), _TIMEOUT_S)
    try:
        yield _without_segment(url)
    finally:
        runtime.run(holder.close(), _TIMEOUT_S)
