"""One validated settings object, parsed from a connector's ``extra_config``.

Operators configure asyncconn through ``kv_connector_extra_config`` / ``ec_connector_extra_config`` (JSON on
vLLM's command line). Every key is declared once here with its parser, default and documentation; an unknown
key (a typo) or a bad value raises :class:`ConfigError` naming the key, at engine start-up rather than as a
silent default. docs/configuration.md lists the same table (a test keeps the two in step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncconn.exceptions import ConfigError
from asyncconn.url import parse_bool, parse_duration, parse_size, parse_url

__all__ = ["DEFAULT_BACKEND_URL", "Settings"]

#: The embedded default store: a directory every process on the host can reach, no server to run. Bounded,
#: least recently used values evicted first: /tmp is often memory (tmpfs) or the root disk, and an
#: unbounded store there grew until it was full.
DEFAULT_BACKEND_URL = "file:///tmp/asyncconn-store?max_bytes=4GiB"


def _url(value: Any) -> str:
    text = str(value)
    parse_url(text)  # raises ConfigError with the URL redacted
    return text


def _optional_endpoint(value: Any) -> str | None:
    if value in (None, ""):
        return None
    text = str(value)
    if "://" not in text:
        raise ValueError("expected a ZMQ endpoint such as tcp://127.0.0.1:5555 or ipc:///run/asyncconn.sock")
    return text


def _optional_text(value: Any) -> str | None:
    return None if value in (None, "") else str(value)


def _positive_int(value: Any) -> int:
    if isinstance(value, bool):
        raise TypeError("expected an integer")
    number = int(value)
    if number <= 0:
        raise ValueError("must be > 0")
    return number


def _positive_duration(value: Any) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be > 0")
    return seconds


def _opt(parse: Callable[[Any], Any], default: Any, doc: str) -> Any:
    return field(default=default, metadata={"parse": parse, "doc": doc})


@dataclass(frozen=True)
class Settings:
    """Connector settings. Build with :meth:`from_extra_config`; every field has a working default."""

    backend_url: str = _opt(_url, DEFAULT_BACKEND_URL, "store URL; its scheme picks the backend")
    lookup_server: str | None = _opt(
        _optional_endpoint, None, "ZMQ endpoint of a lookup server; unset: query the store"
    )
    key_prefix: str = _opt(str, "", "prepended to every key this connector reads or writes")
    lookup_timeout: float = _opt(_positive_duration, 3.0, "a lookup unanswered after this is a miss")
    lookup_max_pending: int = _opt(_positive_int, 100_000, "lookups outstanding at once; more are misses")
    sync_lookup: bool = _opt(parse_bool, False, "block in the scheduler until a lookup answers (not advised)")
    store_timeout: float = _opt(_positive_duration, 5.0, "bound on every store call (get, put, exists)")
    connect_timeout: float = _opt(
        _positive_duration, 10.0, "bound on connecting to the store (and lookup store) at engine start-up"
    )
    load_timeout: float = _opt(_positive_duration, 10.0, "a load not on the device after this fails")
    pinned_pool_bytes: int = _opt(parse_size, 1 << 30, "pinned staging memory per worker, e.g. 1GiB")
    max_inflight_loads: int = _opt(_positive_int, 64, "loads fetched at once per worker")
    save_skip_existing: bool = _opt(parse_bool, True, "skip saving keys the store already has")
    arrival_timeout: float = _opt(
        _positive_duration, 5.0, "EC: how long PD waits for an item E announced but had not yet saved"
    )
    kv_blocks_per_value: int = _opt(_positive_int, 1, "KV: consecutive blocks stored under one key")
    lookup_server_key: str | None = _opt(
        _optional_text, None, "CURVE public key of the lookup server (Z85 text or a key/cert file)"
    )
    ec_max_row_bytes: int = _opt(
        parse_size, 64 << 10, "EC: bound on one embedding row's bytes until the first load gives the size"
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        """Parse ``extra_config``; unknown keys and bad values raise ConfigError naming the key."""
        extra = dict(extra or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"extra_config: unknown key {unknown[0]!r} (accepted: {', '.join(sorted(known))})"
            )
        values: dict[str, Any] = {}
        for name, value in extra.items():
            parse = known[name].metadata["parse"]
            try:
                values[name] = parse(value)
            except ConfigError as exc:
                raise ConfigError(f"extra_config: bad value for {name!r}: {exc}") from None
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"extra_config: bad value {value!r} for {name!r}: {exc}") from None
        return cls(**values)

    @classmethod
    def documentation(cls) -> list[tuple[str, Any, str]]:
        """(key, default, meaning) for every key, in declaration order (used by the docs test)."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]
