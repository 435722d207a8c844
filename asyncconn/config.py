"""One validated settings object, parsed from a connector's ``extra_config``.

Operators configure asyncconn through ``kv_connector_extra_config`` / ``ec_connector_extra_config`` (JSON on
vLLM's command line). Every key is declared once here with its parser, default and documentation; an unknown
key (a typo) or a bad value raises :class:`ConfigError` naming the key, at engine start-up rather than as a
silent default. docs/configuration.md lists the same table (a test keeps the two in step).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncconn.backend import check_url
from asyncconn.exceptions import ConfigError
from asyncconn.url import (
    parse_bool,
    parse_count,
    parse_duration,
    parse_size,
    parse_url,
    redact,
    scrub,
    url_secrets,
)

__all__ = ["DEFAULT_BACKEND_URL", "Settings"]

log = logging.getLogger(__name__)

#: The embedded default store: a directory every process on the host can reach, no server to run. Bounded,
#: least recently used values evicted first: /tmp is often memory (tmpfs) or the root disk, and an
#: unbounded store there grew until it was full.
DEFAULT_BACKEND_URL = "file:///tmp/asyncconn-store?max_bytes=4GiB"


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected text, got {_kind(value)}")
    return value


def _url(value: Any) -> str:
    """A store URL whose scheme has a backend and whose parameters that backend accepts.

    Raises ConfigError with the URL redacted. Checking the parameters here, not when the store is opened,
    makes a bad ``ttl=`` fail at engine start-up in the scheduler too (it opens no store when a lookup
    server answers its lookups).
    """
    parsed = parse_url(_text(value))  # reads password_env / password_file, too
    check_url(parsed)
    return parsed.raw


def _optional_endpoint(value: Any) -> str | None:
    if value in (None, ""):
        return None
    text = _text(value)
    transport, sep, address = text.partition("://")
    if not sep or transport not in ("tcp", "ipc", "inproc") or not address:
        raise ValueError("expected a ZMQ endpoint such as tcp://127.0.0.1:5555 or ipc:///run/asyncconn.sock")
    return text


def _optional_local_url(value: Any) -> str | None:
    """A ``file://`` store URL (this host's disk), or None."""
    if value in (None, ""):
        return None
    url = _url(value)
    if parse_url(url).scheme != "file":
        raise ValueError("must be a file:// URL (a directory on this host's disk)")
    return url


#: What ``kv_events`` may name: which of the connector's residencies vLLM's KV events carry.
EVENT_SCOPES = ("all", "store", "host", "none")


def _events_scope(value: Any) -> str:
    if not isinstance(value, str) or value.strip().lower() not in EVENT_SCOPES:
        raise ValueError(f"expected one of {', '.join(EVENT_SCOPES)}")
    return value.strip().lower()


def _optional_text(value: Any) -> str | None:
    return None if value in (None, "") else _text(value)


def _positive_size(value: Any) -> int:
    size = parse_size(value)
    if size <= 0:
        raise ValueError("must be > 0")
    return size


def _positive_duration(value: Any) -> float:
    seconds = parse_duration(value)
    if seconds <= 0:
        raise ValueError("must be > 0")
    return seconds


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _shown(value: Any) -> str:
    """A value as an error may echo it: short, and redacted in case it is (or holds) a URL."""
    text = repr(value)
    return redact(text if len(text) <= 80 else text[:77] + "...")


def _opt(parse: Callable[[Any], Any], default: Any, doc: str) -> Any:
    return field(default=default, metadata={"parse": parse, "doc": doc})


