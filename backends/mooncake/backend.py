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

Layout (``layout``): one Mooncake object per value, a 24-byte header (length and
an xxh3 of the value, so a read that raced an upsert is caught and re-read) then the bytes. An object
without such a header (another tool's, or one a racing upsert has not written yet: all zeros) is a miss.
``put`` of a value of 4 MiB or more over TCP is a forced ``remove`` then one gathered insert straight from
the caller's buffers (``batch_put_from_multi_buffers``: no staging copy); smaller values, and every value
over RDMA (whose sources must be registered memory), are Mooncake's ``upsert_parts`` (insert or replace,
staged through the client's transfer buffer). A ``put`` of several values over TCP writes them all with
one forced ``batch_remove`` and one gathered insert. ``get_into`` reads header and value straight into the
caller's buffers in one request (``batch_get_into_multi_buffers``: no intermediate copy) and checks them on
the pool thread; ``exists`` is one ``batch_is_exist``. An object that vanished, was evicted, or whose
transfer outlived its lease is a miss, never a partial value. Writes that meet a busy object or a full
pool are retried until ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, TypeVar

import xxhash

from asyncconn.backend import (
    Buffer,
    Sink,
    StorageBackend,
    Value,
    checked_dests,
    checked_items,
    checked_keys,
    sink_verifies,
    value_verifies,
)
from asyncconn.exceptions import (
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
)
from asyncconn.url import Param, StoreURL, redact

from .layout import (
    FLAG_SELF_CHECKED,
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
from .pool import Job, Workers

log = logging.getLogger(__name__)

__all__ = ["MooncakeBackend"]

T = TypeVar("T")
#: A gathered insert's sources: addresses, sizes, and the ctypes views that keep the buffers exported.
_Sources = tuple[list[int], list[int], list[Any]]

DEFAULT_MASTER_PORT = 50051
#: First pause between write retries (doubled up to 20 ms): long enough for a racing upsert to finish.
_RETRY_PAUSE = 0.001
#: Values from this size up are written by remove + gathered insert (TCP): from about here the staging copy
#: ``upsert_parts`` makes costs more than the extra remove RPC; below it the RPC costs more (timed against
#: each other, interleaved, on the same client; ``asyncconn bench mooncake`` measures the put path).
_GATHER_MIN = 4 << 20
#: At most this many direct reads go in one request (more queued at once are split, so several workers share
#: them).
_READ_BATCH = 32
#: Read-only parts up to this size are copied to get an address for a gathered insert (frame headers).
_SMALL_PART = 64 << 10
#: A direct read is checked and handed to the caller's sink in pieces of this size, so the sink's own pass
#: over a piece finds it in cache (two passes over a large value, interleaved, are cheaper than in a row).
_PIECE = 256 << 10


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
    call to a frozen master blocks its thread for tens of seconds, and a read into caller memory cannot
    return before it does; without the setup bound a wrong master address blocks ``setup()`` for longer
    still. The first backend opened in a process sets them; an operator's own values always win.
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
        "prefix": Param.text("", "start of every object name, before the key (and a connector's key_prefix)"),
        "replicas": Param.count(1, "copies Mooncake keeps of each value"),
        "workers": Param.count(4, "threads running the store's blocking calls"),
        "timeout": Param.duration(
            5.0, "bound on every call, write retries included (with store_timeout: the smaller wins)"
        ),
    }

    def __init__(
        self,
        store: Any,
        pool: Workers,
        *,
        name: str,
        prefix: str = "",
        replicas: int = 1,
        timeout: float = 5.0,
        buffer: int = 256 << 20,
        gather_puts: bool = True,
    ) -> None:
        self._store = store
        #: Large puts straight from the caller's memory (TCP only: RDMA would need it registered).
        self.gather_puts = gather_puts
        self.buffer = buffer
        self._pool = pool
        self.name = name
        self.prefix = prefix
        self.timeout = timeout
        self._replicate = self._replicate_config(replicas)
        self._closed = False
        self._reads: _Reads | None = None  # direct reads queued in this loop iteration, not sent yet
        self._reading_now = False  # a read went out alone in this loop iteration: later ones are batched

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
        pool = Workers(opts["workers"], "asyncconn-mooncake")
        store = MooncakeDistributedStore()
        backend = cls(
            store,
            pool,
            name=name,
            prefix=opts["prefix"],
            replicas=opts["replicas"],
            timeout=opts["timeout"],
            buffer=opts["buffer"],
            gather_puts=opts["protocol"] == "tcp",
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
        job = Job(fn, args, asyncio.get_running_loop())
        if not self._pool.submit(job):  # the pool was shut down by close() meanwhile
            raise BackendUnavailable(f"{self.name}: backend is closed")
        try:
            async with asyncio.timeout(self.timeout):
                return await job.future  # type: ignore[no-any-return]
        except TimeoutError:
            if uses_caller_memory:
                await self._pool.outlast(job)
            raise BackendTimeout(f"{self.name}: {what} did not finish within {self.timeout:g}s") from None
        except asyncio.CancelledError:
            if uses_caller_memory:
                await self._pool.outlast(job)
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
        """One thread hop for the batch, whose values are written together where they can be (TCP)."""
        checked_items(items)
        if not items:
            return
        jobs = [(self._key(key), _parts(value), value_verifies(value)) for key, value in items]
        for (_, parts, _), (key, _) in zip(jobs, items, strict=True):
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

    def _put_blocking(self, jobs: list[tuple[str, list[memoryview], bool]], deadline: float) -> int | None:
        """(pool thread) Write every value, retrying busy/full answers until ``deadline``; a failing code.

        A batch of several values over TCP goes as one forced ``batch_remove`` and one gathered
        ``batch_put_from_multi_buffers`` for all of them (three RPCs, not two per value: a step's many small
        values would otherwise pay two round trips each); values that this could not write, and single
        values, are written one by one.
        """
        batched = self.gather_puts and len(jobs) > 1 and len({name for name, _, _ in jobs}) == len(jobs)
        prepared: list[tuple[str, bytes, list[memoryview], _Sources | None]] = []
        for name, parts, self_checked in jobs:
            size = sum(p.nbytes for p in parts)
            header = (
                pack_header(size, flags=FLAG_SELF_CHECKED)
                if self_checked
                else pack_header(size, checksum(parts))
            )
            gathers = batched or self._gathers(size)
            prepared.append(
                (name, header, parts, _gather_sources([memoryview(header), *parts]) if gathers else None)
            )
        group = [(name, sources) for name, _, _, sources in prepared if sources is not None]
        written = self._replace_many(group) if batched and len(group) > 1 else set()
        for name, header, parts, sources in prepared:
            if name not in written:
                code = self._write_one(name, header, parts, sources, deadline)
                if code is not None:
                    return code
        return None

    def _write_one(
        self, name: str, header: bytes, parts: list[memoryview], sources: _Sources | None, deadline: float
    ) -> int | None:
        """(pool thread) One value, retried while the answer may pass; the failing code, or ``None``."""
        pause = _RETRY_PAUSE
        while True:
            if sources is not None:
                code = self._replace(name, sources)
            else:
                code = self._store.upsert_parts(name, header, *parts, config=self._replicate)
            if code == 0:
                return None
            outcome = classify(code)
            # Either write can meet its own object removed by a racing writer: a gathered insert after its
            # remove, and ``upsert_parts`` when another upsert of the key replaced the object between its
            # start and its end (Mooncake 0.3.13 then answers OBJECT_NOT_FOUND; seen with four writers of one
            # key). The value was not written: try again.
            again = outcome.retry or outcome.miss
            if not again or time.monotonic() + pause > deadline:
                return int(code)
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _replace_many(self, group: list[tuple[str, _Sources]]) -> set[str]:
        """(pool thread) :meth:`_replace` for many values at once; the names it wrote (the caller writes the
        others one by one, with retries)."""
        removed = self._store.batch_remove([name for name, _ in group], True)
        keep = [g for g, code in zip(group, removed, strict=True) if code == 0 or classify(code).miss]
        if not keep:
            return set()
        codes = self._store.batch_put_from_multi_buffers(
            [name for name, _ in keep],
            [src[0] for _, src in keep],
            [src[1] for _, src in keep],
            self._replicate,
        )
        return {name for (name, _), code in zip(keep, codes, strict=True) if code == 0}

    def _gathers(self, size: int) -> bool:
        return self.gather_puts and size >= _GATHER_MIN

    def _replace(self, name: str, sources: _Sources) -> int:
        """(pool thread) Replace ``name`` by the gathered buffers: forced remove, then one insert.

        Why not ``upsert``: Mooncake 0.3.13 has no multi-buffer upsert, and ``upsert_parts`` copies every
        byte into the client's transfer buffer first. The insert alone would silently keep an existing
        value, hence the remove. Meanwhile readers see a miss (allowed: the old value, the new one or
        nothing); a read still running on the removed copy is caught by the header's checksum. Two writers
        racing here leave one of their values, whole.
        """
        addresses, sizes, _keep = sources
        removed = int(self._store.remove(name, True))
        if removed != 0 and not classify(removed).miss:
            return removed
        (code,) = self._store.batch_put_from_multi_buffers([name], [addresses], [sizes], self._replicate)
        return int(code)

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        checked_keys(keys)
        if not keys:
            return []
        return await self._call("get", self._get_blocking, [self._key(k) for k in keys])

    def _get_blocking(self, names: list[str]) -> list[Sequence[Buffer] | None]:
        """(pool thread) Each value copied out of the client's transfer buffer, which is freed at once."""
        out: list[Sequence[Buffer] | None] = []
        for name in names:
            value, state = self._get_one(name)
            if state != "ok":  # a read that raced an upsert (torn, or not yet written) is re-read once
                value, state = self._get_one(name)
                if state != "ok":
                    log.warning("%s: %r: %s under two reads in a row: a miss", self.name, name, _WHY[state])
            out.append(value)
        return out

    def _get_one(self, name: str) -> tuple[Sequence[Buffer] | None, str]:
        """One read: ``(value, "ok")``, ``(None, "ok")`` for a miss, ``(None, "torn" | "foreign")``.

        "foreign": the object does not start with a header of ours declaring its length. Never handed up:
        Mooncake 0.3.13 serves, to a read racing an ``upsert`` of the key, an object whose bytes were not
        written yet (all zeros, header included; measured), so bytes without our header are not a value
        anyone put under this key. Handing them up (as this did) gave the contract suite's racing readers
        2 MiB of zeros.
        """
        handle = self._store.get_buffer(name)
        if handle is None:  # missing, evicted, or unreadable: the store logs which
            return None, "ok"
        view = memoryview(handle).cast("B")
        try:
            header = parse_header(view)
            if header is None or header[0] != view.nbytes - HEADER_SIZE:
                return None, "foreign"
            body = view[HEADER_SIZE:]
            # A self-checked value (a frame) is verified by its reader, which rejects a torn one.
            if not header[2] & FLAG_SELF_CHECKED and checksum((body,)) != header[1]:
                return None, "torn"
            return (bytearray(body),), "ok"
        finally:
            view.release()
            del handle

    #: ``get_into`` lands values in the caller's buffers through the transfer engine (no copy of ours).
    reads_into: ClassVar[bool] = True

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        """Header and value straight into ``dests`` in one request; a length mismatch touches nothing."""
        checked_dests(key, dests)
        targets = [d.cast("B") for d in dests]
        size = sum(t.nbytes for t in targets)
        name = self._key(key)
        code, state = await self._read(name, targets, size, sink)
        if state == "ok":
            return size
        if state != "other":
            log.warning("%s: %r: %s: a miss", self.name, key, _WHY[state])
            return None
        if code >= 0:  # another object's bytes landed (not ours, or a length we did not expect)
            return _mismatch(await self._length_of(name, default=code - HEADER_SIZE), size)
        if code in (INVALID_PARAMS, TRANSFER_FAIL):  # Mooncake refuses a buffer of the wrong size
            return _mismatch(await self._length_of(name, default=None), size)
        if classify(code).miss:
            return None
        raise self._fail("get", code)

    async def _read(
        self, name: str, targets: list[memoryview], size: int, sink: Sink | None
    ) -> tuple[int, str]:
        """One direct read; the second and later reads started in the same loop iteration are sent together.

        Why: the loader starts one task per value; sent one by one, N values cost N thread hops and N
        requests, sent together two hops and two ``batch_get_into_multi_buffers`` (the first read of the
        iteration is already on its way alone). A read cancelled or timed out before its batch was sent is
        withdrawn (nothing will touch its buffers); after that it waits, shielded, for the batch to end, like
        every call that lends Mooncake the caller's memory.
        """
        if self._closed:
            raise BackendUnavailable(f"{self.name}: backend is closed")
        loop = asyncio.get_running_loop()
        reads = self._reads
        if reads is None and not self._reading_now:
            # The first read of a loop iteration goes at once, on its own (a lone read should not pay for
            # batching); the others of the same iteration are batched.
            self._reading_now = True
            loop.call_soon(self._end_iteration)
            return await self._call(
                "get", self._get_into_blocking, name, targets, size, sink, uses_caller_memory=True
            )
        if reads is None or len(reads.entries) >= _READ_BATCH:
            reads = self._reads = _Reads(loop)
            loop.call_soon(self._send_reads, reads)
        index = len(reads.entries)
        reads.entries.append((name, targets, size, sink))
        try:
            async with asyncio.timeout(self.timeout):
                results = await asyncio.shield(reads.future)
        except (TimeoutError, asyncio.CancelledError) as exc:
            if reads.job is None:
                reads.entries[index] = None
            else:
                await self._pool.outlast(reads.job, withdraw=False)
            if isinstance(exc, TimeoutError):
                raise BackendTimeout(f"{self.name}: get did not finish within {self.timeout:g}s") from None
            raise
        except (RuntimeError, OSError, ValueError, TypeError) as exc:  # what pybind11 turns C++ errors into
            raise BackendError(f"{self.name}: get failed: {exc}") from None
        outcome = results[index]
        assert outcome is not None
        return outcome

    def _end_iteration(self) -> None:
        self._reading_now = False

    def _send_reads(self, reads: _Reads) -> None:
        """(loop thread, one iteration after the first read queued) Hand the batch to the workers."""
        if self._reads is reads:
            self._reads = None
        entries = reads.entries
        if all(entry is None for entry in entries):  # every read was withdrawn
            reads.future.set_result([])
            return
        job = Job(self._get_into_many_blocking, (entries,), reads.future.get_loop())
        if not self._pool.submit(job):
            reads.future.set_exception(BackendUnavailable(f"{self.name}: backend is closed"))
            return
        reads.job = job
        job.future.add_done_callback(reads.settle)

    def _get_into_many_blocking(self, entries: list[_ReadEntry | None]) -> list[tuple[int, str] | None]:
        """(pool thread) The queued reads in one request per round, each checked as alone.

        A round holds each object name once (Mooncake fails every read of a name that appears twice in one
        request; measured), so reads of one name go in successive rounds. Each read gets the answer it would
        get alone: Mooncake answers every key separately, and a torn read without a sink is re-read once,
        alone, as :meth:`_get_into_blocking` does.
        """
        out: list[tuple[int, str] | None] = [None] * len(entries)
        todo = [(i, e) for i, e in enumerate(entries) if e is not None]
        while todo:
            names: set[str] = set()
            round_: list[tuple[int, _ReadEntry]] = []
            later: list[tuple[int, _ReadEntry]] = []
            for item in todo:
                (later if item[1][0] in names else round_).append(item)
                names.add(item[1][0])
            self._read_round(round_, out)
            todo = later
        return out

    def _read_round(self, live: list[tuple[int, _ReadEntry]], out: list[tuple[int, str] | None]) -> None:
        if len(live) == 1:
            i, (name, targets, size, sink) = live[0]
            out[i] = self._get_into_blocking(name, targets, size, sink)
            return
        headers = [bytearray(HEADER_SIZE) for _ in live]
        views = [
            [memoryview(header), *(t for t in targets if t.nbytes)]
            for header, (_, (_, targets, _, _)) in zip(headers, live, strict=True)
        ]
        codes = self._store.batch_get_into_multi_buffers(
            [entry[0] for _, entry in live],
            [[_address(v) for v in vs] for vs in views],
            [[v.nbytes for v in vs] for vs in views],
        )
        for header, (i, (name, targets, size, sink)), code in zip(headers, live, codes, strict=True):
            parsed = parse_header(header)
            if code == HEADER_SIZE + size and (parsed is None or parsed[0] != size):
                out[i] = (int(code), "foreign")  # as a lone read answers it (not re-read: see there)
                continue
            if code == HEADER_SIZE + size and parsed is not None:
                self_checked = bool(parsed[2] & FLAG_SELF_CHECKED)
                if sink is not None:  # the sink sees the bytes as they are checked: no re-read after that
                    out[i] = (
                        int(code),
                        "ok" if _verify(targets, parsed[1], sink, self_checked=self_checked) else "torn",
                    )
                    continue
                if _verify(targets, parsed[1], None, self_checked=self_checked):
                    out[i] = (int(code), "ok")
                else:  # torn: re-read once, alone, as a lone read does
                    out[i] = self._get_into_blocking(name, targets, size, sink)
                continue
            # Anything else is this key's own answer (Mooncake answers each key of a request separately),
            # handled by the caller as for a lone read. Not re-read: against a master that is down, each
            # read blocks for seconds while the client reconnects, and re-reads would queue them up.
            out[i] = (int(code), "other")

    def _get_into_blocking(
        self, name: str, targets: list[memoryview], size: int, sink: Sink | None
    ) -> tuple[int, str]:
        """(pool thread) Read, check and hand on: ``(code, "ok" | "torn" | "foreign" | "other")``.

        The check runs here, not on the loop thread (hashing a large value would stall it). Without a sink a
        read that raced an upsert is re-read once; with one, each piece goes to the sink right after it is
        hashed (the sink's own pass then finds it in cache), so a torn read cannot be re-read (the sink has
        seen it) and is reported as a miss.

        "foreign": an object of exactly the size asked for landed, but without a header of ours declaring that
        length. Its bytes are in the caller's buffers, so it must be a miss, never "the value is there"
        (``get_size`` would report the very size asked for, so a length check cannot tell). Mooncake 0.3.13
        serves such an object -- all zeros, not yet written -- to a read racing an upsert of the key
        (scripts/mooncake_race_repro.py reproduces it). Not re-read: that window outlasts a re-read (two reads
        in a row saw it), and a foreign object would be read twice for nothing.
        """
        header = bytearray(HEADER_SIZE)
        views = [memoryview(header), *(t for t in targets if t.nbytes)]
        addresses = [_address(v) for v in views]
        sizes = [v.nbytes for v in views]
        for attempt in range(2):
            (code,) = self._store.batch_get_into_multi_buffers([name], [addresses], [sizes])
            if code != HEADER_SIZE + size:
                return int(code), "other"
            parsed = parse_header(header)
            if parsed is None or parsed[0] != size:
                return int(code), "foreign"
            if _verify(targets, parsed[1], sink, self_checked=bool(parsed[2] & FLAG_SELF_CHECKED)):
                return int(code), "ok"
            if sink is not None or attempt:
                break
        return int(code), "torn"

    async def _length_of(self, name: str, *, default: int | None) -> int | None:
        """The value length stored under ``name`` (for a mismatch report), ``None`` when it is gone."""
        total = await self._call("get", self._store.get_size, name)
        if total == OBJECT_NOT_FOUND or (total < 0 and classify(total).miss):
            return None
        if total < 0:
            return default
        return max(0, int(total) - HEADER_SIZE)

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        checked_keys(keys)
        if not keys:
            return []
        found = await self._call("exists", self._store.batch_is_exist, [self._key(k) for k in keys])
        if any(f < 0 for f in found):
            raise BackendUnavailable(f"{self.name}: exists failed for {sum(f < 0 for f in found)} key(s)")
        return [f == 1 for f in found]

    async def delete(self, keys: Sequence[str]) -> int:
        """Remove keys, forcing past read leases (a value just read is leased for seconds by the master)."""
        checked_keys(keys)
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
        await loop.run_in_executor(None, self._pool.shutdown)
        with contextlib.suppress(RuntimeError, OSError):
            await asyncio.to_thread(self._store.close)

    # -- introspection (tests count these back to zero) ------------------------------------------------
    def thread_count(self) -> int:
        """Live threads of this backend's pool."""
        return self._pool.thread_count()

    def jobs_in_flight(self) -> int:
        """Store calls submitted to the pool and not finished (queued or running)."""
        return self._pool.jobs_in_flight()


#: How a read that is not handed on is logged.
_WHY = {
    "torn": "changed while it was read (a racing write)",
    "foreign": "not a value of ours (another tool's object, or one a racing upsert has not written yet)",
}


def _mismatch(length: int | None, size: int) -> int | None:
    """The length a ``get_into`` reports when no checked value landed: the object's own, or ``None``.

    Why: a length equal to the destinations' size tells the caller its buffers hold the value; here they
    hold bytes that failed our checks, so that answer would hand them on as if they were whole.
    """
    return None if length == size else length


def _verify(targets: list[memoryview], digest: int, sink: Sink | None, *, self_checked: bool = False) -> bool:
    """Whether ``targets`` hash to ``digest``; with a sink, each piece is handed to it right after hashing.

    A sink that verifies the value itself (``TensorStore``'s frame verifier) gets the pieces unhashed: a
    torn read fails its frame checksum instead, and this pass would only repeat it.
    A value written self-checked has no digest of ours: it passes here, and its reader checks it.
    """
    if self_checked or sink_verifies(sink):
        if sink is not None:
            for target in targets:
                if target.nbytes:
                    sink(target)
        return True
    if sink is None:
        return checksum(targets) == digest
    h = xxhash.xxh3_64()
    for target in targets:
        for offset in range(0, target.nbytes, _PIECE):
            piece = target[offset : offset + _PIECE]
            h.update(piece)
            sink(piece)
    return int(h.intdigest()) == digest


def _gather_sources(parts: list[memoryview]) -> _Sources | None:
    """Addresses and sizes of ``parts`` for a gathered insert (and what keeps them alive), ``None`` if a
    large part is read-only (ctypes gives no address for those; such a value is staged instead)."""
    addresses: list[int] = []
    keep: list[Any] = []
    for part in parts:
        source = part
        if part.readonly:
            if part.nbytes > _SMALL_PART:
                return None
            source = memoryview(bytearray(part))
        array = (ctypes.c_char * source.nbytes).from_buffer(source)
        keep.append(array)
        addresses.append(ctypes.addressof(array))
    return addresses, [p.nbytes for p in parts], keep


def _parts(value: Value) -> list[memoryview]:
    if isinstance(value, (bytes, bytearray, memoryview)):
        parts = [memoryview(value).cast("B")]
    else:
        parts = [memoryview(v).cast("B") for v in value]
    return [p for p in parts if p.nbytes]


#: One queued direct read: object name, the caller's buffers, the value size they expect, the sink.
_ReadEntry = tuple[str, list[memoryview], int, Sink | None]


class _Reads:
    """Direct reads queued on the loop in one iteration; ``future`` gets one outcome per entry."""

    __slots__ = ("entries", "future", "job")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.entries: list[_ReadEntry | None] = []  # None: withdrawn before the batch was sent
        self.future: asyncio.Future[list[tuple[int, str] | None]] = loop.create_future()
        self.job: Job | None = None  # set once sent: from then on the workers own the entries' buffers

    def settle(self, job_future: asyncio.Future[Any]) -> None:
        if self.future.done():
            return
        if job_future.cancelled():
            self.future.cancel()
        elif (exc := job_future.exception()) is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(job_future.result())
