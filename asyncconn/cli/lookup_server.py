"""``asyncconn lookup-server``: serve Mooncake-framed and pipelined lookups from a store over ZMQ.

Runs the server on its own asyncio loop (uvloop when installed) in the foreground until SIGINT/SIGTERM.
It prints ``listening on ENDPOINT`` on stdout once bound, so scripts (and ``bench lookup``) can wait for
it, then ``metrics on URL`` when ``--metrics-port`` serves the counters for Prometheus. Exit codes: 0
after a clean stop, 2 for a bad URL/endpoint (or metrics port) or a store still unreachable after
``--wait-for-store`` (default: not waited for).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from asyncconn.cli import argtypes
from asyncconn.exceptions import AsyncConnError, BackendError, ConfigError
from asyncconn.lookup.curve import CurveServerKeys, load_key
from asyncconn.lookup.protocol import DEFAULT_MAX_KEYS
from asyncconn.lookup.server import (
    DEFAULT_BIND,
    DEFAULT_MAX_CLIENTS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_INFLIGHT_KEYS,
    DEFAULT_METRICS_HOST,
    LookupServer,
)
from asyncconn.store import TensorStore
from asyncconn.url import parse_duration, parse_size, redact, with_password_from

__all__ = ["add_arguments", "run", "serve"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", required=True, help="store URL, e.g. redis://127.0.0.1:6379/0")
    parser.add_argument(
        "--bind", default=DEFAULT_BIND, help=f"ZMQ endpoint (default {DEFAULT_BIND}; ipc://PATH is made 0600)"
    )
    parser.add_argument(
        "--block-size", type=argtypes.count, default=16, help="the engine's KV block size in tokens"
    )
    parser.add_argument("--key-prefix", default="", help="store key = prefix + hex(hash)")
    parser.add_argument(
        "--max-keys", type=argtypes.count, default=DEFAULT_MAX_KEYS, help="keys accepted per request"
    )
    parser.add_argument(
        "--max-message",
        type=argtypes.positive_size_text,
        default="4MiB",
        help="frames larger than this drop the peer",
    )
    parser.add_argument(
        "--max-bytes",
        type=argtypes.positive_size_text,
        default="64MiB",
        help="request bytes held at once (queued + being answered); past it the heaviest client's newest "
        "queued request is answered with an error",
    )
    parser.add_argument(
        "--max-inflight-keys",
        type=argtypes.count,
        default=DEFAULT_MAX_INFLIGHT_KEYS,
        help="keys looked up in the store at once (>= --max-keys); requests wait their turn, round-robin",
    )
    parser.add_argument(
        "--max-clients",
        type=argtypes.count,
        default=DEFAULT_MAX_CLIENTS,
        help="clients with requests held at once; a new client past it gets error replies",
    )
    parser.add_argument(
        "--max-connections",
        type=argtypes.count,
        default=DEFAULT_MAX_CONNECTIONS,
        help="connections open at once (handshaking ones included); a connection past it is refused at its "
        "handshake and closed (its client does not reconnect that socket)",
    )
    parser.add_argument(
        "--timeout", type=argtypes.positive_duration_text, default="5s", help="store call timeout"
    )
    parser.add_argument(
        "--wait-for-store",
        type=argtypes.duration_text,
        default="0s",
        help="keep trying an unreachable store this long at start-up (backoff 0.1s doubling to 2s); "
        "default 0: exit 2 at once",
    )
    parser.add_argument(
        "--curve-secret-key",
        help="enable CURVE: the server's Z85 secret key, or a file holding it / a ZMQ cert",
    )
    parser.add_argument(
        "--curve-clients", help="with CURVE: admit only client certificates in this directory"
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --bind without CURVE (no authentication)",
    )
    parser.add_argument(
        "--metrics-port",
        type=_port,
        default=0,
        help="serve the server's counters in Prometheus text format at http://HOST:PORT/metrics "
        "(default 0: off)",
    )
    parser.add_argument(
        "--metrics-host",
        default=DEFAULT_METRICS_HOST,
        help=f"the address --metrics-port listens on (default {DEFAULT_METRICS_HOST}, this host only)",
    )
    parser.add_argument(
        "--password-env",
        metavar="NAME",
        help="read the store password from this environment variable (as ?password_env=NAME in --backend), "
        "so it is not on the command line for ps to show",
    )
    parser.add_argument(
        "--password-file",
        metavar="PATH",
        help="read the store password from this file's one line (as ?password_file=PATH in --backend)",
    )


async def serve(args: argparse.Namespace) -> int:
    """Open the store, bind, serve until a signal; the store and socket are closed on every path."""
    curve = _curve(args)  # before the store is opened: a bad key must not leave it open
    backend = with_password_from(args.backend, env=args.password_env, file=args.password_file)
    try:
        wait = parse_duration(args.wait_for_store)
        store = await _open_store(backend, parse_duration(args.timeout), wait)
    except (AsyncConnError, ValueError) as exc:
        print(f"asyncconn lookup-server: cannot open {redact(args.backend)}: {exc}", file=sys.stderr)
        return 2
    try:
        server = LookupServer(
            store,
            args.bind,
            block_size=args.block_size,
            key_prefix=args.key_prefix,
            max_keys=args.max_keys,
            max_message=parse_size(args.max_message),
            max_bytes=parse_size(args.max_bytes),
            max_inflight_keys=args.max_inflight_keys,
            max_clients=args.max_clients,
            max_connections=args.max_connections,
            curve=curve,
            insecure=args.insecure,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
        )
    except ValueError as exc:  # ConfigError included: a bound out of range
        await store.close()
        print(f"asyncconn lookup-server: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            endpoint = await server.start()
        except AsyncConnError as exc:
            print(f"asyncconn lookup-server: {exc}", file=sys.stderr)
            return 2
        print(f"listening on {endpoint}", flush=True)
        if server.metrics_url is not None:
            print(f"metrics on {server.metrics_url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        return 0
    finally:
        await server.close()
        await store.close()


async def _open_store(url: str, timeout: float, wait: float) -> TensorStore:
    """Open the store; while it is unreachable (a :class:`BackendError`, not a bad URL) try again until
    ``wait`` has passed.

    Why: a lookup server is often started beside its store (one pod, one compose file) and may come up
    first. Failing at once makes the supervisor's restart loop the retry; ``--wait-for-store`` lets the
    operator choose a bounded wait instead. Each failed try is one line on stderr.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    pause = 0.1
    while True:
        try:
            return await TensorStore.open(url, timeout=timeout)
        except BackendError as exc:
            left = deadline - loop.time()
            if left <= 0:
                raise
            pause = min(pause, left)
            print(
                f"asyncconn lookup-server: {redact(url)} unreachable ({exc}); trying again in {pause:.1f}s",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(pause)
            pause = min(pause * 2, 2.0)


def _port(text: str) -> int:
    """A TCP port, 0-65535 (``--metrics-port``: 0 is off)."""
    value = text.strip()
    if not value.isdigit() or int(value) > 65535:
        raise argparse.ArgumentTypeError(f"bad value {text[:40]!r}: a port is a whole number 0-65535")
    return int(value)


def _curve(args: argparse.Namespace) -> CurveServerKeys | None:
    if not args.curve_secret_key:
        if args.curve_clients:
            raise ConfigError("--curve-clients needs --curve-secret-key")
        return None
    secret = load_key(args.curve_secret_key, what="--curve-secret-key", secret=True)
    return CurveServerKeys(secret, Path(args.curve_clients) if args.curve_clients else None)


def run(args: argparse.Namespace) -> int:
    try:
        code: int = _runner()(serve(args))
    except ValueError as exc:
        print(f"asyncconn lookup-server: {exc}", file=sys.stderr)
        return 2
    return code


def _runner() -> Callable[[Coroutine[Any, Any, int]], int]:
    """``uvloop.run`` when uvloop is installed (faster socket handling), else ``asyncio.run``."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run
