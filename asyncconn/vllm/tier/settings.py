"""The tier's settings: the keys of its entry in vLLM's ``secondary_tiers`` list.

vLLM's tier factory hands every key of the entry except ``type``, ``module_path`` and ``backpressure`` to
the tier's constructor. The keys the tier shares with the connectors (``backend_url``, ``key_prefix``, the
timeouts, ``lookup_max_pending``) are parsed by :meth:`asyncconn.config.Settings.parse_value`, so they take
the same values, refuse the same mistakes and redact the same secrets; the connector-only keys are refused
here rather than silently ignored. docs/configuration.md lists the table (a test keeps the two in step).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from asyncconn.config import DEFAULT_BACKEND_URL, Settings
from asyncconn.exceptions import ConfigError
from asyncconn.url import parse_count

__all__ = ["TIER_FIELD", "TierSettings"]

#: How errors name where the bad key is.
TIER_FIELD = "secondary_tiers[AsyncConnTier]"
_LOCALITIES = ("LOCAL", "REMOTE")


def _shared(default: Any, doc: str) -> Any:
    """A key parsed exactly as the connectors' key of the same name."""
    return field(default=default, metadata={"shared": True, "doc": doc})


@dataclass(frozen=True)
class TierSettings:
    """Settings of one asyncconn secondary tier. Build with :meth:`from_tier_config`."""

    backend_url: str = _shared(DEFAULT_BACKEND_URL, "store URL; its scheme picks the backend")
    key_prefix: str = _shared("", "start of every key the tier names (after the URL's own `prefix`)")
    lookup_timeout: float = _shared(3.0, "a presence check unanswered after this is a miss")
    lookup_max_pending: int = _shared(100_000, "presence checks outstanding at once; more are misses")
    store_timeout: float = _shared(5.0, "bound on each store call (exists, get, put)")
    connect_timeout: float = _shared(10.0, "bound on connecting to the store at engine start-up")
    max_inflight_transfers: int = field(
        default=16,
        metadata={
            "shared": False,
            "doc": "chunks read or written at once; more wait their turn on the loop (each holds a chunk "
            "of staging memory)",
        },
    )
    locality: str | None = field(
        default=None,
        metadata={
            "shared": False,
            "doc": "vLLM's tier locality, `LOCAL` or `REMOTE` (matched by per-request tier filters)",
        },
    )

    @classmethod
    def from_tier_config(cls, config: Mapping[str, Any]) -> TierSettings:
        """Parse the tier's keys; an unknown key or a bad value raises ConfigError naming it."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(str(k) for k in config if k not in known)
        if unknown:
            raise ConfigError(
                f"{TIER_FIELD}: unknown key {unknown[0][:80]!r} (accepted: {', '.join(sorted(known))})"
            )
        values = {name: cls._parse(known[name], value) for name, value in config.items()}
        return cls(**values)

    @staticmethod
    def _parse(spec: dataclasses.Field[Any], value: Any) -> Any:
        name = spec.name
        if spec.metadata["shared"]:
            try:
                return Settings.parse_value(name, value)
            except ConfigError as exc:
                message = str(exc).replace("extra_config:", f"{TIER_FIELD}:", 1)
            raise ConfigError(message)  # outside the handler: nothing chained can quote a secret
        if name == "locality":
            if value is None or value in _LOCALITIES:
                return value
            raise ConfigError(f"{TIER_FIELD}: 'locality': expected one of {', '.join(_LOCALITIES)} or null")
        try:
            return parse_count(value)
        except (TypeError, ValueError, OverflowError) as exc:
            reason = str(exc)
        raise ConfigError(f"{TIER_FIELD}: {name!r}: bad value {value!r}: {reason}")

    @classmethod
    def documentation(cls) -> list[tuple[str, Any, str]]:
        """(key, default, meaning) for every key (used by the docs test)."""
        return [(f.name, f.default, f.metadata["doc"]) for f in dataclasses.fields(cls)]
