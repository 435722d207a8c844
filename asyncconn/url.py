"""The one URL parser: a store URL -> :class:`StoreURL`, query parameters coerced through a table.

Backends declare their parameters as a mapping of name -> :class:`Param`; :meth:`StoreURL.options` coerces
every query parameter through that table and raises :class:`ConfigError` naming the parameter for an unknown
name or a bad value (redis-py's ``from_url`` style). Passwords never leave this module unredacted:
``str(url)`` and :func:`redact` print ``***`` in their place.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from asyncconn.exceptions import ConfigError

__all__ = [
    "Param",
    "StoreURL",
    "parse_bool",
    "parse_duration",
    "parse_size",
    "parse_url",
    "redact",
]

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_UNITS = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0}
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes. Raises ``ValueError`` for anything else."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError("size must be >= 0")
        return text
    m = _NUM_UNIT.match(text)
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 16MiB, 1GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


def parse_duration(text: str | float) -> float:
    """``"250ms"`` -> 0.25 seconds; a bare number is seconds. Raises ``ValueError`` for anything else."""
    if isinstance(text, (int, float)):
        if text < 0:
            raise ValueError("duration must be >= 0")
        return float(text)
    m = _NUM_UNIT.match(text)
    if not m or m.group(2).lower() not in _DURATION_UNITS:
        raise ValueError(f"not a duration: {text!r} (use e.g. 2, 2s, 500ms)")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]


def parse_bool(text: str | bool) -> bool:
    """Accept the usual spellings of a boolean; reject everything else rather than guess."""
    if isinstance(text, bool):
        return text
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false)")


def _positive_int(text: str | int) -> int:
    value = int(text)
    if value <= 0:
        raise ValueError("must be > 0")
    return value


@dataclass(frozen=True)
class Param:
    """One accepted query parameter: how to coerce it, its default, and a line of documentation."""

    coerce: Callable[[str], Any]
    default: Any
    doc: str

    @staticmethod
    def size(default: int, doc: str) -> Param:
        return Param(parse_size, default, doc)

    @staticmethod
    def duration(default: float, doc: str) -> Param:
        return Param(parse_duration, default, doc)

    @staticmethod
    def boolean(default: bool, doc: str) -> Param:
        return Param(parse_bool, default, doc)

    @staticmethod
    def count(default: int, doc: str) -> Param:
        return Param(_positive_int, default, doc)

    @staticmethod
    def text(default: str | None, doc: str) -> Param:
        return Param(str, default, doc)


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``hosts`` keeps every ``host:port`` of a comma-separated authority."""

    raw: str = field(repr=False)
    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    query: Mapping[str, str]

    @property
    def host(self) -> str | None:
        return self.hosts[0][0] if self.hosts else None

    @property
    def port(self) -> int | None:
        return self.hosts[0][1] if self.hosts else None

    def options(self, table: Mapping[str, Param]) -> dict[str, Any]:
        """Coerce the query through ``table``: defaults filled in, unknown or bad values rejected by name."""
        unknown = sorted(set(self.query) - set(table))
        if unknown:
            accepted = ", ".join(sorted(table))
            name = unknown[0]
            raise ConfigError(f"{self.scheme}:// URL: unknown parameter {name!r} (accepted: {accepted})")
        out: dict[str, Any] = {}
        for name, param in table.items():
            if name in self.query:
                try:
                    out[name] = param.coerce(self.query[name])
                except (ValueError, TypeError) as exc:
                    raise ConfigError(
                        f"{self.scheme}:// URL: bad value {self.query[name]!r} for parameter {name!r}: {exc}"
                    ) from None
            else:
                out[name] = param.default
        return out

    def __str__(self) -> str:
        return redact(self.raw)


def parse_url(url: str) -> StoreURL:
    """Parse ``scheme://[user[:password]@]host[:port][,host[:port]...][/path][?k=v&...]``."""
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"not a store URL: {redact(str(url))!r} (expected scheme://...)")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ConfigError(f"bad URL scheme {scheme!r}")
    # urlsplit refuses comma-separated multi-host authorities' ports; split the authority ourselves.
    parts = urlsplit("x://" + rest)
    netloc = parts.netloc
    username = password = None
    if "@" in netloc:
        userinfo, netloc = netloc.rsplit("@", 1)
        user, sep, pw = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(pw) if sep else None
    hosts: list[tuple[str, int | None]] = []
    for item in filter(None, netloc.split(",")):
        host, port = _split_host_port(item, url)
        hosts.append((host, port))
    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ConfigError(f"bad query string in URL {redact(url)!r}") from None
    for key, value in pairs:
        if key in query:
            raise ConfigError(f"URL parameter {key!r} given twice in {redact(url)!r}")
        query[key] = value
    return StoreURL(
        raw=url,
        scheme=scheme,
        username=username,
        password=password,
        hosts=tuple(hosts),
        path=unquote(parts.path),
        query=query,
    )


def _split_host_port(item: str, url: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [::1]:6379
        host, _, tail = item[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = item.partition(":")
    if not port_text:
        return unquote(host), None
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"bad port {port_text!r} in URL {redact(url)!r}") from None
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} out of range in URL {redact(url)!r}")
    return unquote(host), port


_SECRET_QUERY = re.compile(r"(?i)([?&](?:password|passwd|token|secret|key)=)[^&]*")


def redact(url: str) -> str:
    """Hide the password (userinfo and secret-looking query parameters) of a URL for logs and errors."""
    if "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    cut = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        userinfo, host = authority.rsplit("@", 1)
        user, sep, _ = userinfo.partition(":")
        if sep:
            authority = f"{user}:***@{host}"
        elif scheme.lower().startswith(("redis", "rediss", "unix")):
            authority = f"***@{host}"  # redis://secret@host is a password-only URL
    return _SECRET_QUERY.sub(r"\1***", f"{scheme}://{authority}{tail}")


def quote_key(key: str) -> str:
    """Percent-encode a key for use in paths; exported for backends that map keys to names."""
    return quote(key, safe="")
