"""asyncconn's log lines in vLLM's own format, and the one line each connector logs when it starts.

Why: inside vLLM, asyncconn's loggers had no handler of their own. Python's last-resort handler printed
their warnings bare -- no timestamp, level or process -- and dropped every INFO line, so an operator could
neither date a "store unreachable" nor see which store and settings an engine started with. vLLM configures
one handler on its ``vllm`` logger (format: process name and pid, level, time, file:line); the connectors
attach that same handler to the ``asyncconn`` logger when they are built, so our lines look like vLLM's and
go where vLLM's go. The core package never imports vLLM; this module reads only the standard ``logging``
tree, so it costs nothing where vLLM is absent.

No line is printed twice: nothing is attached when the ``asyncconn`` logger already has a handler or when the
root logger has one (someone configured logging for the whole process; our records already reach it).
"""

from __future__ import annotations

import logging
from typing import Any

from asyncconn.config import Settings
from asyncconn.url import redact

__all__ = ["PACKAGES", "attach_handlers", "follow_vllm_logging", "log_start", "warn_inline_password"]

log = logging.getLogger("asyncconn.vllm")

_warned: set[str] = set()  # extra_config fields whose inline password was already warned about


#: Our loggers' roots: the core and adapters, and the built-in backends (installed as ``asyncconn_backends``).
PACKAGES = ("asyncconn", "asyncconn_backends")


def follow_vllm_logging() -> bool:
    """Give our loggers (:data:`PACKAGES`) vLLM's handler (and level) when vLLM configured its logging.

    Returns True when asyncconn's lines now go through vLLM's handler. Safe to call from every connector
    constructor: the second call changes nothing.
    """
    source, root = logging.getLogger("vllm"), logging.getLogger()
    return all([attach_handlers(source, logging.getLogger(name), root) for name in PACKAGES])


def attach_handlers(source: logging.Logger, target: logging.Logger, root: logging.Logger) -> bool:
    """Add ``source``'s handlers to ``target`` (and its level, when ``target`` has none), unless that would
    print a line twice or override a configuration someone chose (see the module docstring)."""
    handlers = list(source.handlers)
    if not handlers:  # VLLM_CONFIGURE_LOGGING=0 or a custom config without a vllm handler: not ours to set
        return False
    if all(h in target.handlers for h in handlers):
        return True
    if target.handlers or root.handlers:
        return False
    for handler in handlers:
        target.addHandler(handler)
    if target.level == logging.NOTSET:
        target.setLevel(source.level)  # vLLM's level (VLLM_LOGGING_LEVEL): the start-up line is INFO
    return True


def log_start(kind: str, role: str, settings: Settings, **details: Any) -> None:
    """The connector's start-up line: which store (redacted), which role, and the settings an operator
    changed -- enough to tell two engines sharing one store apart in their logs."""
    changed = settings.non_defaults()
    changed.pop("backend_url", None)
    shown = ", ".join(f"{k}={v!r}" for k, v in changed.items()) or "none"
    facts = "".join(f", {k}={v}" for k, v in details.items())
    log.info(
        "asyncconn %s connector started: role=%s, store=%s%s; non-default settings: %s",
        kind,
        role,
        redact(settings.backend_url),
        facts,
        shown,
    )


def warn_inline_password(settings: Settings, field: str) -> None:
    """Once per process and field: the store URL carries its password, which vLLM prints with ``field``."""
    if field in _warned or not settings.inline_password():
        return
    _warned.add(field)
    log.warning(
        "%s: backend_url holds its password inline, and vLLM prints %s verbatim at start-up, so the "
        "password reaches the log. Name it instead: add password_env=VARIABLE or password_file=PATH to the "
        "URL's query and drop it from the URL (docs/configuration.md, Passwords).",
        field,
        field,
    )
