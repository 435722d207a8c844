"""How the worker tells vLLM that an asynchronous load failed: one mode per model, chosen at construction
from its KV cache groups.

* :class:`BlockFailures` (one KV cache group): the failed values' block ids, through
  ``get_block_ids_with_load_errors``. vLLM keeps the request's valid prefix and recomputes from the first
  bad block.
* :class:`RequestFailures` (several groups: vLLM's hybrid KV cache manager): the request's id, in
  ``KVConnectorTransferResults.failed_recving``. Block ids are only unique within a group there, so vLLM
  0.32 refuses block-level reports with a ``RuntimeError`` that stops the engine
  (``Scheduler._handle_invalid_blocks``); a failed request is recomputed from its local prefix-cache hit
  instead (``kv_load_failure_policy: recompute``) or finished with an error (``fail``).

A sync load's failure (``kv_sync_loads``) has only the block-level report in vLLM 0.32 (``failed_recving``
applies to requests in ``WAITING_FOR_REMOTE_KVS``), so the connector refuses sync loads with several groups
at start-up and its failed blocks always go to :attr:`LoadFailures.blocks`.
"""

from __future__ import annotations

__all__ = ["BlockFailures", "LoadFailures", "RequestFailures", "load_failures"]


class LoadFailures:
    """Failed loads not yet reported to vLLM: blocks (``get_block_ids_with_load_errors``) and requests
    (``failed_recving``)."""

    def __init__(self) -> None:
        self.blocks: set[int] = set()
        self.requests: set[str] = set()

    def async_failed(self, request_id: str, blocks: set[int]) -> None:
        """An asynchronous load, reported in ``finished_recving`` this step, had ``blocks`` fail."""
        raise NotImplementedError

    def take_blocks(self) -> set[int]:
        blocks, self.blocks = self.blocks, set()
        return blocks

    def take_requests(self) -> set[str]:
        requests, self.requests = self.requests, set()
        return requests

    def held(self) -> int:
        return len(self.blocks) + len(self.requests)

    def clear(self) -> None:
        self.blocks.clear()
        self.requests.clear()


class BlockFailures(LoadFailures):
    """One KV cache group: the failed blocks (vLLM keeps the prefix before the first of them)."""

    def async_failed(self, request_id: str, blocks: set[int]) -> None:
        self.blocks |= blocks


class RequestFailures(LoadFailures):
    """Several KV cache groups: the request (its blocks' ids are ambiguous across groups)."""

    def async_failed(self, request_id: str, blocks: set[int]) -> None:
        self.requests.add(request_id)


def load_failures(num_groups: int) -> LoadFailures:
    """The mode for a model with ``num_groups`` KV cache groups (see the module docstring)."""
    return RequestFailures() if num_groups > 1 else BlockFailures()
