"""Lookup settings and the one function that turns them into a client with the right transport.

The transport is configuration, not code: ``backend_url`` alone -> the client queries the store itself
(:class:`DirectTransport`); ``lookup_server`` set -> it asks a ZMQ lookup server (:class:`ZmqTransport`),
which is how several vLLM instances share one answer point and how a store without a Python client is
reached. Both set is allowed (the server wins for lookups; ``backend_url`` stays for loads and saves).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, TypeVar

from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError
from asyncconn.lookup.client import DEFAULT_TIMEOUT, LookupClient, Mode
from asyncconn.lookup.curve import CurveClientKeys, load_key
from asyncconn.lookup.transports import DirectTransport, LookupTransport, ZmqTransport
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.url import redact

__all__ = ["LookupConfig", "open_lookup_client"]

R = TypeVar("R")


@dataclass(frozen=True, repr=False)
class LookupConfig:
    """Every lookup option (documented in docs/lookup.md), named as the ``extra_config`` key it comes from."""

    backend_url: str | None = None
    lookup_server: str | None = None
    lookup_timeout: float = DEFAULT_TIMEOUT
    key_prefix: str = ""
    lookup_max_pending: int = 100_000
    #: CURVE public key of the lookup server (Z85 text or a key/certificate file); None: no CURVE.
    lookup_server_key: str | None = None
    #: Direct lookups: bound on connecting to the store when the client starts (None: ``lookup_timeout``).
    connect_timeout: float | None = None

    def __post_init__(self) -> None:
        if not self.backend_url and not self.lookup_server:
            raise ConfigError("lookup: set backend_url (direct lookups) or lookup_server (a ZMQ endpoint)")
        if self.lookup_timeout <= 0:
            raise ConfigError(f"lookup: bad value {self.lookup_timeout!r} for 'lookup_timeout': must be > 0")
        if self.connect_timeout is not None and self.connect_timeout <= 0:
            raise ConfigError(
                f"lookup: bad value {self.connect_timeout!r} for 'connect_timeout': must be > 0"
            )
        if self.lookup_max_pending <= 0:
            raise ConfigError(
                f"lookup: bad value {self.lookup_max_pending!r} for 'lookup_max_pending': must be > 0"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> LookupConfig:
        """The lookup part of a connector's validated :class:`~asyncconn.config.Settings`: the one way from
        an ``extra_config`` to a lookup client (``Settings.from_extra_config`` refuses unknown keys)."""
        return cls(
            backend_url=settings.backend_url,
            lookup_server=settings.lookup_server,
            lookup_timeout=settings.lookup_timeout,
            key_prefix=settings.key_prefix,
            lookup_max_pending=settings.lookup_max_pending,
            lookup_server_key=settings.lookup_server_key,
            connect_timeout=settings.connect_timeout,
        )

    def __repr__(self) -> str:
        """The fields, with ``backend_url``'s password redacted (the dataclass repr would print it)."""
        shown = (f"{f.name}={_field_repr(getattr(self, f.name))}" for f in fields(self))
        return f"LookupConfig({', '.join(shown)})"

    def transport(self, store: TensorStore | None = None) -> LookupTransport:
        """The transport to the lookup server, else to the store: ``store`` when given (a store another
        client already opened, shared, left for its owner to close), else one of its own."""
        if self.lookup_server:
            curve = None
            if self.lookup_server_key:
                curve = CurveClientKeys(load_key(self.lookup_server_key, what="lookup_server_key"))
            return ZmqTransport(self.lookup_server, curve=curve)
        assert self.backend_url is not None
        return DirectTransport(
            store if store is not None else self.backend_url,
            key_prefix=self.key_prefix,
            timeout=self.lookup_timeout,
            connect_timeout=self.connect_timeout,
        )


def open_lookup_client(
    config: LookupConfig,
    mode: Mode[R],
    *,
    runtime: Runtime | None = None,
    store: TensorStore | None = None,
) -> LookupClient[R]:
    """A started client for ``mode`` (``PREFIX`` for KV, ``EXISTS`` for EC) with the configured transport
    (``store``: another client's store to share, see :meth:`LookupConfig.transport`)."""
    return LookupClient(
        config.transport(store),
        mode,
        runtime=runtime,
        timeout=config.lookup_timeout,
        max_pending=config.lookup_max_pending,
    )


def _field_repr(value: Any) -> str:
    return repr(redact(value)) if isinstance(value, str) else repr(value)
