"""``asyncconn check URL``: is this store usable? One line out, exit 0 or 2.

Round-trips a small value of random bytes (put, exists, get, compare, delete) under a unique key and prints
the latency of each step. An unknown scheme, a bad URL, an unreachable or hung store all print one line
naming the problem (the URL redacted) and exit 2 within ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
import uuid

from asyncconn.backend import open_backend
from asyncconn.cli import argtypes
from asyncconn.exceptions import AsyncConnError
from asyncconn.runtime import Runtime
from asyncconn.url import redact, scrub, url_secrets

__all__ = ["add_arguments", "check", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="store URL, e.g. redis://127.0.0.1:6379/0 or file:///tmp/store")
    parser.add_argument(
        "--timeout", type=argtypes.positive_duration, default=5.0, help="seconds allowed for the whole check"
    )
    parser.add_argument(
        "--size", type=argtypes.positive_size, default=1 << 16, help="bytes of the test value (e.g. 64KiB)"
    )


async def check(url: str, timeout: float, size: int) -> dict[str, float]:
    """Run the round trip; return the latency of each step in milliseconds. Raises AsyncConnError.

    The bytes go to the store's backend as they are, without the tensor framing the connectors add: the
    question is the store, and so ``asyncconn check`` never imports torch (it answers in well under a second
    where a torch import alone takes seconds).
    """
    timings: dict[str, float] = {}
    t0 = time.perf_counter()
    backend = await open_backend(url)
    timings["connect"] = (time.perf_counter() - t0) * 1e3
    key = f"asyncconn-check-{uuid.uuid4().hex}"
    value = os.urandom(size)
    try:
        t = time.perf_counter()
        await backend.put([(key, value)])
        timings["put"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        (present,) = await backend.exists([key])
        timings["exists"] = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        (back,) = await backend.get([key])
        timings["get"] = (time.perf_counter() - t) * 1e3
        if not present or back is None:
            raise AsyncConnError("value written by put is not there on read")
        if b"".join(bytes(chunk) for chunk in back) != value:
            raise AsyncConnError("value read back differs from the value written")
    finally:
        # Best effort and bounded: a failed check must not hang on its own clean-up.
        t = time.perf_counter()
        with contextlib.suppress(AsyncConnError, TimeoutError):
            async with asyncio.timeout(min(timeout, 0.25)):
                await backend.delete([key])
        with contextlib.suppress(AsyncConnError, TimeoutError):
            async with asyncio.timeout(min(timeout, 0.25)):
                await backend.close()
        timings["delete"] = (time.perf_counter() - t) * 1e3
    return timings


async def _bounded(url: str, timeout: float, size: int) -> dict[str, float]:
    try:
        async with asyncio.timeout(timeout):
            return await check(url, timeout, size)
    except TimeoutError:
        raise TimeoutError(f"no answer within {timeout:g}s") from None


def run(args: argparse.Namespace) -> int:
    safe = redact(args.url)
    runtime = Runtime(name="asyncconn-check").start()
    try:
        timings = runtime.run(_bounded(args.url, args.timeout, args.size), timeout=args.timeout + 2.0)
    except Exception as exc:
        # Any failure is one line and exit 2, never a traceback: a traceback could quote the URL.
        kind = "" if isinstance(exc, (AsyncConnError, TimeoutError)) else f"{type(exc).__name__}: "
        reason = kind + (str(exc) or f"no answer within {args.timeout:g}s")
        print(f"asyncconn check {safe}: FAILED: {scrub(reason, url_secrets(args.url))}")
        return 2
    finally:
        runtime.close(timeout=1.0)
    steps = " ".join(f"{name}={ms:.2f}ms" for name, ms in timings.items())
    print(f"asyncconn check {safe}: ok {steps}")
    return 0
