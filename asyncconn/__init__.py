"""asyncconn: asyncio-native connectors between vLLM and external stores that never stall the engine.

The public API is listed in ``__all__`` (a test keeps it honest). The names that need torch (the codec's
functions, :class:`TensorStore` and its records) are imported on first use, so ``import asyncconn`` -- and
with it ``asyncconn --help`` and every command that never touches a tensor -- does not pay torch's second of
import time; backends are resolved by URL scheme, never imported by the core.
"""

from __future__ import annotations

import importlib
import typing

from asyncconn.backend import (
    StorageBackend,
    available_schemes,
    open_backend,
    register_backend,
    resolve_backend,
)
from asyncconn.config import Settings
from asyncconn.exceptions import (
    AsyncConnError,
    BackendError,
    BackendNotInstalled,
    BackendTimeout,
    BackendUnavailable,
    CodecError,
    ConfigError,
    DuplicateTransfer,
    FrameCorrupt,
    FrameMismatch,
    FrameTooLarge,
    FrameTruncated,
    FrameVersionError,
    InvalidInput,
    LookupProtocolError,
    LoopThreadBlocked,
    PoolTooSmall,
    RuntimeClosed,
    RuntimeStateError,
    TransferError,
    UnknownSchemeError,
    UsedAfterFork,
)
from asyncconn.runtime import Runtime, get_runtime, shutdown_runtime
from asyncconn.url import StoreURL, parse_url, redact

if typing.TYPE_CHECKING:
    from asyncconn.codec import decode, decode_into, encode, encode_parts
    from asyncconn.store import Fetch, StoreStats, TensorStore

#: name -> the module that defines it, imported by :func:`__getattr__` on first use (these import torch).
_LAZY: dict[str, str] = {
    "decode": "asyncconn.codec",
    "decode_into": "asyncconn.codec",
    "encode": "asyncconn.codec",
    "encode_parts": "asyncconn.codec",
    "Fetch": "asyncconn.store",
    "StoreStats": "asyncconn.store",
    "TensorStore": "asyncconn.store",
}

__version__ = "0.1.0"

__all__ = [
    "AsyncConnError",
    "BackendError",
    "BackendNotInstalled",
    "BackendTimeout",
    "BackendUnavailable",
    "CodecError",
    "ConfigError",
    "DuplicateTransfer",
    "Fetch",
    "FrameCorrupt",
    "FrameMismatch",
    "FrameTooLarge",
    "FrameTruncated",
    "FrameVersionError",
    "InvalidInput",
    "LookupProtocolError",
    "LoopThreadBlocked",
    "PoolTooSmall",
    "Runtime",
    "RuntimeClosed",
    "UsedAfterFork",
    "RuntimeStateError",
    "Settings",
    "StorageBackend",
    "StoreStats",
    "StoreURL",
    "TensorStore",
    "TransferError",
    "UnknownSchemeError",
    "__version__",
    "available_schemes",
    "decode",
    "decode_into",
    "encode",
    "encode_parts",
    "get_runtime",
    "open_backend",
    "parse_url",
    "redact",
    "register_backend",
    "resolve_backend",
    "shutdown_runtime",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'asyncconn' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
