"""``mooncake://`` stores: a Mooncake distributed store through ``mooncake.store.MooncakeDistributedStore``.

URL::

    mooncake://master-host:50051?metadata=http://meta-host:8080/metadata[&protocol=tcp&segment=512MiB&...]

The host names the ``mooncake_master`` RPC address; ``metadata`` the transfer engine's metadata server
(``mooncake_master --enable_http_metadata_server=true`` serves one, or a separate
``mooncake_http_metadata_server`` / etcd). Every parameter is in :attr:`MooncakeBackend.params` and
docs/distributed.md. Install with ``pip install 'asyncconn[mooncake]'`` (Debian also needs
``libibverbs1``, even for TCP).

Threads: the store's calls block (they release the GIL). They run on a small thread pool owned by this
backend (``workers`` threads), never on the loop thread; a call that times out returns at once, except a
put or a read into caller memory, which waits for Mooncake to let go of that memory first (no buffer is
read or written after the call that was given it has returned).

Layout (:mod:`backends._mooncake_layout`): one Mooncake object per value, a 24-byte header (length and
an xxh3 of the value, so a read that raced an upsert is caught and re-read) then the bytes.
``put`` is Mooncake's ``upsert`` (insert or replace); ``get_into`` reads header and value straight into the
caller's buffers in one request (``batch_get_into_multi_buffers``: no intermediate copy); ``exists`` is one
``batch_is_exist``. An object that vanished, was evicted, or whose transfer outlived its lease is a miss,
never a partial value. Writes that meet a busy object or a full pool are retried until ``timeout``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

from asyncconn.backend import Buffer, Sink, StorageBackend, Value
from asyncconn.exceptions import (
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
)
from asyncconn.url import Param, StoreURL, redact
from backends._mooncake_layout import (
    HEADER_SIZE,
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    TRANSFER_FAIL,
    checksum,
    classify,
    code_name,
    pack_header,
    parse_header,
)

log = logging.getLogger(__name__)

__all__ = ["MooncakeBackend"]

T = TypeVar("T")

DEFAULT_MASTER_PORT = 50051
#: First pause between write retries (doubled up to 20 ms): long enough for a racing upsert to finish.
_RETRY_PAUSE = 0.001


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _client_environment(hostname: str, timeout: float) -> None:
    """Set the Mooncake client's environment knobs that bound its blocking calls (unless already set).

    Why: the client reads them from the environment at ``setup()``, process-wide. Without an RPC timeout a
    call to a frozen master blocks its thread for ~30 s, and a read into caller memory cannot return
    before it does; without the setup bound a wrong master address blocks ``setup()`` for ~90 s (both
    measured). The first backend opened in a process sets them; an operator's own values always win.
    """
    millis = str(max(100, round(timeout * 1000)))
    os.environ.setdefault("MC_RPC_TIMEOUT_MS", millis)
    os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", millis)
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")
    if _is_loopback(hostname):
        # Without it the transfer engine advertises the first non-loopback address it finds.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")


def _address(buffer: memoryview) -> int:
    """The address of a writable buffer's first byte (the ctypes view keeps the export alive meanwhile)."""
    return ctypes.addressof((ctypes.c_char * buffer.nbytes).from_buffer(buffer))


