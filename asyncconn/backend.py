"""The storage backend contract and the scheme registry that opens a backend from one URL.

A backend is a handful of async batch methods over opaque byte values (httpx-transport style): everything
above it -- framing, checksums, lookups, transfers -- is backend-agnostic. Backends translate their client
library's exceptions into :class:`BackendError` subclasses at this boundary, and every call finishes or
raises within the backend's ``timeout``.

Schemes resolve lazily (fsspec style): the core never imports a backend module until a URL names it, and a
missing optional dependency is answered with the extra to install. Third-party packages add schemes through
the ``asyncconn.backends`` entry-point group; built-in schemes cannot be silently overridden.
"""

from __future__ import annotations

import abc
import asyncio
import importlib
import importlib.metadata
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from asyncconn.exceptions import (
    AsyncConnError,
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    ConfigError,
    InvalidInput,
    UnknownSchemeError,
)
from asyncconn.url import Param, StoreURL, parse_url, redact, scrub

__all__ = [
    "ENTRY_POINT_GROUP",
    "Buffer",
    "IntoRead",
    "NOT_CACHED",
    "RemovedHook",
    "SelfChecked",
    "Sink",
    "feed_sink",
    "sink_verifies",
    "value_verifies",
    "StorageBackend",
    "Value",
    "available_schemes",
    "check_url",
    "checked_dests",
    "checked_items",
    "checked_keys",
    "open_backend",
    "register_backend",
    "resolve_backend",
]

ENTRY_POINT_GROUP = "asyncconn.backends"

Buffer = bytes | bytearray | memoryview
#: A value as it is written or read: one buffer, or its chunks in order (never joined by the library).
Value = Buffer | Sequence[Buffer]
#: Receives consecutive pieces of a value as a direct read lands them (see ``StorageBackend.get_into``).
Sink = Callable[[memoryview], None]
#: One read of :meth:`StorageBackend.get_into_many`: the key, the buffers to fill in order, and its sink.
IntoRead = tuple[str, Sequence[memoryview], Sink | None]
#: What :meth:`StorageBackend.get_into_many` reports, with ``cached_only``, for a value it would have had to
#: wait for (a disk, the network): nothing was read, or only part of it.
NOT_CACHED = -1
#: Told the keys a backend removed by its own doing (eviction, expiry); see ``StorageBackend.on_removed``.
RemovedHook = Callable[[Sequence[str]], None]


def feed_sink(sink: Sink, pieces: Sequence[memoryview]) -> None:
    """Hand consecutive ``pieces`` of a value to ``sink``, in one call when it has a ``feed_many`` method.

    Why: a value read in place lands in many pieces (a piece per layer of a KV block), and a Python call
    per piece into the sink was most of the Python work of such a read; ``TensorStore``'s verifier takes
    them all at once. A plain callable gets a call per piece.
    """
    many = getattr(sink, "feed_many", None)
    if many is not None:
        many(pieces)
        return
    for piece in pieces:
        sink(piece)


def sink_verifies(sink: Sink | None) -> bool:
    """Whether ``sink`` checks every byte it is fed against a checksum written with the value.

    A sink says so with a true ``verifies_value`` attribute (``TensorStore``'s frame verifier does: the frame
    checksum covers header and payload, so a torn or damaged read fails it). A backend whose own layout
    carries a checksum only to catch such reads may then skip that pass; the read is still rejected, by
    the caller, as a bad value instead of being retried by the backend.
    """
    return bool(getattr(sink, "verifies_value", False))


class SelfChecked(tuple[Buffer, ...]):
    """The chunks of a value whose own bytes carry a checksum over all of it (a ``TensorStore`` frame).

    A writer hands a value in this wrapper to say "whoever reads this checks it": a backend whose layout
    carries a checksum only to catch torn or damaged reads may then skip computing it on ``put`` (a pass
    over every byte), because every reader of such a value -- ``TensorStore`` -- rejects a bad frame itself.
    Backends that ignore the hint see an ordinary sequence of chunks.
    """

    __slots__ = ()


def value_verifies(value: Value) -> bool:
    """Whether ``value`` was handed over as :class:`SelfChecked` (its readers verify it themselves)."""
    return isinstance(value, SelfChecked)


