"""``redis://``, ``rediss://`` (TLS) and ``unix://`` stores on redis-py's asyncio client (hiredis parser).

URLs::

    redis://[[user]:password@]host[:port][/db][?prefix=vllm:&ttl=1h&chunk_size=1MiB&timeout=2s]
    rediss://host:6380/0?tls_ca=/etc/ca.pem[&tls_cert=...&tls_key=...&tls_check_hostname=false]
    unix:///run/redis.sock?db=0

Layout (see ``layout``): one Redis key per value, so ``maxmemory`` eviction removes a
value whole. Small values are strings; large ones a hash of a manifest and versioned chunk fields, replaced
in one MULTI/EXEC (``UNLINK``, ``HSET``). Readers follow the manifest, retry once when a chunk has gone (a
newer write, or the value was evicted), and otherwise report a miss -- never a torn value.

Speed: on plain TCP and unix sockets a chunked put is one hand-built ``MULTI ... EXEC`` written over a raw
connection as memoryviews of the tensor (``writer``); elsewhere redis-py is handed the
same memoryviews, which it sends without joining them. The get path fetches one value's chunks over up to
``parallel`` connections at once, on plain TCP and unix sockets through
``reader.ChunkReader``, which receives each chunk straight into its own buffer (redis-py
and hiredis copy every byte six times before the codec's copy; measured in docs/redis.md) -- and, for
:meth:`RedisBackend.get_into`, straight into the caller's tensor, with no buffer per read.
Every call is bounded by ``timeout``; redis-py's errors are translated here, in :meth:`RedisBackend._guard`,
and never carry the password.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine, Iterable, Sequence
from typing import Any, ClassVar, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.connection import (
    BlockingConnectionPool,
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from asyncconn._deprecated import renamed_method
from asyncconn.backend import (
    Buffer,
    Sink,
    StorageBackend,
    Value,
    checked_dests,
    checked_items,
    checked_keys,
    feed_sink,
)
from asyncconn.exceptions import AsyncConnError, BackendError, BackendTimeout, BackendUnavailable, ConfigError
from asyncconn.runtime import fork_generation, forked_error, keep_inherited
from asyncconn.url import Param, StoreURL, redact

from .layout import (
    MANIFEST_FIELD,
    MANIFEST_SIZE,
    Manifest,
    chunk_fields,
    chunks_complete,
    fetch_groups,
    fill,
    main_key,
    new_version,
    split_value,
)
from .reader import ChunkReader, ReplyError
from .removals import RemovalListener, Removals, parse_removals
from .sockets import open_tcp, open_unix
from .writer import chunked_write

log = logging.getLogger(__name__)

__all__ = ["RedisBackend"]

T = TypeVar("T")

DEFAULT_PORT = 6379
#: Writes want few large chunks, reads several to fetch in parallel: 1 MiB is the compromise between
#: the two for values of a few MiB (a KV block or an embedding).
DEFAULT_CHUNK_SIZE = 1 << 20
_TLS_PARAMS = ("tls_ca", "tls_cert", "tls_key", "tls_check_hostname")


def _db_number(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError("must be >= 0")
    return value


class RedisBackend(StorageBackend):
    """A redis-py connection pool behind the batch contract; one instance per store URL, used on one loop."""

    params: ClassVar[dict[str, Param]] = {
        "prefix": Param.text(
            "", "start of every Redis key name, outside the braced key (a connector's key_prefix is inside)"
        ),
        "ttl": Param.duration(0.0, "expiry of everything written (0: never expires)"),
        "refresh_on_hit": Param.boolean(
            False, "a read re-arms the value's ttl in its own round trip (GETEX, or PEXPIRE beside the read)"
        ),
        "chunk_size": Param.size(DEFAULT_CHUNK_SIZE, "values above this are split into chunks of this size"),
        "parallel": Param.count(4, "connections one value's chunks are fetched over at once"),
        "max_connections": Param.count(16, "pool size; callers wait for a free connection"),
        "timeout": Param.duration(
            5.0, "bound on every call, connecting included (with store_timeout: the smaller wins)"
        ),
        "db": Param(_db_number, None, "database number (unix:// URLs; redis:// may give it as the path)"),
        "check": Param.boolean(True, "PING when opening, so a wrong address or password fails at once"),
        "fast_read": Param.boolean(
            True, "read chunks into their buffers, and write chunked values, over raw sockets (not TLS)"
        ),
        "removals": Param(
            parse_removals,
            Removals.OFF,
            "report the server's own expiry and eviction to on_removed (KV events' BlockRemoved): off, "
            "listen (keyspace notifications as the server is set), enable (also CONFIG SET the flags)",
        ),
        "tls_ca": Param.text(None, "rediss://: CA bundle that signed the server certificate"),
        "tls_cert": Param.text(None, "rediss://: client certificate (mutual TLS)"),
        "tls_key": Param.text(None, "rediss://: client private key (mutual TLS)"),
        "tls_check_hostname": Param.boolean(True, "rediss://: check the certificate names the host"),
    }

    #: Chunk reads land in the caller's memory (through the fast reader; redis-py reads fall back to a copy).
    reads_into: ClassVar[bool] = True
    #: A cancelled read closes its connection before it returns (``reader``: nothing lands after that; the
    #: redis-py fallback copies only once the reply is in), so a CPU engine's loads land in place.
    cancellable_reads: ClassVar[bool] = True
    #: AUTH with ``url.password`` (from the URL, ``password_env`` or ``password_file``).
    takes_password: ClassVar[bool] = True

    def __init__(
        self,
        pool: BlockingConnectionPool,
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
        self._pool = pool
        self._client = aioredis.Redis(connection_pool=pool)
        self._settings("redis", name, password, prefix, ttl, chunk_size, parallel, timeout, reader)
        self._refreshing("redis", refresh_on_hit)
        # A single server: chunked writes can take the reader's raw connections too (a cluster cannot).
        self._writer: ChunkReader | None = reader

    def _refreshing(self, scheme: str, refresh_on_hit: bool) -> None:
        if refresh_on_hit and self._px is None:
            raise ConfigError(f"{scheme}:// URL: parameter 'refresh_on_hit' needs a ttl")
        self.refresh_on_hit = refresh_on_hit
        self._getex = True  # the server takes GETEX (Redis 6.2+): found otherwise on the first refused one

    def _settings(
        self,
        scheme: str,
        name: str,
        password: str | None,
        prefix: str,
        ttl: float,
        chunk_size: int,
        parallel: int,
        timeout: float,
        reader: ChunkReader | None,
    ) -> None:
        """The state every Redis flavour shares, whatever client it talks through."""
        if chunk_size <= 0:
            raise ConfigError(f"{scheme}:// URL: parameter 'chunk_size' must be > 0")
        self.name = name
        self._password = password
        self.prefix = prefix
        self.ttl = ttl
        self._px = max(1, round(ttl * 1000)) if ttl > 0 else None
        self.chunk_size = chunk_size
        self.parallel = parallel
        self.timeout = timeout
        self._reader = reader
        self._writer = None
        self._listeners: list[RemovalListener] = []  # the server's own removals (``removals``)
        self._closed = False
        self._generation = fork_generation()
        self._pid = os.getpid()

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    async def from_url(cls, url: StoreURL) -> RedisBackend:
        opts = url.options(cls.params)
        name = redact(url.raw)
        kwargs = cls._connection_kwargs(url, opts)
        pool = BlockingConnectionPool(
            max_connections=opts["max_connections"], timeout=opts["timeout"], **kwargs
        )
        backend = cls(
            pool,
            name=name,
            password=url.password,
            prefix=opts["prefix"],
            ttl=opts["ttl"],
            chunk_size=opts["chunk_size"],
            parallel=opts["parallel"],
            timeout=opts["timeout"],
            reader=cls._chunk_reader(url, opts, kwargs) if opts["fast_read"] else None,
            refresh_on_hit=opts["refresh_on_hit"],
        )
        if opts["check"]:
            try:
                async with backend._guard("connect"):
                    await backend._client.ping()
            except BaseException:
                await backend.close()
                raise
        backend._listen(opts, [(kwargs, kwargs["db"])])
        return backend

    def _listen(self, opts: dict[str, Any], servers: list[tuple[dict[str, Any], int]]) -> None:
        """With ``removals``: one listener per server (connection arguments, database) on this loop."""
        if opts["removals"] is Removals.OFF:
            return
        for kwargs, db in servers:
            listener = RemovalListener(
                kwargs,
                db=db,
                prefix=opts["prefix"],
                mode=opts["removals"],
                hook=lambda: self.on_removed,
                name=self.name,
            )
            listener.start()
            self._listeners.append(listener)

    @staticmethod
    def _chunk_reader(url: StoreURL, opts: dict[str, Any], kwargs: dict[str, Any]) -> ChunkReader | None:
        """The raw-socket chunk reader for plain TCP and unix sockets (TLS reads stay on redis-py)."""
        if url.scheme == "redis":
            host, port = kwargs["host"], kwargs["port"]

            def connect(factory: Callable[[], Any]) -> Any:
                return open_tcp(host, port, factory)
        elif url.scheme == "unix":
            path = kwargs["path"]

            def connect(factory: Callable[[], Any]) -> Any:
                return open_unix(path, factory)
        else:
            return None
        return ChunkReader(
            connect,
            username=url.username,
            password=url.password,
            db=kwargs["db"],
            max_connections=opts["max_connections"],
        )

    @staticmethod
    def _connection_kwargs(url: StoreURL, opts: dict[str, Any]) -> dict[str, Any]:
        """Translate the URL into redis-py connection arguments (one place, so every scheme agrees)."""
        if len(url.hosts) > 1:
            raise ConfigError(f"{url.scheme}:// URL names several hosts; use redis+cluster:// for a cluster")
        given_tls = [p for p in _TLS_PARAMS if p in url.query]
        if given_tls and url.scheme != "rediss":
            raise ConfigError(f"{url.scheme}:// URL: parameter {given_tls[0]!r} needs a rediss:// URL")
        kwargs: dict[str, Any] = {
            "username": url.username,
            "password": url.password,
            "socket_timeout": opts["timeout"],
            "socket_connect_timeout": opts["timeout"],
            # One immediate retry on a dropped connection: the first command after a server restart meets
            # a dead pooled socket, and reconnecting once is what recovers it. Timeouts are not retried.
            "retry": Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
        }
        db = opts["db"]
        if url.scheme == "unix":
            if not url.path:
                raise ConfigError("unix:// URL needs a socket path, e.g. unix:///run/redis.sock?db=0")
            kwargs.update(connection_class=UnixDomainSocketConnection, path=url.path, db=db or 0)
            return kwargs
        path_db = url.path.strip("/")
        if path_db:
            try:
                from_path = _db_number(path_db)
            except ValueError:
                raise ConfigError(f"{url.scheme}:// URL: bad database {path_db!r} in the path") from None
            if db is not None and db != from_path:
                raise ConfigError(f"{url.scheme}:// URL: database given as /{from_path} and as db={db}")
            db = from_path
        kwargs.update(host=url.host or "localhost", port=url.port or DEFAULT_PORT, db=db or 0)
        if url.scheme == "rediss":
            kwargs.update(
                connection_class=SSLConnection,
                ssl_ca_certs=opts["tls_ca"],
                ssl_certfile=opts["tls_cert"],
                ssl_keyfile=opts["tls_key"],
                ssl_check_hostname=opts["tls_check_hostname"],
            )
        else:
            kwargs["connection_class"] = Connection
        return kwargs

    # -- error boundary --------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _guard(self, what: str) -> AsyncIterator[None]:
        """Bound a call by ``timeout`` and translate everything redis-py or the OS raises.

        A pool inherited through ``fork()`` is never used (its sockets are the parent's: replies would
        interleave). Anything else a client raises -- a ``TypeError``/``ValueError`` from a reply that is not
        the one expected, i.e. a connection out of step -- becomes a :class:`BackendError`, and every pooled
        connection is dropped, so none that may be out of step is used again.
        """
        if self._generation != fork_generation():
            raise forked_error(f"store {self.name}", self._pid)
        if self._closed:
            raise BackendUnavailable(f"{self.name}: backend is closed")
        try:
            async with asyncio.timeout(self.timeout):
                yield
        except (TimeoutError, rexc.TimeoutError):
            raise BackendTimeout(f"{self.name}: {what} did not finish within {self.timeout:g}s") from None
        except rexc.AuthenticationError as exc:
            raise BackendUnavailable(f"{self.name}: authentication failed ({self._scrub(exc)})") from None
        except rexc.ResponseError as exc:
            text = self._scrub(exc)
            if text.startswith(("NOAUTH", "WRONGPASS", "NOPERM")):
                raise BackendUnavailable(f"{self.name}: authentication failed ({text})") from None
            raise BackendError(f"{self.name}: {what} failed: {text}") from None
        except (rexc.ConnectionError, OSError) as exc:
            raise BackendUnavailable(f"{self.name}: {what} failed: {self._scrub(exc)}") from None
        except rexc.RedisError as exc:
            raise BackendError(f"{self.name}: {what} failed: {self._scrub(exc)}") from None
        except BackendError as exc:  # from the chunk reader: already ours, add which store and call
            raise type(exc)(f"{self.name}: {what} failed: {self._scrub(exc)}") from None
        except AsyncConnError:
            raise
        except Exception as exc:
            await self._drop_connections()
            raise BackendError(
                f"{self.name}: {what} failed: unexpected {type(exc).__name__} ({self._scrub(exc)}); "
                "connections dropped"
            ) from None

    async def _drop_connections(self) -> None:
        """Disconnect every pooled connection (idle and lent): the next command opens a fresh one."""
        with contextlib.suppress(Exception):
            await self._pool.disconnect(inuse_connections=True)

    def _scrub(self, exc: BaseException) -> str:
        text = str(exc) or type(exc).__name__
        if self._password:
            text = text.replace(self._password, "***")
        return text

    # -- contract --------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        """Inline values of the batch in one pipeline; each chunked value in its own transaction, at once."""
        checked_items(items)
        async with self._guard("put"):
            inline: list[tuple[str, memoryview | bytes]] = []
            jobs: list[Coroutine[Any, Any, None]] = []
            for key, value in items:
                whole, chunks = split_value(value, self.chunk_size)
                if chunks is None:
                    assert whole is not None
                    inline.append((key, whole))
                else:
                    jobs.append(self._put_chunked(key, chunks))
            if inline:
                jobs.append(self._put_inline(inline))
            await _gather(jobs)

    async def _put_inline(self, items: list[tuple[str, memoryview | bytes]]) -> None:
        # No MULTI needed: each SET is atomic on its own and replaces whatever the key held (a chunked
        # value's hash included), so nothing else has to land with it.
        async with self._client.pipeline(transaction=False) as pipe:
            for key, value in items:
                pipe.set(main_key(self.prefix, key), value, px=self._px)
            results = await pipe.execute(raise_on_error=False)
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise failed

    async def _put_chunked(self, key: str, chunks: list[memoryview]) -> None:
        """Replace the key with a hash of the manifest and every chunk, in one transaction."""
        head = main_key(self.prefix, key)
        manifest = Manifest(new_version(), len(chunks), sum(c.nbytes for c in chunks))
        fields = chunk_fields(manifest)
        if self._writer is not None:
            job = chunked_write(head, manifest.pack(), fields, chunks, px=self._px)
            replies = await self._writer.execute(job.payload, job.replies, MANIFEST_SIZE)
            if len(replies) != job.items or replies[-1] is None:  # e.g. a nil EXEC: nothing was written
                raise BackendError(f"unexpected reply to a chunked write: {len(replies)} items")
            return
        mapping: dict[str, bytes | memoryview] = {MANIFEST_FIELD: manifest.pack()}
        mapping.update(zip(fields, chunks, strict=True))
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.execute_command("UNLINK", head)  # (a cluster client would split pipe.unlink across slots)
            pipe.hset(head, mapping=mapping)  # type: ignore[arg-type]  # redis-py sends memoryviews as they are
            if self._px is not None:
                pipe.pexpire(head, self._px)
            results = await pipe.execute(raise_on_error=False)
        failed = next((r for r in results if isinstance(r, Exception)), None)
        if failed is not None:
            raise failed

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        async with self._guard("get"):
            return await self._get(keys, retry=True)

    async def _get(self, keys: Sequence[str], *, retry: bool) -> list[Sequence[Buffer] | None]:
        heads = await self._heads([main_key(self.prefix, k) for k in keys])
        out: list[Sequence[Buffer] | None] = []
        chunked: list[tuple[int, str, Manifest]] = []
        for index, (key, head) in enumerate(zip(keys, heads, strict=True)):
            if isinstance(head, Manifest):
                out.append(None)
                chunked.append((index, main_key(self.prefix, key), head))
            else:
                out.append((head,) if head is not None else None)
        if not chunked:
            return out
        fetched = await _gather(self._fetch(name, manifest) for _, name, manifest in chunked)
        again: list[int] = []
        for (index, _, manifest), chunks in zip(chunked, fetched, strict=True):
            if chunks_complete(chunks, manifest):
                out[index] = chunks  # type: ignore[assignment]  # all present, checked just above
            else:
                again.append(index)
        if again and retry:
            # A chunk went missing under us: a newer write replaced the value, or it was evicted (whole).
            # The key now holds the new value (or nothing); follow it once. A second loss is a miss.
            retried = await self._get([keys[i] for i in again], retry=False)
            for index, value in zip(again, retried, strict=True):
                out[index] = value
        return out

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        """Land one value straight in ``dests``: each chunk is received into its place (one copy in all).

        Why: going through :meth:`get` allocates a fresh buffer per chunk and copies it into the
        destination afterwards; with 1 MiB chunks glibc hands that memory back to the kernel between reads,
        so every read page-faulted its memory in again and gets fell far behind ``redis-benchmark``
        (``asyncconn bench backend`` compares the two: docs/benchmarks.md). The chunk boundaries are
        predicted with :func:`split_value` over ``dests`` -- the cut the writer made of the same frame
        parts -- and every reply's length is checked against its slot. A value written with another
        ``chunk_size`` falls back to :meth:`get` and a copy; a lost chunk follows the new manifest once, as
        :meth:`get` does.
        """
        checked_dests(key, dests)
        if self._reader is None:
            return await super().get_into(key, dests, sink)
        targets = [d.cast("B") for d in dests]
        size = sum(t.nbytes for t in targets)
        async with self._guard("get"):
            landed = await self._land(key, targets, size)
            if landed is _Landing.LOST:  # replaced by a newer write (or evicted): follow the key once more
                landed = await self._land(key, targets, size)
        if landed is _Landing.LOST:
            return None
        if landed is _Landing.MISMATCH:
            return await super().get_into(key, dests, sink)
        if landed == size and sink is not None:
            feed_sink(sink, targets)
        return landed

    async def _land(self, key: str, targets: list[memoryview], size: int) -> int | _Landing | None:
        """One attempt of :meth:`get_into`: the value's length (landed when it is ``size``), or a miss."""
        name = main_key(self.prefix, key)
        if size <= self.chunk_size:
            landed = await self._land_inline(name, targets, size)
            if landed is not None:
                return landed
        (head,) = await self._heads([name])
        if head is None:
            return None
        if not isinstance(head, Manifest):  # an inline value (or a foreign one: the frame check rejects it)
            if len(head) == size:
                fill(targets, head)
            return len(head)
        manifest = head
        if manifest.total != size:
            return manifest.total
        _, slots = split_value(targets, self.chunk_size)
        if slots is None or len(slots) != manifest.count:
            return _Landing.MISMATCH
        fields = chunk_fields(manifest)
        bounds = fetch_groups([slot.nbytes for slot in slots], self.parallel)
        assert self._reader is not None
        reader = self._reader
        parts = await _gather(
            reader.hmget_into(name, fields[a:b], slots[a:b], manifest.total)
            for a, b in itertools.pairwise(bounds)
        )
        replies = [reply for part in parts for reply in part]
        if any(reply is None for reply in replies):
            return _Landing.LOST
        if any(reply is not slot for reply, slot in zip(replies, slots, strict=True)):
            return _Landing.MISMATCH
        return size

    async def _land_inline(self, name: str, targets: list[memoryview], size: int) -> int | None:
        """A value the writer stored inline (``size`` <= ``chunk_size``), received straight into ``targets``
        with one ``GET``: its length, or None when the key holds no string (absent, or a chunked value
        written with a smaller ``chunk_size``: the manifest path decides which).

        Why: going through :meth:`_heads` reads the value with redis-py (six copies, a fresh buffer per
        read) and then copies it into ``targets``; a KV block value is usually below ``chunk_size``.
        """
        assert self._reader is not None
        slot, largest = tuple(targets), max(size, self.chunk_size)
        refreshed = self.refresh_on_hit and self._getex
        if refreshed:
            try:
                got = await self._reader.getex_into(name, slot, largest, self._px)  # type: ignore[arg-type]  # set whenever refresh_on_hit is
            except ReplyError as exc:
                if not str(exc).startswith("ERR unknown command"):
                    raise
                self._getex = refreshed = False  # a server before 6.2: a PEXPIRE after each read instead
                (got,) = await self._reader.mget_into([name], [slot], largest)
        else:
            (got,) = await self._reader.mget_into([name], [slot], largest)
        if got is None:
            return None
        if not isinstance(got, tuple):  # not received in place (a cluster redirection read it via redis-py)
            if len(got) != size:
                return len(got)  # a string of another length: not this frame (the store reports it)
            fill(targets, got)
            refreshed = False  # redis-py's read did not re-arm it
        if not refreshed:
            await self._refresh([name])
        return size

    async def _refresh(self, names: list[str]) -> None:
        """Re-arm the ttl of values read on the fast path (``refresh_on_hit``), in one round trip."""
        if not self.refresh_on_hit or not names:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.pexpire(name, self._px)  # type: ignore[arg-type]  # set whenever refresh_on_hit is
            await pipe.execute(raise_on_error=False)

    async def _heads(self, names: list[str]) -> list[bytes | Manifest | None]:
        """What each key holds, in one round trip: an inline value, a chunked value's manifest, or nothing.

        ``GET`` and ``HGET <key> m`` of every key, pipelined: one of the two answers ``WRONGTYPE`` for a key
        that exists. A hash whose manifest is missing or not ours, and a key of any other type, are absent.
        With ``refresh_on_hit`` a ``PEXPIRE`` of each key rides in the same round trip (a no-op on a miss):
        the value is one key, so that re-arms every chunk of it at once.
        """
        step = 3 if self.refresh_on_hit else 2
        async with self._client.pipeline(transaction=False) as pipe:
            for name in names:
                pipe.get(name)
                pipe.hget(name, MANIFEST_FIELD)
                if step == 3:
                    pipe.pexpire(name, self._px)  # type: ignore[arg-type]  # set whenever refresh_on_hit is
            replies = await pipe.execute(raise_on_error=False)
        out: list[bytes | Manifest | None] = []
        for value, manifest in zip(replies[::step], replies[1::step], strict=True):
            for reply in (value, manifest):
                if isinstance(reply, Exception) and not str(reply).startswith("WRONGTYPE"):
                    raise reply
            if isinstance(value, bytes):
                out.append(value)
            elif isinstance(manifest, bytes):
                out.append(Manifest.parse(manifest))
            else:
                out.append(None)
        return out

    async def _fetch(self, name: str, manifest: Manifest) -> list[bytes | bytearray | None]:
        """``HMGET`` a value's chunk fields split into up to ``parallel`` groups, each on its own connection.

        No chunk can be longer than the manifest's total: the fast reader refuses a longer reply rather
        than allocate what a damaged or hostile server declares.
        """
        fields = chunk_fields(manifest)
        groups = min(self.parallel, len(fields))
        bounds = [len(fields) * g // groups for g in range(groups + 1)]
        parts = await _gather(
            self._fetch_group(name, fields[a:b], manifest.total) for a, b in itertools.pairwise(bounds)
        )
        return [value for part in parts for value in part]

    async def _fetch_group(
        self, name: str, fields: list[str], largest: int
    ) -> list[bytes | bytearray | None]:
        if self._reader is not None:
            return await self._reader.hmget(name, fields, largest)
        # redis-py types replies as bytes | str; with decode_responses off (never turned on here) it is bytes.
        values: list[bytes | None] = await self._client.hmget(name, fields)  # type: ignore[assignment]
        return list(values)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        checked_keys(keys)
        async with self._guard("exists"), self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(main_key(self.prefix, key))
            counts = await pipe.execute()
        return [bool(c) for c in counts]

    async def delete(self, keys: Sequence[str]) -> int:
        checked_keys(keys)
        async with self._guard("delete"):
            if not keys:
                return 0
            # One key per value, whatever its type: the server frees a chunked value off its main thread.
            return int(await self._client.unlink(*(main_key(self.prefix, k) for k in keys)))

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
        await self._client.aclose()
        await self._pool.disconnect()

    # -- introspection (tests count these back to zero) ------------------------------------------------
    counters = renamed_method("counters", "held")  # the old name, deprecated (docs/transfer.md)

    def held(self) -> dict[str, int]:
        """Connections held now: ``connected`` (pooled ones holding an open socket) and ``in_use`` (lent out).

        Tests count both back to zero; redis-py's public ``get_connection_count`` also counts connection
        objects whose socket is already closed, so the pool's lists are read directly.
        """
        pool = self._pool
        every = [*pool._available_connections, *pool._in_use_connections]
        out = {"connected": sum(c.is_connected for c in every), "in_use": len(pool._in_use_connections)}
        if self._reader is not None:
            raw = self._reader.held()
            out = {k: v + raw[k] for k, v in out.items()}
        return self._listeners_held(out)

    def _listeners_held(self, out: dict[str, int]) -> dict[str, int]:
        """``out`` plus the removal listeners' open connections and ``listener_tasks`` (with ``removals``)."""
        if self._listeners:
            out["listener_tasks"] = 0
        for listener in self._listeners:
            held = listener.held()
            out["connected"] += held["connected"]
            out["listener_tasks"] += held["listener_tasks"]
        return out

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            await listener.close()


class _Landing(enum.Enum):
    """Why a direct read did not land: a chunk vanished, or the chunks are not cut where we expected."""

    LOST = "lost"
    MISMATCH = "mismatch"


async def _gather(coros: Iterable[Coroutine[Any, Any, T]]) -> list[T]:
    """Run coroutines concurrently; on the first failure cancel the rest and wait for them (no orphans)."""
    pending = list(coros)
    if len(pending) == 1:
        return [await pending[0]]
    tasks: list[asyncio.Task[T]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in pending]
    except BaseExceptionGroup as failures:
        raise failures.exceptions[0] from None
    return [t.result() for t in tasks]
