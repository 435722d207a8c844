"""CURVE encryption and authentication for the lookup server when it is reachable beyond this host.

The lookup wire format carries no secret values, but a network peer that can query the server learns which
blocks and images are cached (a timing/content oracle) and can load the store with lookups. So a
non-loopback TCP bind requires CURVE (``LookupServer`` refuses it otherwise, unless told ``insecure``).

Keys are ZMQ Z85 strings (40 characters for 32 bytes), given inline or as a file: either a file holding
just the Z85 key, or a ZMQ certificate file (``zmq.auth.create_certificates``). Certificate files are
parsed by pyzmq's ZPL reader, which only splits ``key = "value"`` lines -- nothing is evaluated. The
server needs only its secret key (the public one is derived); clients need the server's public key.
Optionally the server admits only client public keys found in a directory of certificate files (ZAP,
answered by pyzmq's asyncio authenticator on the server's own loop -- the server's connection gate, see
``lookup.gate``); without it any client that knows the server's public key may connect, and traffic is
still encrypted.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.asyncio import AsyncioAuthenticator

from asyncconn.exceptions import ConfigError

__all__ = [
    "CurveClientKeys",
    "CurveServerKeys",
    "apply_client",
    "apply_server",
    "configure_authenticator",
    "is_loopback",
    "load_key",
]

_LOOPBACK = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:", "ipc://", "inproc://")
_Z85_LEN = 40


def is_loopback(endpoint: str) -> bool:
    """Whether a ZMQ endpoint is only reachable from this host (loopback TCP, ipc, inproc)."""
    return endpoint.startswith(_LOOPBACK)


def _checked(key: bytes, what: str) -> bytes:
    if len(key) != _Z85_LEN:
        raise ConfigError(f"{what}: a CURVE key is {_Z85_LEN} Z85 characters, got {len(key)}")
    try:
        raw = zmq.utils.z85.decode(key)
    except (ValueError, KeyError, binascii.Error, IndexError):
        raise ConfigError(f"{what}: not a Z85-encoded CURVE key") from None
    if len(raw) != 32:
        raise ConfigError(f"{what}: a CURVE key decodes to 32 bytes")
    return key


def load_key(value: str | bytes, *, what: str = "curve key", secret: bool = False) -> bytes:
    """A Z85 key from an inline string or a file (a bare key, or a ZMQ certificate file).

    ``secret`` picks the secret key of a certificate file. Error messages never echo the value: it may be
    a secret key.
    """
    if isinstance(value, bytes):
        return _checked(value.strip(), what)
    if len(value) == _Z85_LEN and not Path(value).exists():
        return _checked(value.encode("ascii", "replace"), what)
    path = Path(value)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read key file {str(path)!r}: {exc.strerror}") from None
    if len(text.strip()) == _Z85_LEN:
        return _checked(text.strip(), what)
    try:
        public, private = zmq.auth.load_certificate(path)
    except (ValueError, OSError, UnicodeDecodeError):
        raise ConfigError(f"{what}: {str(path)!r} is neither a Z85 key nor a ZMQ certificate") from None
    key = private if secret else public
    if key is None:
        raise ConfigError(f"{what}: certificate {str(path)!r} holds no secret key")
    return _checked(key, what)


@dataclass(frozen=True)
class CurveServerKeys:
    """The server's secret key and, optionally, a directory of client certificates allowed to connect."""

    secret: bytes
    clients_dir: Path | None = None

    def __post_init__(self) -> None:
        _checked(self.secret, "curve secret key")
        if self.clients_dir is not None and not self.clients_dir.is_dir():
            raise ConfigError(f"curve clients: {str(self.clients_dir)!r} is not a directory")

    @property
    def public(self) -> bytes:
        """The server's public key, which clients are given."""
        return zmq.curve_public(self.secret)

    @classmethod
    def generate(cls, clients_dir: Path | None = None) -> CurveServerKeys:
        _, secret = zmq.curve_keypair()
        return cls(secret, clients_dir)


@dataclass(frozen=True)
class CurveClientKeys:
    """What a client needs: the server's public key, and its own key pair (fresh when not given)."""

    server_public: bytes
    public: bytes = b""
    secret: bytes = b""

    def __post_init__(self) -> None:
        _checked(self.server_public, "curve server key")
        if bool(self.public) != bool(self.secret):
            raise ConfigError("curve client keys: give both the public and the secret key, or neither")


def apply_server(sock: zmq.Socket[Any], keys: CurveServerKeys) -> None:
    """Make ``sock`` a CURVE server (before bind): every peer must complete the CURVE handshake."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True


def apply_client(sock: zmq.Socket[Any], keys: CurveClientKeys) -> None:
    """Make ``sock`` a CURVE client of the server whose public key is in ``keys`` (before connect)."""
    public, secret = keys.public, keys.secret
    if not public:
        public, secret = zmq.curve_keypair()
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def configure_authenticator(auth: AsyncioAuthenticator, keys: CurveServerKeys, domain: str) -> None:
    """Make the ZAP handler ``auth`` admit under ``domain`` only the client keys in ``keys.clients_dir``, or
    any client when there is no such directory (CURVE itself still requires the server's public key).

    ``auth`` is started on the server's context before the socket binds, and stopped before the context is
    terminated (the caller owns it). A directory that cannot be read admits nobody (pyzmq logs it).
    """
    location = str(keys.clients_dir) if keys.clients_dir is not None else zmq.auth.CURVE_ALLOW_ANY
    auth.configure_curve(domain=domain, location=location)