@dataclass(frozen=True, repr=False)
class Settings:
    """Connector settings. Build with :meth:`from_extra_config`; every field has a working default."""

    backend_url: str = _opt(_url, DEFAULT_BACKEND_URL, "store URL; its scheme picks the backend")
    lookup_server: str | None = _opt(
        _optional_endpoint, None, "ZMQ endpoint of a lookup server; unset: query the store"
    )
    key_prefix: str = _opt(
        _text,
        "",
        "start of every key this connector names (after the URL's own `prefix`, where the store has one)",
    )
    lookup_timeout: float = _opt(_positive_duration, 3.0, "a lookup unanswered after this is a miss")
    lookup_max_pending: int = _opt(parse_count, 100_000, "lookups outstanding at once; more are misses")
    sync_lookup: bool = _opt(parse_bool, False, "block in the scheduler until a lookup answers (not advised)")
    store_timeout: float = _opt(
        _positive_duration,
        5.0,
        "bound on each of this connector's store calls (get, put, exists), any backend; a store URL's own "
        "`timeout` bounds the same call too, and the smaller ends it",
    )
    connect_timeout: float = _opt(
        _positive_duration, 10.0, "bound on connecting to the store (and lookup store) at engine start-up"
    )
    load_timeout: float = _opt(
        _positive_duration,
        10.0,
        "KV: a load fails when it makes no progress for this long (not when it is long); EC: bound on a "
        "last-resort synchronous install",
    )
    preempt_timeout: float = _opt(
        _positive_duration,
        5.0,
        "KV: bound on handle_preemptions' wait for the saves still reading a preempted request's blocks "
        "(the longest a step waits on a preemption)",
    )
    host_cache_bytes: int = _opt(
        parse_size,
        0,
        "host-memory tier per worker in front of the store, e.g. 8GiB: least recently used values evicted "
        "first; a load it holds never reaches the store (0: off)",
    )
    local_store_url: str | None = _opt(
        _optional_local_url,
        None,
        "a file:// store on this host's disk in front of backend_url, e.g. "
        "file:///nvme/asyncconn?max_bytes=500GiB: loads it holds never leave the host, values loaded from "
        "backend_url are written to it, saves go to both (unset: none)",
    )
    pinned_pool_bytes: int = _opt(_positive_size, 1 << 30, "pinned staging memory per worker, e.g. 1GiB")
    max_inflight_loads: int = _opt(
        parse_count,
        64,
        "store reads running at once per worker; more wait on the loop, not for an engine step "
        "(in-place KV loads from a page cache are not held back)",
    )
    save_skip_existing: bool = _opt(parse_bool, True, "skip saving keys the store already has")
    arrival_timeout: float = _opt(
        _positive_duration, 5.0, "EC: how long PD waits for an item E announced but had not yet saved"
    )
    kv_blocks_per_value: int = _opt(parse_count, 1, "KV: consecutive blocks stored under one key")
    kv_sync_loads: bool = _opt(
        parse_bool,
        False,
        "KV: load in the step that schedules the request, which waits for it (vLLM's sync loads)",
    )
    kv_events: str = _opt(
        _events_scope,
        "all",
        "KV: with vLLM's KV events on, which residencies this connector publishes: all, store (the shared "
        "store's), host (this host's: the host tier's and the local store's), none",
    )
    kv_events_recheck: float = _opt(
        parse_duration,
        10.0,
        "KV: with the store's KV events published, how often values announced stored are asked about again, "
        "so a removal the store never reports (a Mooncake eviction) is announced (0: never)",
    )
    lookup_server_key: str | None = _opt(
        _optional_text, None, "CURVE public key of the lookup server (Z85 text or a key/cert file)"
    )
    ec_max_row_bytes: int = _opt(
        _positive_size, 64 << 10, "EC: bound on one embedding row's bytes until the first load gives the size"
    )

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> Settings:
        """Parse ``extra_config``; unknown keys and bad values raise ConfigError naming the key."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"extra_config: expected a mapping of keys to values, got {_kind(extra)}")
        known = {f.name for f in dataclasses.fields(cls)}
        odd = [k for k in extra if not isinstance(k, str)]
        if odd:
            raise ConfigError(f"extra_config: keys are text, got {_shown(odd[0])}")
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(
                f"extra_config: unknown key {unknown[0][:80]!r} (accepted: {', '.join(sorted(known))})"
            )
        settings = cls(**{name: cls.parse_value(name, value) for name, value in extra.items()})
        if "store_timeout" in extra:
            _warn_shadowed_store_timeout(settings)
        return settings

    @classmethod
    def parse_value(cls, name: str, value: Any) -> Any:
        """Check and convert one ``extra_config`` value; a ConfigError names the key and what is wrong.

        ``null`` is accepted only for the keys whose default is ``null`` (it means "unset" there); for the
        others the key is left out to get its default.
        """
        spec = next(f for f in dataclasses.fields(cls) if f.name == name)
        if value is None and spec.default is not None:
            raise ConfigError(f"extra_config: {name!r} must not be null (leave the key out for the default)")
        try:
            return spec.metadata["parse"](value)
        except ConfigError as exc:
            reason = str(exc)
        except (TypeError, ValueError, OverflowError) as exc:
            reason = f"bad value {_shown(value)}: {exc}"
        # Built outside the handler, with the value's secrets scrubbed: nothing chained can quote them.
        secrets = url_secrets(value) if isinstance(value, str) else ()
        raise ConfigError(f"extra_config: {name!r}: {scrub(reason, secrets)}")

    def __repr__(self) -> str:
        """The fields, with ``backend_url``'s password redacted (the dataclass repr would print it)."""
        shown = (f"{f.name}={_field_repr(getattr(self, f.name))}" for f in dataclasses.fields(self))
        return f"Settings({', '.join(shown)})"

    def non_defaults(self) -> dict[str, Any]:
        """The settings that differ from their defaults, URLs redacted: what a start-up line reports."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value != f.default:
                out[f.name] = redact(value) if isinstance(value, str) else value
        return out

    def inline_password(self) -> bool:
        """True when ``backend_url`` holds its password itself (rather than naming ``password_env`` or
        ``password_file``). Why it matters: vLLM prints ``kv_connector_extra_config`` verbatim at start-up,
        so such a password reaches the engine's log."""
        return parse_url(self.backend_url).password_from == "userinfo"

    @classmethod
    def documentation(cls) -> list[tuple[str, Any, str]]:
        """(key, default, meaning) for every key, in declaration order (used by the docs test)."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]


def _warn_shadowed_store_timeout(settings: Settings) -> None:
    """Log (once per process and figures) a ``store_timeout`` that the store URL's ``timeout`` cuts short.

    Why: both bound the same store call and the smaller ends it, so raising ``store_timeout`` alone past a
    Redis or Mooncake URL's ``timeout`` (5 s unless given) changes nothing -- a trap, as the natural answer
    to store timeouts is to raise ``store_timeout``.
    """
    try:
        parsed = parse_url(settings.backend_url)
        params = check_url(parsed).params
        url_timeout = parsed.options(params)["timeout"] if "timeout" in params else None
    except ConfigError:  # checked when the field was parsed; a password file gone since is not our business
        return
    if isinstance(url_timeout, bool) or not isinstance(url_timeout, (int, float)):
        return
    if settings.store_timeout <= url_timeout:
        return
    message = (
        f"store_timeout {settings.store_timeout:g}s is longer than the store URL's timeout "
        f"{url_timeout:g}s{'' if 'timeout' in parsed.query else ' (its default)'}: store calls still end "
        f"after {url_timeout:g}s; raise the URL's timeout= too (docs/configuration.md, "
        "'Which timeout applies')"
    )
    if message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


#: Warnings already logged by this process (each is logged once, however often settings are parsed).
_warned: set[str] = set()


def _field_repr(value: Any) -> str:
    return repr(redact(value)) if isinstance(value, str) else repr(value)
