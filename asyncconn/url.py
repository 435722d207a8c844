"""The one URL parser: a store URL -> :class:`StoreURL`, query parameters coerced through a table.

Backends declare their parameters as a mapping of name -> :class:`Param`; :meth:`StoreURL.options` coerces
every query parameter through that table and raises :class:`ConfigError` naming the parameter for an unknown
name or a bad value (redis-py's ``from_url`` style). Passwords never leave this module unredacted:
``str(url)``, ``repr(url)`` and :func:`redact` print ``***`` in their place, for any text (a URL the parser
refuses included), and :func:`scrub` removes a URL's known secrets from any message. A URL may name its
password instead of holding it: ``password_env=NAME`` or ``password_file=PATH``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, quote, unquote, urlsplit

from asyncconn.exceptions import ConfigError

__all__ = [
    "MAX_COUNT",
    "MAX_DURATION",
    "MAX_SIZE",
    "PASSWORD_PARAMS",
    "Param",
    "StoreURL",
    "parse_bool",
    "parse_count",
    "parse_duration",
    "parse_size",
    "parse_url",
    "redact",
    "scrub",
    "url_secrets",
    "with_param",
    "with_password_from",
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
_DURATION_UNITS = {
    "": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0,
}  # fmt: skip
_NUM_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

#: The largest size accepted anywhere (1 PiB): a bigger figure is a typo, and Python would carry it on
#: as an int no allocator or socket call could use.
MAX_SIZE = 1 << 50
#: The longest duration accepted anywhere (ten years): the thread and socket calls a timeout reaches refuse
#: much larger values (``threading.TIMEOUT_MAX``), and infinity means "hang", which nothing here may do.
MAX_DURATION = 10 * 365 * 86400.0
#: The largest count accepted anywhere: counts size queues, pools and semaphores.
MAX_COUNT = (1 << 31) - 1


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def parse_size(text: str | int) -> int:
    """``"512MiB"`` -> 536870912; plain integers are bytes. Raises ``ValueError``/``TypeError`` otherwise.

    Accepted: a non-negative integer (or an integral float, as JSON may give one) or text such as ``4096``,
    ``16MiB``, ``1.5GB``. Refused: booleans, ``null``, fractions of a byte, NaN, infinity and more than
    :data:`MAX_SIZE`.
    """
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise TypeError(f"expected a size such as 4096 or 16MiB, got {_kind(text)}")
    if isinstance(text, str):
        m = _NUM_UNIT.match(text)
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ValueError(f"not a size: {text[:40]!r} (use e.g. 4096, 16MiB, 1GB)")
        number, unit = float(m.group(1)), _SIZE_UNITS[m.group(2).lower()]
        if unit == 1 and not number.is_integer():
            raise ValueError(f"not a whole number of bytes: {text[:40]!r}")
        value: float = number * unit
    else:
        value = text
    if not math.isfinite(value):
        raise ValueError(f"size must be finite, got {value}")
    if not float(value).is_integer() and not isinstance(text, str):
        raise ValueError(f"not a whole number of bytes: {value}")
    if value < 0:
        raise ValueError("size must be >= 0")
    if value > MAX_SIZE:
        raise ValueError(f"size must be at most {MAX_SIZE} bytes (1PiB)")
    return int(value)


def parse_duration(text: str | float) -> float:
    """``"250ms"`` -> 0.25 seconds; a bare number is seconds. Raises ``ValueError``/``TypeError`` otherwise.

    Refused: booleans, ``null``, negative values, NaN, infinity and more than :data:`MAX_DURATION`.
    """
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise TypeError(f"expected a duration such as 2, 2s or 500ms, got {_kind(text)}")
    if isinstance(text, str):
        m = _NUM_UNIT.match(text)
        if not m or m.group(2).lower() not in _DURATION_UNITS:
            raise ValueError(f"not a duration: {text[:40]!r} (use e.g. 2, 2s, 500ms, 30m, 1h)")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2).lower()]
    else:
        seconds = float(text)
    if not math.isfinite(seconds):
        raise ValueError(f"duration must be finite, got {seconds}")
    if seconds < 0:
        raise ValueError("duration must be >= 0")
    if seconds > MAX_DURATION:
        raise ValueError(f"duration must be at most {MAX_DURATION:g}s (ten years)")
    return seconds


def parse_bool(text: str | bool) -> bool:
    """Accept ``true``/``false`` (and the usual spellings as text); reject everything else rather than guess.

    A JSON number is refused even when it is 0 or 1: ``"sync_lookup": 1`` is more often a value meant for
    another key than a boolean.
    """
    if isinstance(text, bool):
        return text
    if not isinstance(text, str):
        raise TypeError(f"expected true or false, got {_kind(text)}")
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text[:40]!r} (use true/false)")


def parse_count(text: str | float) -> int:
    """A whole number from 1 to :data:`MAX_COUNT`: an int, an integral float, or decimal digits as text."""
    if isinstance(text, bool) or not isinstance(text, (int, float, str)):
        raise TypeError(f"expected a whole number, got {_kind(text)}")
    if isinstance(text, float):
        if not math.isfinite(text) or not text.is_integer():
            raise ValueError(f"expected a whole number, got {text}")
        value = int(text)
    elif isinstance(text, str):
        if not re.fullmatch(r"\s*[0-9]{1,19}\s*", text):
            raise ValueError(f"expected a whole number, got {text[:40]!r}")
        value = int(text)
    else:
        value = text
    if value <= 0:
        raise ValueError("must be > 0")
    if value > MAX_COUNT:
        raise ValueError(f"must be at most {MAX_COUNT}")
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
        return Param(parse_count, default, doc)

    @staticmethod
    def text(default: str | None, doc: str) -> Param:
        return Param(str, default, doc)


@dataclass(frozen=True)
class StoreURL:
    """A parsed store URL. ``hosts`` keeps every ``host:port`` of a comma-separated authority.

    ``password`` is the userinfo's password, or the one ``password_env`` / ``password_file`` named (then
    ``password_from`` says which); neither it nor ``raw`` appears in ``repr()`` or ``str()``.
    """

    raw: str = field(repr=False)
    scheme: str
    username: str | None
    password: str | None = field(repr=False)
    hosts: tuple[tuple[str, int | None], ...]
    path: str
    query: Mapping[str, str] = field(repr=False)
    password_from: str | None = None

    @property
    def host(self) -> str | None:
        return self.hosts[0][0] if self.hosts else None

    @property
    def port(self) -> int | None:
        return self.hosts[0][1] if self.hosts else None

    def secrets(self) -> tuple[str, ...]:
        """Every text that must never be printed: the raw URL's secrets plus a password read from the
        environment or a file (for :func:`scrub`)."""
        extra = [self.password] if self.password else []
        return tuple(dict.fromkeys([*url_secrets(self.raw), *extra, *_encodings(extra)]))

    def options(self, table: Mapping[str, Param]) -> dict[str, Any]:
        """Coerce the query through ``table``: defaults filled in, unknown or bad values rejected by name."""
        unknown = sorted(set(self.query) - set(table))
        if unknown:
            accepted = ", ".join(sorted(table))
            name = unknown[0]
            raise ConfigError(f"{self.scheme}:// URL: unknown parameter {name!r} (accepted: {accepted})")
        out: dict[str, Any] = {}
        for name, param in table.items():
            if name not in self.query:
                out[name] = param.default
                continue
            try:
                out[name] = param.coerce(self.query[name])
            except (ValueError, TypeError, OverflowError) as exc:
                reason = str(exc)
            else:
                continue
            shown = scrub(repr(self.query[name][:80]), self.secrets())
            raise ConfigError(f"{self.scheme}:// URL: bad value {shown} for parameter {name!r}: {reason}")
        return out

    def __str__(self) -> str:
        return redact(self.raw)

    def __repr__(self) -> str:
        return f"StoreURL({redact(self.raw)!r})"


#: Where a URL may name its password instead of holding it (see docs/configuration.md, "Passwords").
PASSWORD_PARAMS = ("password_env", "password_file")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MAX_PASSWORD_FILE = 64 << 10
_AMBIGUOUS_AT = (
    "an '@' after the host is ambiguous (part of a password?): percent-encode a password's reserved "
    "characters (/ ? # @ % as %2F %3F %23 %40 %25), and an '@' in a path or parameter as %40"
)


def parse_url(url: str) -> StoreURL:
    """Parse ``scheme://[user[:password]@]host[:port][,host[:port]...][/path][?k=v&...]``.

    Every failure is a :class:`ConfigError` whose text shows the URL redacted, with no cause or context
    attached (a chained parser error could quote the password). A password may contain any character if
    percent-encoded; an unencoded ``/ ? #`` in it would move the end of the host part, so an ``@`` after
    the host is refused rather than guessed at.
    """
    try:
        return _parse(url)
    except ConfigError as exc:
        error: ConfigError = type(exc)(*exc.args)
    except Exception:  # urlsplit's "Invalid IPv6 URL", NFKC checks, whatever a malformed URL trips
        error = ConfigError(f"bad store URL {_shown(url)}")
    raise error  # outside the handler: the new error carries no context


def _shown(url: object) -> str:
    return repr(redact(str(url)))


def _parse(url: str) -> StoreURL:
    if not isinstance(url, str) or "://" not in url:
        raise ConfigError(f"not a store URL: {_shown(url)} (expected scheme://...)")
    scheme, rest = url.split("://", 1)
    scheme = scheme.lower()
    if not re.fullmatch(r"[a-z][a-z0-9+.-]*", scheme):
        raise ConfigError(f"bad URL scheme in {_shown(url)}")
    end = min((i for i in map(rest.find, "/?#") if i >= 0), default=len(rest))
    if "@" in rest[end:]:
        raise ConfigError(f"bad store URL {_shown(url)}: {_AMBIGUOUS_AT}")
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
        hosts.append(_split_host_port(item, url))
    query: dict[str, str] = {}
    try:
        pairs = parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query))
    except ValueError:
        raise ConfigError(f"bad query string in URL {_shown(url)}") from None
    for key, value in pairs:
        if key in query:
            raise ConfigError(f"URL parameter {key!r} given twice in {_shown(url)}")
        query[key] = value
    password_from = "userinfo" if password is not None else None
    given = [name for name in PASSWORD_PARAMS if name in query]
    if given:
        if len(given) > 1 or password is not None:
            raise ConfigError(
                f"{scheme}:// URL: give the password once (password_env, password_file or in the URL)"
            )
        password = _read_password(given[0], query.pop(given[0]), scheme)
        password_from = given[0]
    return StoreURL(
        raw=url,
        scheme=scheme,
        username=username,
        password=password,
        hosts=tuple(hosts),
        path=unquote(parts.path),
        query=query,
        password_from=password_from,
    )


def with_param(url: str, name: str, value: str) -> str:
    """``url`` with its query parameter ``name`` set to ``value``: any given before is dropped, the others are
    kept as written, and ``name=value`` goes last (``value`` as written: quote it if it needs it)."""
    head, hash_sign, fragment = url.partition("#")
    base, _, query = head.partition("?")
    params = [p for p in query.split("&") if p and p.split("=", 1)[0] != name]
    return f"{base}?{'&'.join([*params, f'{name}={value}'])}{hash_sign}{fragment}"


def with_password_from(url: str, *, env: str | None = None, file: str | None = None) -> str:
    """``url`` with ``password_env=env`` / ``password_file=file`` added (for command-line flags)."""
    extra = [(name, value) for name, value in (("password_env", env), ("password_file", file)) if value]
    if not extra:
        return url
    head, hash_sign, fragment = url.partition("#")
    query = "&".join(f"{name}={quote(value, safe='/')}" for name, value in extra)
    joiner = "&" if "?" in head else "?"
    return f"{head}{joiner}{query}{hash_sign}{fragment}"


def _read_password(param: str, where: str, scheme: str) -> str:
    """The password an environment variable or a file holds (its one line, without the line break).

    Why a file or variable: a password on a command line is visible to every user through ``ps``; a
    Kubernetes or systemd secret arrives as a file or an environment variable instead.
    """
    what = f"{scheme}:// URL: parameter {param!r}"
    if param == "password_env":
        if not _ENV_NAME.fullmatch(where):
            raise ConfigError(f"{what}: {where[:80]!r} is not an environment variable name")
        value = os.environ.get(where)
        if value is None:
            raise ConfigError(f"{what}: environment variable {where!r} is not set")
        text = value
    else:
        try:
            with open(where, "rb") as f:
                data = f.read(_MAX_PASSWORD_FILE + 1)
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
            raise ConfigError(f"{what}: cannot read {where!r}: {reason}") from None
        if len(data) > _MAX_PASSWORD_FILE:
            raise ConfigError(f"{what}: {where!r} is larger than {_MAX_PASSWORD_FILE} bytes")
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ConfigError(f"{what}: {where!r} is not UTF-8 text") from None
        text = text.removesuffix("\n").removesuffix("\r")
        if "\n" in text:
            raise ConfigError(f"{what}: {where!r} holds more than one line")
    if not text:
        raise ConfigError(f"{what}: the password in {where!r} is empty")
    return text


def _split_host_port(item: str, url: str) -> tuple[str, int | None]:
    if item.startswith("["):  # [::1]:6379
        host, bracket, tail = item[1:].partition("]")
        if not bracket or (tail and not tail.startswith(":")):
            raise ConfigError(f"bad IPv6 address in URL {_shown(url)}")
        port_text = tail[1:]
    else:
        host, _, port_text = item.partition(":")
    if not port_text:
        return unquote(host), None
    if not port_text.isdigit():
        raise ConfigError(f"bad port in URL {_shown(url)}")
    port = int(port_text)
    if not 0 < port < 65536:
        raise ConfigError(f"port {port} out of range in URL {_shown(url)}")
    return unquote(host), port


# Query parameters whose value is a secret (their names are printed, their values never).
_SECRET_QUERY = re.compile(
    r"(?i)([?&;](?:password|passwd|pass|pwd|token|secret|key|auth|credentials?|access_key|secret_key)=)"
    r"([^&]*)"
)
# The characters a user name may have (RFC 3986 userinfo without ':'); a "user" outside this set may be
# a fragment of a password and is hidden with it.
_USER = re.compile(r"[A-Za-z0-9._~!$'()*+,;=%-]*")
_LEADING_SCHEME = re.compile(r"^\s*[A-Za-z][A-Za-z0-9+.-]*://")


def _userinfo_span(text: str) -> tuple[int, int] | None:
    """Where the userinfo of a URL-shaped text lies, or None when it has no ``@``.

    The rule cannot be fooled by an unencoded password: the userinfo runs from the scheme's ``://`` (or
    the start of the text, when it does not begin with a scheme) to the *last* ``@`` anywhere. A password
    holding ``/ ? # @`` therefore stays hidden; the price is that an ``@`` in a path or parameter hides
    the host as well, which the parser refuses anyway.
    """
    at = text.rfind("@")
    if at < 0:
        return None
    lead = _LEADING_SCHEME.match(text)
    start = lead.end() if lead and lead.end() <= at else 0
    return start, at


def redact(url: str) -> str:
    """Hide the password of a URL (its userinfo and secret-looking query parameters) for logs and errors.

    Works on any text, parseable or not: ``redis://:pw@[::1:6379`` -> ``redis://:***@[::1:6379``. A
    userinfo without ``:`` is hidden whole (``redis://secret@host`` is a password-only Redis URL).
    """
    text = str(url)
    span = _userinfo_span(text)
    if span is not None:
        start, at = span
        user, colon, _ = text[start:at].partition(":")
        keep = f"{user}:" if colon and _USER.fullmatch(user) else ""
        text = f"{text[:start]}{keep}***{text[at:]}"
    return _SECRET_QUERY.sub(r"\1***", text)


def url_secrets(url: str) -> tuple[str, ...]:
    """The texts of ``url`` that are secret (raw and percent-decoded), for :func:`scrub`.

    Made without parsing, so it works for URLs the parser refuses.
    """
    text = str(url)
    found: list[str] = []
    span = _userinfo_span(text)
    if span is not None:
        userinfo = text[span[0] : span[1]]
        user, colon, password = userinfo.partition(":")
        found.append(password if colon and _USER.fullmatch(user) else userinfo)
    found += [m.group(2) for m in _SECRET_QUERY.finditer(text)]
    found = [s for s in found if s]
    return tuple(dict.fromkeys([*found, *_encodings(found)]))


def _encodings(secrets: list[str]) -> list[str]:
    """The other spellings a secret may take in a message: decoded, and percent-encoded."""
    out: list[str] = []
    for s in secrets:
        out += [unquote(s), unquote(s.replace("+", " ")), quote(s, safe=""), quote(s)]
    return [s for s in out if s]


def scrub(text: str, secrets: tuple[str, ...] | list[str]) -> str:
    """``text`` with every occurrence of each secret replaced by ``***`` (longest first)."""
    for secret in sorted(secrets, key=len, reverse=True):
        if secret:
            text = text.replace(secret, "***")
    return text


def quote_key(key: str) -> str:
    """Percent-encode a key for use in paths; exported for backends that map keys to names."""
    return quote(key, safe="")