def value_nbytes(value: Value) -> int:
    """Total size of a value given as one buffer or a sequence of chunks."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return memoryview(value).nbytes
    return sum(memoryview(c).nbytes for c in value)


# -- input checks every built-in backend runs before any I/O ----------------------------------------------
# Why here and not in each backend: a non-str key used to surface as AttributeError on one backend,
# TypeError on another and as a silent miss on a third. One check gives one error type (InvalidInput).


def checked_keys(keys: Sequence[str]) -> Sequence[str]:
    """``keys`` when it is a sequence of non-empty ``str``; :class:`InvalidInput` otherwise."""
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Sequence):
        raise InvalidInput(f"keys must be a sequence of str, not {type(keys).__name__}")
    for key in keys:
        _check_key(key)
    return keys


def _check_key(key: object) -> None:
    if type(key) is not str:
        raise InvalidInput(f"a store key must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidInput("a store key must not be empty")


def _is_buffer(part: object) -> bool:
    if isinstance(part, (bytes, bytearray, memoryview)):
        return True
    try:
        memoryview(part)  # type: ignore[arg-type]  # anything exporting the buffer protocol
    except TypeError:
        return False
    return True


def checked_items(items: Sequence[tuple[str, Value]]) -> Sequence[tuple[str, Value]]:
    """``items`` when each is a ``(str key, value)`` pair whose value is a buffer or a sequence of them."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise InvalidInput(f"put takes a sequence of (key, value) pairs, not {type(items).__name__}")
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidInput(f"put takes (key, value) pairs, not {type(item).__name__}")
        key, value = item
        _check_key(key)
        if _is_buffer(value):
            continue
        if isinstance(value, (list, tuple)) and all(_is_buffer(part) for part in value):
            continue
        raise InvalidInput(
            f"the value under {key!r} must be bytes-like or a sequence of bytes-like parts, "
            f"not {type(value).__name__}"
        )
    return items


def checked_dests(key: str, dests: Sequence[memoryview]) -> Sequence[memoryview]:
    """``dests`` of a ``get_into`` when they are writable memoryviews (and ``key`` a valid key)."""
    _check_key(key)
    if not isinstance(dests, (list, tuple)):
        raise InvalidInput(f"get_into takes a sequence of memoryviews, not {type(dests).__name__}")
    for dest in dests:
        if not isinstance(dest, memoryview) or dest.readonly:
            kind = "a read-only memoryview" if isinstance(dest, memoryview) else type(dest).__name__
            raise InvalidInput(f"get_into destinations must be writable memoryviews, not {kind}")
    return dests