class MooncakeBackend(StorageBackend):
    """One Mooncake client (and the memory segment it contributes) behind the batch contract."""

    params: ClassVar[dict[str, Param]] = {
        "metadata": Param.text(
            None, "transfer-engine metadata server, e.g. http://host:8080/metadata (required)"
        ),
        "protocol": Param.text("tcp", "transfer protocol: tcp, or rdma with rdma_devices"),
        "rdma_devices": Param.text("", "RDMA NICs to use (protocol=rdma), comma-separated"),
        "segment": Param.size(512 << 20, "memory this client contributes to the distributed pool (0: none)"),
        "buffer": Param.size(256 << 20, "client-local transfer buffer: bounds the largest value put or got"),
        "local_hostname": Param.text(
            None, "address this client advertises to peers (default: 127.0.0.1 for a loopback master)"
        ),
        "prefix": Param.text("", "prepended to every key (tenants / models sharing one pool)"),
        "replicas": Param.count(1, "copies Mooncake keeps of each value"),
        "workers": Param.count(4, "threads running the store's blocking calls"),
        "timeout": Param.duration(5.0, "bound on every call, write retries included"),
    }

    def __init__(
        self,
        store: Any,
        pool: concurrent.futures.ThreadPoolExecutor,
        *,
        name: str,
        prefix: str = "",
        replicas: int = 1,
        timeout: float = 5.0,
        buffer: int = 256 << 20,
    ) -> None:
        self._store = store
        self.buffer = buffer
        self._pool = pool
        self.name = name
        self.prefix = prefix
        self.timeout = timeout
        self._replicate = self._replicate_config(replicas)
        self._closed = False
        self._jobs: set[concurrent.futures.Future[Any]] = set()  # submitted, not yet finished

    # -- construction ----------------------------------------------------------------------------------
    @classmethod
    async def from_url(cls, url: StoreURL) -> MooncakeBackend:
        opts = url.options(cls.params)
        if not opts["metadata"]:
            raise ConfigError(
                "mooncake:// URL: parameter 'metadata' is required (e.g. http://host:8080/metadata)"
            )
        if opts["protocol"] not in ("tcp", "rdma"):
            raise ConfigError(
                f"mooncake:// URL: bad value {opts['protocol']!r} for parameter 'protocol' (tcp, rdma)"
            )
        if not url.host or len(url.hosts) > 1:
            raise ConfigError("mooncake:// URL names one master, e.g. mooncake://10.0.0.1:50051?metadata=...")
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            hint = "install it with: pip install 'asyncconn[mooncake]'"
            raise BackendNotInstalled(f"mooncake:// needs the Mooncake client ({exc}); {hint}") from exc
        master = f"{url.host}:{url.port or DEFAULT_MASTER_PORT}"
        hostname = opts["local_hostname"] or ("127.0.0.1" if _is_loopback(url.host) else socket.gethostname())
        _client_environment(hostname, opts["timeout"])
        name = redact(url.raw)
        pool = concurrent.futures.ThreadPoolExecutor(opts["workers"], thread_name_prefix="asyncconn-mooncake")
        store = MooncakeDistributedStore()
        backend = cls(
            store,
            pool,
            name=name,
            prefix=opts["prefix"],
            replicas=opts["replicas"],
            timeout=opts["timeout"],
            buffer=opts["buffer"],
        )
        setup_args = (
            hostname,
            opts["metadata"],
            opts["segment"],
            opts["buffer"],
            opts["protocol"],
            opts["rdma_devices"],
            master,
        )
        try:
            code = await backend._call("connect", store.setup, *setup_args)
        except BaseException:
            await backend.close()
            raise
        if code != 0:
            await backend.close()
            raise BackendUnavailable(f"{name}: connect failed: setup returned {code_name(code)}")
        return backend

    @staticmethod
    def _replicate_config(replicas: int) -> Any:
        from mooncake.store import ReplicateConfig

        config = ReplicateConfig()
        config.replica_num = replicas
        return config

    # -- the thread boundary ---------------------------------------------------------------------------
    async def _call(self, what: str, fn: Callable[..., T], *args: Any, uses_caller_memory: bool = False) -> T:
        """Run one blocking store call on the pool, bounded by ``timeout``; translate what it raises.

        With ``uses_caller_memory`` a call that is cancelled or times out while running still waits for
        the store to finish (shielded): it is reading or writing memory the caller gets back when we
        return (a tensor being saved, a destination being filled), which must not be touched after that.
        """
        if self._closed:
            raise BackendUnavailable(f"{self.name}: backend is closed")
        try:
            job = self._pool.submit(fn, *args)
        except RuntimeError:  # the pool was shut down by close() meanwhile
            raise BackendUnavailable(f"{self.name}: backend is closed") from None
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        try:
            async with asyncio.timeout(self.timeout):
                return await asyncio.wrap_future(job)
        except TimeoutError:
            if uses_caller_memory:
                await _outlast(job)
            raise BackendTimeout(f"{self.name}: {what} did not finish within {self.timeout:g}s") from None
        except asyncio.CancelledError:
            if uses_caller_memory:
                await _outlast(job)
            raise
        except (RuntimeError, OSError, ValueError, TypeError) as exc:  # what pybind11 turns C++ errors into
            raise BackendError(f"{self.name}: {what} failed: {exc}") from None

    def _fail(self, what: str, code: int) -> BackendError:
        kind = BackendUnavailable if classify(code).unavailable else BackendError
        return kind(f"{self.name}: {what} failed: {code_name(code)}")

    def _key(self, key: str) -> str:
        return self.prefix + key

    # -- contract --------------------------------------------------------------------------------------
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        """One thread hop for the batch; each value is one ``upsert`` of header + parts (not joined here)."""
        if not items:
            return
        jobs = [(self._key(key), _parts(value)) for key, value in items]
        for (_, parts), (key, _) in zip(jobs, items, strict=True):
            size = HEADER_SIZE + sum(p.nbytes for p in parts)
            if size > self.buffer:  # Mooncake stages every put through the client's transfer buffer
                raise BackendError(
                    f"{self.name}: put of {key!r} ({size} bytes) is larger than the client's transfer "
                    f"buffer ({self.buffer} bytes); raise the URL parameter 'buffer'"
                )
        deadline = time.monotonic() + self.timeout
        failed = await self._call("put", self._put_blocking, jobs, deadline, uses_caller_memory=True)
        if failed is not None:
            raise self._fail("put", failed)

    def _put_blocking(self, jobs: list[tuple[str, list[memoryview]]], deadline: float) -> int | None:
        """(pool thread) Upsert every value, retrying busy/full answers until ``deadline``; a failing code."""
        for name, parts in jobs:
            header = pack_header(sum(p.nbytes for p in parts), checksum(parts))
            pause = _RETRY_PAUSE
            while True:
                code = self._store.upsert_parts(name, header, *parts, config=self._replicate)
                if code == 0:
                    break
                if not classify(code).retry or time.monotonic() + pause > deadline:
                    return int(code)
                time.sleep(pause)
                pause = min(pause * 2, 0.02)
        return None

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        if not keys:
            return []
        return await self._call("get", self._get_blocking, [self._key(k) for k in keys])

    def _get_blocking(self, names: list[str]) -> list[Sequence[Buffer] | None]:
        """(pool thread) Each value copied out of the client's transfer buffer, which is freed at once."""
        out: list[Sequence[Buffer] | None] = []
        for name in names:
            value, state = self._get_one(name)
            if state != "ok":  # a read that raced an upsert (torn header or body) is re-read once
                value, state = self._get_one(name)
                if state == "torn":
                    log.warning("%s: %r changed under two reads in a row: a miss", self.name, name)
                    value = None
            out.append(value)
        return out

    def _get_one(self, name: str) -> tuple[Sequence[Buffer] | None, str]:
        """One read: ``(value, "ok")``, ``(None, "torn")`` or ``(whole bytes, "foreign")``.

        A value that is not ours is handed up whole (the frame check rejects it); since a torn header looks
        the same, the caller reads such a value twice before believing it.
        """
        handle = self._store.get_buffer(name)
        if handle is None:  # missing, evicted, or unreadable: the store logs which
            return None, "ok"
        view = memoryview(handle).cast("B")
        try:
            header = parse_header(view)
            if header is None or header[0] != view.nbytes - HEADER_SIZE:
                return (bytes(view),), "foreign"
            body = view[HEADER_SIZE:]
            if checksum((body,)) != header[1]:
                return None, "torn"
            return (bytearray(body),), "ok"
        finally:
            view.release()
            del handle

    #: ``get_into`` lands values in the caller's buffers through the transfer engine (no copy of ours).
    reads_into: ClassVar[bool] = True

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        """Header and value straight into ``dests`` in one request; a length mismatch touches nothing."""
        targets = [d.cast("B") for d in dests]
        size = sum(t.nbytes for t in targets)
        header = bytearray(HEADER_SIZE)
        views = [memoryview(header), *(t for t in targets if t.nbytes)]
        name = self._key(key)
        for attempt in range(2):  # a read that raced an upsert is re-read once, then a miss
            code = await self._call("get", self._get_into_blocking, name, views, uses_caller_memory=True)
            parsed = parse_header(header)
            if code != HEADER_SIZE + size or parsed is None or parsed[0] != size:
                break
            if checksum(targets) == parsed[1]:
                if sink is not None:
                    for target in targets:
                        sink(target)
                return size
            if attempt:
                log.warning("%s: %r changed under two reads in a row: a miss", self.name, key)
                return None
        if code >= 0:  # another object's bytes landed (not ours, or a length we did not expect)
            return await self._length_of(name, default=code - HEADER_SIZE)
        if code in (INVALID_PARAMS, TRANSFER_FAIL):  # Mooncake refuses a buffer of the wrong size
            return await self._length_of(name, default=None)
        if classify(code).miss:
            return None
        raise self._fail("get", code)

    def _get_into_blocking(self, name: str, views: list[memoryview]) -> int:
        (code,) = self._store.batch_get_into_multi_buffers(
            [name], [[_address(v) for v in views]], [[v.nbytes for v in views]]
        )
        return int(code)

    async def _length_of(self, name: str, *, default: int | None) -> int | None:
        """The value length stored under ``name`` (for a mismatch report), ``None`` when it is gone."""
        total = await self._call("get", self._store.get_size, name)
        if total == OBJECT_NOT_FOUND or (total < 0 and classify(total).miss):
            return None
        if total < 0:
            return default
        return max(0, int(total) - HEADER_SIZE)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        found = await self._call("exists", self._store.batch_is_exist, [self._key(k) for k in keys])
        if any(f < 0 for f in found):
            raise BackendUnavailable(f"{self.name}: exists failed for {sum(f < 0 for f in found)} key(s)")
        return [f == 1 for f in found]

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove keys, forcing past read leases (a value just read is leased for seconds by the master)."""
        if not keys:
            return 0
        codes = await self._call("delete", self._store.batch_remove, [self._key(k) for k in keys], True)
        removed = 0
        for code in codes:
            if code == 0:
                removed += 1
            elif not classify(code).miss:
                raise self._fail("delete", code)
        return removed

    async def close(self) -> None:
        """Unmount this client's segment and stop the pool's threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        # Running calls finish first (they may be writing into caller memory); then the store closes.
        await loop.run_in_executor(None, self._pool.shutdown, True)
        with contextlib.suppress(RuntimeError, OSError):
            await asyncio.to_thread(self._store.close)

    # -- introspection (tests count these back to zero) ------------------------------------------------
    def thread_count(self) -> int:
        """Live threads of this backend's pool."""
        return sum(t.is_alive() for t in self._pool._threads)

    def jobs_in_flight(self) -> int:
        """Store calls submitted to the pool and not finished (queued or running)."""
        return len(self._jobs)


def _parts(value: Value) -> list[memoryview]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        parts = [memoryview(value).cast("B")]
    else:
        parts = [memoryview(v).cast("B") for v in value]
    return [p for p in parts if p.nbytes]


async def _outlast(job: concurrent.futures.Future[Any]) -> None:
    """Wait for a running pool job to end, through further cancellation (re-raised once it has ended)."""
    if job.cancel():  # still queued: it will never run
        return
    cancelled = False
    while not job.done():
        try:
            await asyncio.shield(asyncio.wrap_future(job))
        except asyncio.CancelledError:
            cancelled = True
        except BaseException:  # its outcome does not matter any more, only that it ended
            break
    if cancelled:
        raise asyncio.CancelledError
