"""Checking a connector's ``extra_config`` as vLLM hands it over: one exception, one message, early.

Why: a typo in ``kv_connector_extra_config`` used to surface only when the engine built the connector --
after the model had loaded (67-94 s) -- and vLLM's processes then printed it in several tracebacks. The KV
connector runs this check from the one class method vLLM calls with the extra config while it builds its
configuration in the front-end process (``requires_piecewise_for_cudagraph``; see
:class:`~asyncconn.vllm.kv.connector.AsyncConnKVConnector`), and every connector runs it again in its
constructor, so the wording is the same wherever it fails.

What is checked is all of :meth:`Settings.from_extra_config`: keys, types, URL syntax, URL parameters, and
that the password a URL names exists (``password_env`` set, ``password_file`` readable).
"""

from __future__ import annotations

from typing import Any

from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError
from asyncconn.vllm.logs import warn_inline_password

__all__ = ["check_extra_config"]


def check_extra_config(extra: Any, field: str) -> Settings:
    """The settings in ``extra`` (vLLM's ``field``, e.g. ``kv_connector_extra_config``).

    Raises :class:`ConfigError` (or its subclass that :meth:`Settings.from_extra_config` raised) whose
    message names ``field``, the key and what is wrong, with nothing chained: the message is the whole story
    and no secret can hide in a cause. A URL holding its password inline is accepted, with a warning.
    """
    try:
        settings = Settings.from_extra_config(extra)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith("extra_config:"):
            message = field + message[len("extra_config") :]
        else:
            message = f"{field}: {message}"
        error = _same_kind(exc, message)
    else:
        warn_inline_password(settings, field)
        return settings
    raise error from None


def _same_kind(exc: ConfigError, message: str) -> ConfigError:
    """``exc``'s type with ``message`` (a subclass such as ``BackendNotInstalled`` stays itself)."""
    try:
        return type(exc)(message)
    except TypeError:  # a subclass with another constructor: the base type says the same
        return ConfigError(message)
