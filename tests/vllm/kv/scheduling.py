"""What vLLM hands the KV connector's scheduler side, faked for its unit tests: requests, allocated blocks,
a step's scheduler output and the workers' merged output."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

#: The block hashes of the requests below: block ``i``'s is ``bytes([i]) * 32``.
HASHES = [bytes([i]) * 32 for i in range(8)]


def fake_request(rid: str, num_tokens: int = 100) -> Any:
    """A request of ``num_tokens`` tokens in 16-token blocks (its full blocks' hashes from ``HASHES``)."""
    return SimpleNamespace(request_id=rid, block_hashes=HASHES[: num_tokens // 16], num_tokens=num_tokens)


def allocated(ids: list[int]) -> Any:
    """One KV cache group's allocated block ids."""
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step_output(preempted: frozenset[str] = frozenset(), finished: frozenset[str] = frozenset()) -> Any:
    """A step that scheduled nothing new, with these requests preempted and finished."""
    cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[], new_token_ids=[]
    )
    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        finished_req_ids=set(finished),
        scheduled_new_reqs=[],
        scheduled_cached_reqs=cached,
        num_scheduled_tokens={},
    )


def received(*rids: str) -> Any:
    """The workers' output: these requests' loads ended."""
    return SimpleNamespace(
        finished_recving=set(rids),
        finished_sending=None,
        invalid_block_ids=None,
        kv_connector_worker_meta=None,
    )
