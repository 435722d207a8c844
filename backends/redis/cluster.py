"""``redis+cluster://`` stores: a Redis Cluster through redis-py's asyncio ``RedisCluster``.

URL::

    redis+cluster://[[user]:password@]host:port[,host:port...][/][?prefix=vllm:&ttl=1h&chunk_size=1MiB&timeout=2s]

The hosts are seed nodes: any one reachable node is enough, the client learns every master from it and
follows the cluster's slot map from then on. The value layout, consistency rules and error translation are
``RedisBackend``'s, reused by subclassing: one value is one key ``<prefix>{<key>}``
(inline, or a hash of manifest and chunks), so it lives on one slot of one node and the MULTI/EXEC that
writes it is legal in a cluster. What differs:

- batched commands (``exists``, ``delete``, inline ``put``, the head reads) go through redis-py's
  cluster pipeline, which splits them per node and sends each node's share concurrently;
- a chunked ``put`` runs MULTI/UNLINK/HSET/EXEC on the value's node with ``cluster_internals.SlotTransaction``
  (redis-py's own transactional cluster pipeline starts a thread and a new event loop per queued command;
  that module holds every use of redis-py internals, and why);
- node failures: a refused or dropped connection, ``CLUSTERDOWN``, ``TRYAGAIN`` or an uncovered slot is a
  :class:`BackendUnavailable`, a node that does not answer a :class:`BackendTimeout`, both within
  ``timeout``; redis-py re-reads the slot map on the way, so the calls after a failover or a node's
  return are served again. The layer above (``TensorStore``, the lookup client) turns them into misses.

Chunk reads take ``redis://``'s fast path (``reader.ChunkReader``: replies received
straight into their buffers, and for ``get_into`` into the caller's tensor) with one raw reader per node,
chosen from the slot map (:class:`_NodeReaders`). A node answering ``MOVED``/``ASK``/``CLUSTERDOWN`` to a raw
read sends that read through redis-py instead, which follows the redirection.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any, ClassVar

import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.backoff import EqualJitterBackoff

from asyncconn.exceptions import BackendUnavailable, ConfigError
from asyncconn.runtime import fork_generation, keep_inherited
from asyncconn.url import Param, StoreURL, redact

from .backend import DEFAULT_CHUNK_SIZE, DEFAULT_PORT, RedisBackend, _gather
from .cluster_internals import SlotTransaction, pool_counts
from .reader import ChunkReader, Reply, ReplyError, Slot
from .removals import Removals
from .sockets import open_tcp

__all__ = ["RedisClusterBackend"]

#: Cluster states that mean "this part of the keyspace has no reachable master right now".
_UNAVAILABLE = (rexc.ClusterDownError, rexc.TryAgainError, rexc.RedisClusterException)


class _Cluster(RedisCluster):
    """``RedisCluster`` with the two commands :class:`RedisBackend` needs behaving as on one server."""

    def pipeline(self, transaction: Any | None = None, shard_hint: Any | None = None) -> ClusterPipeline:
        if transaction:
            # mypy sees an abstract attribute redis-py's own ClusterPipeline never sets either.
            return SlotTransaction(self)  # type: ignore[abstract]
        return super().pipeline(transaction, shard_hint)

    async def mget(self, keys: Any, *args: Any) -> list[Any]:  # type: ignore[override]
        # A batch's keys are on many slots: split per slot/node.
        return await self.mget_nonatomic(keys, *args)


class _NodeReaders(ChunkReader):
    """:class:`ChunkReader`'s interface over a cluster: ``HMGET`` goes to its key's node, ``MGET`` per name.

    One raw reader per node, opened on first use. A batch is split per node and the parts run at once;
    their replies are put back in the caller's order. When a node answers with an error (the slot moved,
    the cluster is down) that part is read through redis-py, which follows redirections and refreshes
    the slot map; such values come back as fresh buffers, never in the caller's slots, which the base
    backend treats as "read it the copying way".
    """

    def __init__(
        self, client: RedisCluster, *, username: str | None, password: str | None, max_connections: int
    ) -> None:
        super().__init__(
            self._no_direct_connection, username=username, password=password, db=0, max_connections=1
        )
        self._cluster = client
        self._auth = (username, password)
        self._per_node = max_connections
        self._nodes: dict[str, ChunkReader] = {}

    @staticmethod
    def _no_direct_connection(factory: Any) -> Any:
        raise AssertionError("_NodeReaders opens connections only through its per-node readers")

    def _reader_for(self, node: ClusterNode) -> ChunkReader:
        reader = self._nodes.get(node.name)
        if reader is None:
            host, port = node.host, int(node.port)

            def connect(factory: Any) -> Any:
                return open_tcp(host, port, factory)

            username, password = self._auth
            reader = ChunkReader(
                connect, username=username, password=password, db=0, max_connections=self._per_node
            )
            self._nodes[node.name] = reader
        return reader

    async def _request(
        self,
        command: tuple[bytes, ...],
        names: Sequence[str],
        max_bulk: int,
        slots: Sequence[Slot],
        suffix: tuple[bytes, ...] = (),
    ) -> list[Reply]:
        if self._closed:
            raise BackendUnavailable("chunk reader is closed")
        await self._cluster.initialize()
        if command[0] == b"HMGET":  # one hash: one slot, one node
            return await self._hash_request(command, names, max_bulk, slots)
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        for index, name in enumerate(names):
            node = self._cluster.get_node_from_key(name)
            assert node is not None  # a primary is always returned (or SlotNotCoveredError raised)
            by_node.setdefault(node.name, (node, []))[1].append(index)
        replies: list[Reply] = [None] * len(names)

        async def part(node: ClusterNode, indexes: list[int]) -> None:
            wanted = [names[i] for i in indexes]
            spots = [slots[i] for i in indexes] if slots else ()
            try:
                got = await self._reader_for(node)._request(command, wanted, max_bulk, spots, suffix)
            except ReplyError as exc:  # MOVED / ASK / CLUSTERDOWN: let redis-py follow it
                if command[0] != b"MGET" and not _redirected(exc):
                    raise  # (GETEX on a server without it: the caller falls back)
                values = await self._cluster.mget_nonatomic(wanted)
                got = [bytearray(v) if v is not None else None for v in values]
            for i, reply in zip(indexes, got, strict=True):
                replies[i] = reply

        await _gather(part(node, indexes) for node, indexes in by_node.values())
        return replies

    async def _hash_request(
        self, command: tuple[bytes, ...], fields: Sequence[str], max_bulk: int, slots: Sequence[Slot]
    ) -> list[Reply]:
        key = command[1].decode()
        node = self._cluster.get_node_from_key(key)
        assert node is not None  # a primary is always returned (or SlotNotCoveredError raised)
        try:
            return await self._reader_for(node)._request(command, fields, max_bulk, slots)
        except ReplyError:  # MOVED / ASK / CLUSTERDOWN: let redis-py follow it
            values: list[bytes | None] = await self._cluster.hmget(key, list(fields))  # type: ignore[assignment]
            return [bytearray(v) if v is not None else None for v in values]

    async def close(self) -> None:
        self._closed = True
        for reader in self._nodes.values():
            await reader.close()

    def held(self) -> dict[str, int]:
        out = {"connected": 0, "in_use": 0}
        for reader in self._nodes.values():
            for k, v in reader.held().items():
                out[k] += v
        return out


class RedisClusterBackend(RedisBackend):
    """:class:`RedisBackend`'s layout and contract over a Redis Cluster; one instance per URL and loop."""

    params: ClassVar[dict[str, Param]] = {
        "prefix": RedisBackend.params["prefix"],
        "ttl": RedisBackend.params["ttl"],
        "refresh_on_hit": RedisBackend.params["refresh_on_hit"],
        "chunk_size": RedisBackend.params["chunk_size"],
        "parallel": RedisBackend.params["parallel"],
        "max_connections": Param.count(16, "connections per cluster node; a call finding none free fails"),
        "timeout": RedisBackend.params["timeout"],
        "check": Param.boolean(True, "read the slot map when opening, so a wrong address fails at once"),
        "removals": RedisBackend.params["removals"],
        "retries": Param.count(3, "re-sends of a command after a node failure, re-reading the slot map"),
        "fast_read": Param.boolean(
            True, "read chunks over raw sockets (one reader per node) into their buffers"
        ),
    }

    def __init__(
        self,
        client: RedisCluster,
        *,
        name: str,
        password: str | None = None,
        prefix: str = "",
        ttl: float = 0.0,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        parallel: int = 4,
        timeout: float = 5.0,
        reader: ChunkReader | None = None,
        refresh_on_hit: bool = False,
    ) -> None:
        # Deliberately not RedisBackend.__init__, which builds a single-server client around a pool.
        # RedisCluster offers every command the inherited methods call (pipeline, mget, hget, hmget, set,
        # exists, unlink, ping) with the same signatures.
        self._cluster = client
        self._client = client  # type: ignore[assignment]
        self._settings("redis+cluster", name, password, prefix, ttl, chunk_size, parallel, timeout, reader)
        self._refreshing("redis+cluster", refresh_on_hit)

    @classmethod
    async def from_url(cls, url: StoreURL) -> RedisClusterBackend:
        opts = url.options(cls.params)
        if not url.hosts:
            raise ConfigError(
                "redis+cluster:// URL names no node, e.g. redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
            )
        if url.path.strip("/"):
            raise ConfigError("redis+cluster:// URL: a cluster has only database 0; drop the path")
        client = _Cluster(
            startup_nodes=[
                ClusterNode(host or "localhost", port or DEFAULT_PORT) for host, port in url.hosts
            ],
            username=url.username,
            password=url.password,
            max_connections=opts["max_connections"],
            socket_timeout=opts["timeout"],
            socket_connect_timeout=opts["timeout"],
            # Backoff between re-sends after a node failure: short, the whole call is bounded by timeout.
            retry=Retry(EqualJitterBackoff(cap=0.1, base=0.005), opts["retries"]),
        )
        backend = cls(
            client,
            name=redact(url.raw),
            password=url.password,
            prefix=opts["prefix"],
            ttl=opts["ttl"],
            chunk_size=opts["chunk_size"],
            parallel=opts["parallel"],
            timeout=opts["timeout"],
            reader=_NodeReaders(
                client, username=url.username, password=url.password, max_connections=opts["max_connections"]
            )
            if opts["fast_read"]
            else None,
            refresh_on_hit=opts["refresh_on_hit"],
        )
        if opts["check"] or opts["removals"] is not Removals.OFF:  # the listeners need the masters now
            try:
                async with backend._guard("connect"):
                    await client.initialize()
            except BaseException:
                await backend.close()
                raise
        backend._listen(opts, [(cls._node_kwargs(node, url, opts), 0) for node in client.get_primaries()])
        return backend

    @staticmethod
    def _node_kwargs(node: ClusterNode, url: StoreURL, opts: dict[str, Any]) -> dict[str, Any]:
        """redis-py connection arguments of one node (its removal listener's own connection)."""
        return {
            "host": node.host,
            "port": int(node.port),
            "username": url.username,
            "password": url.password,
            "socket_timeout": opts["timeout"],
            "socket_connect_timeout": opts["timeout"],
            "connection_class": Connection,
        }

    @contextlib.asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        """The base boundary, plus the cluster's own failure states (no reachable owner for a slot)."""
        async with super()._guard(what):
            try:
                yield
            except _UNAVAILABLE as exc:
                # Some of these are not RedisError subclasses; the base clause adds store and call names.
                raise BackendUnavailable(self._scrub(exc)) from None

    async def _drop_connections(self) -> None:
        for node in self._cluster.get_nodes():
            with contextlib.suppress(Exception):
                await node.disconnect()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._generation != fork_generation():  # a forked child: the sockets are the parent's
            keep_inherited(self)
            return
        await self._close_listeners()
        if self._reader is not None:
            await self._reader.close()
        with contextlib.suppress(rexc.RedisError, OSError):
            await self._cluster.aclose()

    def held(self) -> dict[str, int]:
        """``connected`` and ``in_use`` over every node's pool and raw reader (tests count both to zero)."""
        connected = in_use = 0
        for node in self._cluster.get_nodes():
            node_connected, node_in_use = pool_counts(node)
            connected += node_connected
            in_use += node_in_use
        out = {"connected": connected, "in_use": in_use}
        if self._reader is not None:
            raw = self._reader.held()
            out = {k: v + raw[k] for k, v in out.items()}
        return self._listeners_held(out)


def _redirected(exc: ReplyError) -> bool:
    """A reply error redis-py's cluster client resolves (the key moved, or the cluster is settling)."""
    return str(exc).split(" ", 1)[0] in ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")