class StorageBackend(abc.ABC):
    """The async contract every store implements. All methods are batched and run on the runtime loop.

    - ``put`` writes each key atomically: a concurrent reader sees the old value, the new one or nothing,
      never a mix (two producers racing on one key leave one whole value).
    - ``get`` returns each value as a sequence of buffers (chunks in order) or ``None`` for a miss.
    - ``exists`` and ``delete`` never read values.
    - Errors are :class:`BackendError` subclasses; a call never outlives ``timeout``.
    - Invalid arguments (a non-str or empty key, a value that is not bytes-like) raise
      :class:`InvalidInput` before any I/O: built-in backends call :func:`checked_keys`,
      :func:`checked_items` and :func:`checked_dests`.
    """

    #: URL parameters this backend accepts (documented in docs/configuration.md).
    params: ClassVar[dict[str, Param]] = {}
    #: Whether the store uses ``url.password``; a URL with a password (in it, or through ``password_env``
    #: or ``password_file``) for a store that does not is refused, rather than the password ignored.
    takes_password: ClassVar[bool] = False
    #: Set by whoever reports removals (e.g. KV events' ``BlockRemoved``): called on the loop thread with
    #: the keys this backend removed by its own doing -- evicted or expired by ``file://``'s sweep, or by a
    #: ``redis://`` server's ``ttl``/``maxmemory`` when its URL has ``removals=listen``/``enable`` (keyspace
    #: notifications; ``redis+cluster://`` too). Not called for ``delete``, nor for what a server drops
    #: without telling (Mooncake eviction), nor for keys another process's sweep removed -- except by a
    #: ``file://`` store asked to ``watch_removals``: then for every value removed from its directory on
    #: this host, ``delete`` included. A hook that raises is logged and ignored.
    on_removed: RemovedHook | None = None

    @classmethod
    @abc.abstractmethod
    async def from_url(cls, url: StoreURL) -> StorageBackend:
        """Build (and connect, if it must) a backend from a parsed URL. Runs on the loop."""

    @abc.abstractmethod
    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        """Store every (key, value) pair; each key atomically."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        """Fetch values in key order; ``None`` where a key is absent."""

    @abc.abstractmethod
    async def exists(self, keys: Sequence[str]) -> list[bool]:
        """Which keys are present, in key order."""

    @abc.abstractmethod
    async def delete(self, keys: Sequence[str]) -> int:
        """Remove keys; return how many existed."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections and threads. Idempotent."""

    #: True when :meth:`get_into` reads straight into caller memory (no intermediate buffer).
    reads_into: ClassVar[bool] = False

    async def get_into(self, key: str, dests: Sequence[memoryview], sink: Sink | None = None) -> int | None:
        """Scatter one value across ``dests`` in order; return the value's length, ``None`` for a miss.

        The buffers are filled only when the value's length equals their total size; otherwise nothing is
        written and the length is returned so the caller can report the mismatch. ``sink``, when given, is
        called with each consecutive piece of the value, in order, once that piece has landed -- possibly on
        another thread, while later pieces are still being read -- so a caller can checksum during the
        read instead of after it. The default goes through :meth:`get`; backends that can read straight
        into caller memory (``preadv`` on a file, a zero-copy RPC) override it and set ``reads_into``.
        """
        checked_dests(key, dests)
        (chunks,) = await self.get([key])
        if chunks is None:
            return None
        total = sum(memoryview(c).nbytes for c in chunks)
        targets = [d.cast("B") for d in dests]
        if total != sum(d.nbytes for d in targets):
            return total
        _scatter([memoryview(c).cast("B") for c in chunks], targets)
        if sink is not None:
            for target in targets:
                sink(target)
        return total

    #: True when :meth:`get_into` writes the caller's memory only on the event loop and nothing after it
    #: is cancelled: a read that hangs can be abandoned at once. A CPU engine then reads this store's values
    #: straight into its KV blocks (in-place loads), as it does from a page cache, instead of through
    #: staging and a copy on vLLM's thread. Not a backend whose reads run on threads or lend the memory to
    #: a transfer engine: those cannot let go of the blocks on time.
    cancellable_reads: ClassVar[bool] = False

    #: True when :meth:`get_into_many` beats one :meth:`get_into` per value (one job for the batch).
    batch_reads: ClassVar[bool] = False

    #: True when :meth:`get_into_many` can serve ``cached_only`` reads (values already in memory).
    cached_reads: ClassVar[bool] = False

    async def get_into_many(
        self, reads: Sequence[IntoRead], *, cached_only: bool = False
    ) -> list[int | None]:
        """:meth:`get_into` for several values at once; results in order.

        Why: a load step reads many values (a 4k-token prefix is 128 of them), and the fixed cost of each
        call -- a task, a timeout, a thread hand-off -- was most of a page-cached read's time. A backend that
        can serve a batch in one job overrides this and sets ``batch_reads``; the default is a gather.

        ``cached_only``: read only values that are in memory already (a page cache), so that every read ends
        within a memory copy; a value that would wait for a disk or the network is :data:`NOT_CACHED` (its
        buffers may hold part of it). Why: a caller reading straight into memory it must hand back on time (a
        host KV cache) cannot abandon a read that hangs. A backend that cannot tell (the default) reports
        every value :data:`NOT_CACHED`; ``cached_reads`` says whether this one can.

        A sink must not raise here: one bad value would fail its neighbours' reads. (``TensorStore`` hands
        sinks that record a bad frame and stop checking instead.) An error of the store itself fails the
        whole call.
        """
        if cached_only:
            return [NOT_CACHED] * len(reads)
        return list(await asyncio.gather(*(self.get_into(key, dests, sink) for key, dests, sink in reads)))

    async def __aenter__(self) -> StorageBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _scatter(sources: list[memoryview], dests: list[memoryview]) -> None:
    """Copy the concatenation of ``sources`` into the concatenation of ``dests`` (equal total sizes)."""
    di, doff = 0, 0
    for src in sources:
        soff = 0
        while soff < src.nbytes:
            dest = dests[di]
            take = min(src.nbytes - soff, dest.nbytes - doff)
            dest[doff : doff + take] = src[soff : soff + take]
            soff += take
            doff += take
            if doff == dest.nbytes:
                di, doff = di + 1, 0


# -- registry ------------------------------------------------------------------------------------------
# scheme -> ("module:Class", extra to install if the import fails)
_BUILTINS: dict[str, tuple[str, str | None]] = {
    "memory": ("asyncconn_backends.memory:MemoryBackend", None),
    "file": ("asyncconn_backends.file:FileBackend", None),
    "redis": ("asyncconn_backends.redis:RedisBackend", None),
    "rediss": ("asyncconn_backends.redis:RedisBackend", None),
    "unix": ("asyncconn_backends.redis:RedisBackend", None),
    "redis+cluster": ("asyncconn_backends.redis:RedisClusterBackend", None),
    "mooncake": ("asyncconn_backends.mooncake:MooncakeBackend", "asyncconn[mooncake]"),
}
_registered: dict[str, tuple[str | type[StorageBackend], str | None]] = {}
_registry_lock = threading.Lock()


