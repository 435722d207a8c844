"""asyncconn: asyncio-native connectors between vLLM and external stores that never stall the engine.

The public API is listed in ``__all__`` (a test keeps it honest). Submodules load lazily where they pull
in heavy dependencies; backends are resolved by URL scheme, never imported by the core.
"""

from __future__ import annotations

from asyncconn.backend import (
    StorageBackend,
    available_schemes,
    open_backend,
    register_backend,
    resolve_backend,
)
from asyncconn.codec import decode, decode_into, encode, encode_parts
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
    SimulationError,
    TransferError,
    UnknownSchemeError,
    UsedAfterFork,
)
from asyncconn.runtime import Runtime, get_runtime, shutdown_runtime
from asyncconn.store import Fetch, StoreStats, TensorStore
from asyncconn.url import StoreURL, parse_url, redact

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
    "SimulationError",
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
