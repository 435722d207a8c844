"""Every exception asyncconn raises, in one tree.

Library code translates foreign exceptions (redis-py's, OS errors, zmq's, torch's) into these types at the
boundary where they enter, so callers -- vLLM adapters above all -- only ever need to catch
:class:`AsyncConnError` or one of its branches. No builtin name is shadowed.

::

    AsyncConnError
    ├── ConfigError                 a bad URL, URL parameter or extra_config key/value (names it)
    │   ├── UnknownSchemeError      no backend registered for a URL scheme
    │   └── BackendNotInstalled     the scheme is known but its optional extra is missing
    ├── CodecError                  a payload that is not a valid frame (never a wrong tensor)
    │   ├── FrameTruncated          fewer bytes than the header promises
    │   ├── FrameCorrupt            bad magic, bad header field or checksum mismatch
    │   ├── FrameVersionError       a format version this build cannot read
    │   ├── FrameTooLarge           a declared size over the configured cap
    │   └── FrameMismatch           a valid frame whose dtype/shape differ from the destination
    ├── BackendError                a store operation failed
    │   ├── BackendUnavailable      the store cannot be reached (refused, reset, closed)
    │   └── BackendTimeout          the store did not answer within the timeout
    ├── RuntimeStateError           misuse of the loop runtime (closed, or blocking on its own thread)
    │   ├── RuntimeClosed
    │   ├── LoopThreadBlocked
    │   └── UsedAfterFork           a runtime, future or store of the parent process used in a forked child
    ├── TransferError               a transfer engine (loader, save tracker, pinned pool) refused a request
    │   ├── PoolTooSmall            a buffer larger than the whole pinned pool was asked for
    │   └── DuplicateTransfer       a key already in flight in the same loader was submitted again
    ├── InvalidInput                an argument a store call can never serve (a non-str key, a non-tensor,
    │                               a sparse or meta tensor, a value that is not bytes); also TypeError
    │                               and ValueError
    └── LookupProtocolError         a lookup message that breaks the wire format (bad frames, sizes, keys)
"""

from __future__ import annotations

__all__ = [
    "AsyncConnError",
    "BackendError",
    "BackendNotInstalled",
    "BackendTimeout",
    "BackendUnavailable",
    "CodecError",
    "ConfigError",
    "FrameCorrupt",
    "FrameMismatch",
    "FrameTooLarge",
    "FrameTruncated",
    "FrameVersionError",
    "LoopThreadBlocked",
    "RuntimeClosed",
    "RuntimeStateError",
    "UsedAfterFork",
    "UnknownSchemeError",
    "TransferError",
    "PoolTooSmall",
    "DuplicateTransfer",
    "InvalidInput",
    "LookupProtocolError",
]


class AsyncConnError(Exception):
    """Base of every error raised by asyncconn."""


class ConfigError(AsyncConnError, ValueError):
    """A configuration value is wrong; the message names the key or URL parameter."""


class UnknownSchemeError(ConfigError):
    """No storage backend is registered for the URL's scheme."""


class BackendNotInstalled(ConfigError):
    """The backend for a scheme exists but its optional dependency is not installed."""


class CodecError(AsyncConnError):
    """Bytes read from a store or socket are not a valid tensor frame."""


class FrameTruncated(CodecError):
    """The payload is shorter than its header says."""


class FrameCorrupt(CodecError):
    """Bad magic, an impossible header field, or a checksum mismatch."""


class FrameVersionError(CodecError):
    """The frame was written by a format version this build does not read."""


class FrameTooLarge(CodecError):
    """The frame declares a payload larger than the configured cap."""


class FrameMismatch(CodecError):
    """A valid frame whose dtype or shape does not fit the destination tensor."""


class BackendError(AsyncConnError):
    """A storage backend operation failed."""


class BackendUnavailable(BackendError):
    """The store could not be reached or dropped the connection."""


class BackendTimeout(BackendError):
    """The store did not answer within the configured timeout."""


class RuntimeStateError(AsyncConnError):
    """An object was used in a way its state cannot serve: the loop runtime (closed, blocked, forked), or a
    connector facade asked for the side of the role it was not built with."""


class RuntimeClosed(RuntimeStateError):
    """Work was submitted to a runtime that has been closed."""


class LoopThreadBlocked(RuntimeStateError):
    """A blocking wait was attempted on the runtime's own loop thread (it would deadlock)."""


class UsedAfterFork(RuntimeStateError):
    """A runtime, runtime future or store made before ``fork()`` was used in the child.

    Its loop thread and connections belong to the parent: the thread does not exist in the child, and a
    socket shared by two processes interleaves their replies. The child must make its own (the process-wide
    :func:`asyncconn.runtime.get_runtime` does so by itself).
    """


class TransferError(AsyncConnError):
    """A transfer engine refused a request (misuse, or a size it can never serve)."""


class PoolTooSmall(TransferError):
    """A staging buffer larger than the pinned pool's whole capacity was requested: it can never be served."""


class DuplicateTransfer(TransferError):
    """A key that is already being loaded by the same loader was submitted again."""


class InvalidInput(AsyncConnError, TypeError, ValueError):
    """A caller handed ``put``/``get`` (of a store or a backend) something no store can serve.

    Raised before any I/O, the same on every backend. It also derives from TypeError and ValueError, the
    builtins such a mistake used to surface as, so existing ``except`` clauses keep working.
    """


class LookupProtocolError(AsyncConnError):
    """A lookup request or reply breaks the wire format (frame count, field sizes, key encoding, caps)."""
