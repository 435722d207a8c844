"""How long a worker-side connector may take to shut down: inside vLLM's grace for its worker processes.

vLLM waits ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` (5 by default) for a worker process to exit, then
terminates it (and kills it 4 seconds later); a worker killed there leaves vLLM's own shared memory behind.
The connector's close -- cancel loads, let pending saves finish, close the store -- shares one deadline
(:class:`asyncconn.deadline.Deadline`) set to that grace less a margin for the rest of the worker's teardown.
"""

from __future__ import annotations

__all__ = ["CLOSE_MARGIN_S", "MIN_CLOSE_S", "worker_close_budget"]

#: Left of vLLM's grace for its own worker teardown, and for the saver's cancel bound.
CLOSE_MARGIN_S = 1.5
#: The least a close is given, whatever the grace (saves pending at shutdown are worth a second).
MIN_CLOSE_S = 1.0


def worker_close_budget() -> float:
    """Seconds the worker side's close may take: vLLM's worker grace less :data:`CLOSE_MARGIN_S` (5 s, the
    default grace, when vLLM does not say)."""
    try:
        from vllm import envs

        grace = float(envs.VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS)
    except (ImportError, AttributeError, ValueError):
        grace = 5.0
    return max(grace - CLOSE_MARGIN_S, MIN_CLOSE_S)
