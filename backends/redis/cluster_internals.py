"""The one place ``redis+cluster://`` builds on redis-py internals: a slot transaction and pool counts.

Why internals. A chunked ``put`` must be one MULTI/UNLINK/HSET/EXEC on the value's node. redis-py's public
way, ``RedisCluster.pipeline(transaction=True)``, runs each queued command in a new thread with its own
``asyncio.run`` while the loop thread waits (redis-py 8), which stalls the runtime for every command.
The only other public route, a separate ``redis.asyncio.Redis`` per node, would open a second pool of
connections beside the cluster client's (other credentials, timeouts and counts to keep in step). So
:class:`SlotTransaction` is a ``ClusterPipeline`` subclass that queues commands itself and sends them with
``ClusterNode.execute_pipeline`` as ``PipelineCommand`` objects -- the same calls redis-py's own
non-transactional pipeline makes -- and :func:`pool_counts` reads a node's connection lists, which redis-py
exposes to nothing public (tests count connections back to zero).

What it relies on (``tests/backends/test_redispy_internals.py`` fails when any of it changes shape, and
pyproject.toml keeps redis-py below its next major release until that test is re-run):

- ``ClusterPipeline(client, transaction=...)``, its ``cluster_client`` attribute, its command methods
  (``hset``, ``pexpire``, ...) queueing through ``execute_command``, ``execute(raise_on_error,
  allow_redirections)``, and ``async with`` on it;
- ``PipelineCommand(position, *args)`` with ``.result`` set by ``ClusterNode.execute_pipeline(commands)``
  (a reply, or the exception a command raised);
- ``RedisCluster.get_node_from_key(key)``, ``RedisCluster.nodes_manager.initialize()``;
- ``ClusterNode._connections`` (every connection of the node's pool), ``ClusterNode._free`` (the idle ones).
"""

from __future__ import annotations

from typing import Any

import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, PipelineCommand, RedisCluster

__all__ = ["SlotTransaction", "pool_counts"]

#: How often a transaction is re-sent after the slot moved or its node dropped the connection.
TRANSACTION_ATTEMPTS = 3


class SlotTransaction(ClusterPipeline):
    """A MULTI/EXEC pipeline whose commands all touch one slot, sent to the node that owns it.

    Commands are queued here as plain argument tuples; ``execute`` sends MULTI, them and EXEC in one
    write and, when the slot has moved (``MOVED`` aborts the transaction) or the node's connection broke,
    re-reads the slot map and sends the whole transaction again. Re-sending is safe: the only
    transaction written is a chunked put, which replaces its key with the same version again.
    """

    def __init__(self, client: RedisCluster) -> None:
        super().__init__(client, transaction=False)
        self._queued: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any, **kwargs: Any) -> ClusterPipeline:
        self._queued.append(args)
        return self

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> list[Any]:
        client = self.cluster_client
        await client.initialize()
        queued, self._queued = self._queued, []
        last: BaseException | None = None
        for _ in range(TRANSACTION_ATTEMPTS):
            node = client.get_node_from_key(queued[0][1])
            if node is None:  # only for replica lookups; a primary is always returned or raised
                raise rexc.SlotNotCoveredError(f"no node serves key {queued[0][1]!r}")
            try:
                results = await self._exec_on(node, queued)
            except (rexc.MovedError, rexc.AskError, rexc.ExecAbortError, rexc.ConnectionError) as exc:
                last = exc
                await client.nodes_manager.initialize()
                continue
            if raise_on_error:
                failed = next((r for r in results if isinstance(r, Exception)), None)
                if failed is not None:
                    raise failed
            return results
        assert last is not None
        raise last

    @staticmethod
    async def _exec_on(node: ClusterNode, queued: list[tuple[Any, ...]]) -> list[Any]:
        commands = [
            PipelineCommand(0, "MULTI"),
            *(PipelineCommand(i + 1, *args) for i, args in enumerate(queued)),
            PipelineCommand(len(queued) + 1, "EXEC"),
        ]
        await node.execute_pipeline(commands)
        for command in commands[:-1]:  # MULTI's OK, QUEUED, or the error that will abort EXEC
            if isinstance(command.result, (rexc.MovedError, rexc.AskError, rexc.ConnectionError)):
                raise command.result
        outcome = commands[-1].result
        if isinstance(outcome, BaseException):
            raise outcome
        if not isinstance(outcome, list):
            raise rexc.ResponseError(f"unexpected EXEC reply {outcome!r}")
        return outcome


def pool_counts(node: ClusterNode) -> tuple[int, int]:
    """``(connected, in_use)`` of ``node``'s connection pool: open sockets, and connections handed out now."""
    connections = node._connections
    connected = sum(c.is_connected for c in connections)
    return connected, len(connections) - len(node._free)