def register_backend(scheme: str, target: str | type[StorageBackend], *, override: bool = False) -> None:
    """Register a backend class (or a lazy ``"module:Class"`` string) for a URL scheme.

    Built-in schemes can never be replaced; a scheme registered earlier needs ``override=True``.
    """
    scheme = scheme.lower()
    if scheme in _BUILTINS:
        raise ConfigError(f"scheme {scheme!r} is built in and cannot be overridden")
    with _registry_lock:
        if scheme in _registered and not override:
            raise ConfigError(f"scheme {scheme!r} is already registered (pass override=True to replace it)")
        _registered[scheme] = (target, None)


def _entry_points() -> dict[str, str]:
    found: dict[str, str] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found[ep.name.lower()] = ep.value
    return found


def available_schemes() -> list[str]:
    """Every scheme a URL may use: built-ins, registered ones and entry-point plug-ins."""
    return sorted(set(_BUILTINS) | set(_registered) | set(_entry_points()))


def _load(target: str, scheme: str, extra: str | None) -> type[StorageBackend]:
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with: pip install '{extra}'" if extra else ""
        raise BackendNotInstalled(f"backend for {scheme}:// cannot be imported ({exc}){hint}") from exc
    cls: Any = getattr(module, attr, None)
    if not (isinstance(cls, type) and issubclass(cls, StorageBackend)):
        raise ConfigError(f"{target!r} (scheme {scheme!r}) is not a StorageBackend subclass")
    return cls


def resolve_backend(scheme: str) -> type[StorageBackend]:
    """The backend class for a scheme, importing it on first use."""
    scheme = scheme.lower()
    if scheme in _BUILTINS:
        target, extra = _BUILTINS[scheme]
        return _load(target, scheme, extra)
    with _registry_lock:
        entry = _registered.get(scheme)
    if entry is not None:
        target_or_cls, extra = entry
        if isinstance(target_or_cls, str):
            return _load(target_or_cls, scheme, extra)
        return target_or_cls
    plugins = _entry_points()
    if scheme in plugins:
        return _load(plugins[scheme], scheme, None)
    raise UnknownSchemeError(
        f"no storage backend for scheme {scheme!r} (available: {', '.join(available_schemes())}; "
        f"third-party backends register under the {ENTRY_POINT_GROUP!r} entry-point group)"
    )


def check_url(url: StoreURL) -> type[StorageBackend]:
    """The backend class for ``url``, once its parameters and password have been checked against it.

    Raises ConfigError (the URL redacted) for an unknown scheme, a missing extra, a bad parameter, or a
    password given to a store that takes none -- which would otherwise be silently ignored.
    """
    cls = resolve_backend(url.scheme)
    if url.password is not None and not cls.takes_password:
        source = "the URL" if url.password_from == "userinfo" else repr(url.password_from)
        raise ConfigError(f"{url.scheme}:// URL: a password in {source}, but this store takes no password")
    url.options(cls.params)
    return cls


async def open_backend(url: str | StoreURL) -> StorageBackend:
    """Open the backend a URL names. Must be awaited on the runtime loop (clients bind to their loop).

    This is where a URL's secrets could leak into an error, so every failure leaves here as one of our
    exceptions whose text has the URL's secrets scrubbed, with no cause or context attached (a client
    library's exception may quote its connection arguments).
    """
    parsed = url if isinstance(url, StoreURL) else parse_url(url)
    cls = check_url(parsed)
    secrets = parsed.secrets()
    try:
        return await cls.from_url(parsed)
    except AsyncConnError as exc:
        error = _scrubbed(exc, secrets)
    except (ValueError, TypeError) as exc:
        error = ConfigError(f"bad store URL {redact(parsed.raw)!r}: {scrub(str(exc), secrets)}")
    except TimeoutError:
        error = BackendTimeout(f"{redact(parsed.raw)}: opening timed out")
    except Exception as exc:
        reason = scrub(str(exc) or type(exc).__name__, secrets)
        error = BackendUnavailable(f"{redact(parsed.raw)}: cannot open: {type(exc).__name__}: {reason}")
    raise error  # outside the handlers: no context to print


def _scrubbed(exc: AsyncConnError, secrets: tuple[str, ...]) -> AsyncConnError:
    """``exc`` again, as the same type, with ``secrets`` scrubbed from its text and nothing chained."""
    text = scrub(str(exc), secrets)
    try:
        fresh = type(exc)(text)
    except Exception:  # a plug-in's exception with another signature
        fresh = BackendError(text) if isinstance(exc, BackendError) else ConfigError(text)
    return fresh
