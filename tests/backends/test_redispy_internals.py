"""The shape of the redis-py internals ``backends/redis/cluster_internals.py`` relies on.

These fail when redis-py changes one of them (a constructor's parameters, a method's signature, an
attribute dropped from ``__slots__``, a command method that stops queueing through ``execute_command``) --
the signal to rework that module before raising the ``redis<9`` cap in pyproject.toml. No server: a
``RedisCluster`` connects lazily, and nothing here sends a command.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from asyncconn_backends.redis.cluster_internals import SlotTransaction, pool_counts
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, PipelineCommand, RedisCluster


def _params(function: Callable[..., Any]) -> list[tuple[str, Any]]:
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def _client() -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", 1)])  # never connected


def test_cluster_pipeline_constructor_and_execute() -> None:
    assert _params(ClusterPipeline.__init__)[:3] == [
        ("self", inspect.Parameter.empty),
        ("client", inspect.Parameter.empty),
        ("transaction", None),
    ]
    assert _params(ClusterPipeline.execute) == [
        ("self", inspect.Parameter.empty),
        ("raise_on_error", True),
        ("allow_redirections", True),
    ]
    assert inspect.iscoroutinefunction(ClusterPipeline.execute)
    assert "cluster_client" in ClusterPipeline.__slots__
    assert inspect.iscoroutinefunction(ClusterPipeline.__aenter__)
    assert inspect.iscoroutinefunction(ClusterPipeline.__aexit__)


async def test_command_methods_queue_through_execute_command() -> None:
    """What ``RedisBackend._put_chunked`` calls on the pipeline lands in our queue as argument tuples."""
    client = _client()
    pipe = SlotTransaction(client)  # type: ignore[abstract]
    assert pipe.cluster_client is client
    pipe.execute_command("UNLINK", "k")
    pipe.hset("k", mapping={"m": b"x", "c0": b"y"})
    pipe.pexpire("k", 1000)
    assert pipe._queued == [("UNLINK", "k"), ("HSET", "k", "m", b"x", "c0", b"y"), ("PEXPIRE", "k", 1000)]
    await pipe.reset()  # what ``async with`` does on the way out: no I/O, and our queue is ours
    assert len(pipe._queued) == 3
    await client.aclose()


def test_pipeline_command_carries_args_and_a_result() -> None:
    assert _params(PipelineCommand.__init__) == [
        ("self", inspect.Parameter.empty),
        ("position", inspect.Parameter.empty),
        ("args", inspect.Parameter.empty),
        ("kwargs", inspect.Parameter.empty),
    ]
    command = PipelineCommand(3, "HSET", "k", "f", b"v")
    assert command.position == 3 and command.args == ("HSET", "k", "f", b"v") and command.kwargs == {}
    # execute_pipeline sets it (a reply or the exception); before that it holds a placeholder (None up to
    # redis-py 8.1, a sentinel of its own since 8.2), which _exec_on never reads.
    assert hasattr(command, "result")


def test_cluster_node_pipeline_and_pool_lists() -> None:
    assert _params(ClusterNode.execute_pipeline) == [
        ("self", inspect.Parameter.empty),
        ("commands", inspect.Parameter.empty),
    ]
    assert inspect.iscoroutinefunction(ClusterNode.execute_pipeline)
    assert {"_connections", "_free"} <= set(ClusterNode.__slots__)
    node = ClusterNode("127.0.0.1", 1)
    assert pool_counts(node) == (0, 0)
    held = node.acquire_connection()  # no I/O: a connection object, not yet connected
    assert pool_counts(node) == (0, 1)
    node.release(held)
    assert pool_counts(node) == (0, 0)


def test_cluster_routing_and_slot_map_refresh() -> None:
    assert _params(RedisCluster.get_node_from_key)[:3] == [
        ("self", inspect.Parameter.empty),
        ("key", inspect.Parameter.empty),
        ("replica", False),
    ]
    assert inspect.iscoroutinefunction(RedisCluster.initialize)
    assert inspect.iscoroutinefunction(NodesManager.initialize)
    assert "nodes_manager" in RedisCluster.__slots__


@pytest.mark.parametrize("name", ["hset", "pexpire"])
def test_the_queued_commands_are_command_methods_of_the_pipeline(name: str) -> None:
    assert callable(getattr(ClusterPipeline, name))
