"""Removals a Redis server makes by itself -- ``ttl`` expiry, ``maxmemory`` eviction -- heard through its
keyspace notifications and handed to the backend's ``on_removed`` hook (KV events' ``BlockRemoved``).

Redis publishes the name of every key it expires on ``__keyevent@<db>__:expired`` and of every key it
evicts on ``__keyevent@<db>__:evicted``, when its ``notify-keyspace-events`` holds ``E`` (key-event
channels) with ``x`` (expired) and ``e`` (evicted); ``A`` stands for every class. The listener subscribes
to those two channels on a connection of its own and maps each name under the store's ``prefix`` back to
the key the backend was given (``<prefix>{<key>}`` -> ``<key>``, the inverse of ``layout.main_key``).

What it cannot do, by Redis's design: pub/sub is fire-and-forget, so a removal made while the listener is
disconnected (the server restarting, a network cut) is never heard -- each lost connection is counted in
``outages``; a subscriber that falls behind its ``client-output-buffer-limit pubsub`` is disconnected by
the server (an outage too). A removal is heard once per subscriber: every engine's listener hears every
removal of the store, and the KV events of each name only the values it announced itself.

Modes (the URL's ``removals``): ``off`` (no listener), ``listen`` (subscribe; a server whose
``notify-keyspace-events`` lacks the flags is logged once and publishes nothing), ``enable`` (also add the
missing flags with ``CONFIG SET`` at every connection -- a restarted server has forgotten them; a server
refusing ``CONFIG`` is logged once, never an error). It runs on the backend's loop, reconnects with
jittered exponential backoff, and :meth:`RemovalListener.close` ends its task and its connection.
``redis+cluster://`` runs one listener per master of the slot map read at open (each master publishes only
its own keys' events).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.connection import ConnectionPool
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from asyncconn.backend import RemovedHook

__all__ = ["Removals", "RemovalListener", "key_of", "parse_removals"]

log = logging.getLogger(__name__)

#: Keys handed to the hook in one call at most (a burst of evictions is split, never held back).
BATCH = 512
#: Backoff between reconnections: from the first delay, doubling up to the last (each jittered down by
#: up to half, so the engines of a fleet do not reconnect in step after a server restart).
FIRST_DELAY = 0.05
MAX_DELAY = 5.0
#: Silence on the subscription after which the listener PINGs the server (and gives the connection up
#: after as long again without an answer).
IDLE = 30.0
#: The ``notify-keyspace-events`` flags the listener needs: key-event channels, expired, evicted.
_NEEDED = "Exe"


class Removals(enum.Enum):
    """The URL parameter ``removals``: whether (and how) server-side removals are listened for."""

    OFF = "off"
    LISTEN = "listen"
    ENABLE = "enable"


def parse_removals(text: str) -> Removals:
    try:
        return Removals(text.strip().lower())
    except ValueError:
        raise ValueError("must be off, listen or enable") from None


def key_of(prefix: str, name: bytes) -> str | None:
    """The backend key whose Redis key is ``name`` (``<prefix>{<key>}``), or None when it is not ours."""
    try:
        text = name.decode()
    except UnicodeDecodeError:
        return None
    start = prefix + "{"
    if len(text) <= len(start) + 1 or not text.startswith(start) or not text.endswith("}"):
        return None
    return text[len(start) : -1]


def missing_flags(current: str) -> str:
    """The flags of ``_NEEDED`` that ``current`` (a ``notify-keyspace-events`` value) lacks."""
    have = set(current)
    if "A" in have:
        have |= set("xe")
    return "".join(flag for flag in _NEEDED if flag not in have)


class RemovalListener:
    """Subscribes to a server's expired/evicted key events and reports the store's keys to ``hook()``.

    ``pool_kwargs``: redis-py connection arguments of the store (address, auth, TLS, database); ``hook``:
    returns the hook to call now (the backend's ``on_removed``, set and unset by its user at any time).
    """

    def __init__(
        self,
        pool_kwargs: dict[str, Any],
        *,
        db: int,
        prefix: str,
        mode: Removals,
        hook: Callable[[], RemovedHook | None],
        name: str,
    ) -> None:
        assert mode is not Removals.OFF
        # No retry inside redis-py: a lost connection ends the session, and the loop here reconnects
        # (and re-applies the flags, which a restarted server has forgotten).
        self._pool_kwargs = {**pool_kwargs, "retry": Retry(NoBackoff(), 0)}
        self._channels = [f"__keyevent@{db}__:expired", f"__keyevent@{db}__:evicted"]
        self._prefix = prefix
        self._mode = mode
        self._hook = hook
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self._pool: ConnectionPool | None = None
        self._told: set[str] = set()
        #: Set while subscribed (tests and ``held`` read it).
        self.listening = asyncio.Event()
        #: Seconds of silence before a PING, and then before the connection is given up as dead.
        self.idle = IDLE
        self.heard = 0  # keys of ours handed to the hook
        self.unheard = 0  # keys of ours removed while no hook was set
        self.outages = 0  # connections lost or refused: removals meanwhile were not heard

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"redis removals {self._name}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._drop()

    def held(self) -> dict[str, int]:
        """Its task and open connection (tests count them back to zero after ``close``)."""
        pool = self._pool
        connected = 0
        if pool is not None:
            every = [*pool._available_connections, *pool._in_use_connections]
            connected = sum(c.is_connected for c in every)
        return {
            "listener_tasks": int(self._task is not None and not self._task.done()),
            "connected": connected,
        }

    # -- the session loop ------------------------------------------------------------------------------
    async def _run(self) -> None:
        delay = FIRST_DELAY
        while True:
            try:
                await self._session()
            except (rexc.RedisError, OSError) as exc:
                self._tell_once(
                    "lost",
                    "%s: removal listener disconnected (%s); reconnecting with backoff, removals meanwhile "
                    "are not reported",
                    self._name,
                    type(exc).__name__,
                )
            finally:
                if self.listening.is_set():
                    delay = FIRST_DELAY  # it was up: the next outage starts its backoff afresh
                self.listening.clear()
                await self._drop()
            self.outages += 1
            await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, MAX_DELAY)

    async def _session(self) -> None:
        self._pool = ConnectionPool(max_connections=2, **self._pool_kwargs)
        client = aioredis.Redis(connection_pool=self._pool)
        await self._check_flags(client)
        await self._pool.disconnect(inuse_connections=False)  # the CONFIG connection: one socket is enough
        pubsub = client.pubsub()
        await pubsub.subscribe(*self._channels)
        self.listening.set()
        self._told.discard("lost")  # a later outage is news again
        pinged = False
        while True:
            message = await pubsub.get_message(timeout=self.idle)
            if message is None:
                # Silence: a hung server or a cut without a reset never ends the read on its own. PING,
                # and a second silence ends the session (pub/sub answers a PING with a "pong" message).
                if pinged:
                    raise rexc.TimeoutError(f"no answer to PING within {self.idle:g}s")
                await pubsub.ping()
                pinged = True
                continue
            pinged = False
            keys: list[str] = []
            while message is not None:
                if message["type"] == "message":
                    key = key_of(self._prefix, message["data"])
                    if key is not None:
                        keys.append(key)
                if len(keys) >= BATCH:
                    break
                message = await pubsub.get_message(timeout=0.0)
            if keys:
                self._report(keys)

    async def _check_flags(self, client: aioredis.Redis) -> None:
        """Log (once) a server that does not publish the events; with ``enable``, add the flags."""
        try:
            current = (await client.config_get("notify-keyspace-events")).get("notify-keyspace-events", "")
        except rexc.ResponseError as exc:  # CONFIG renamed away, or not allowed to this user
            self._tell_once(
                "config", "%s: cannot read notify-keyspace-events (%s); listening anyway", self._name, exc
            )
            return
        missing = missing_flags(str(current))
        if not missing:
            return
        if self._mode is Removals.ENABLE:
            try:
                await client.config_set("notify-keyspace-events", f"{current}{missing}")
            except rexc.ResponseError as exc:
                self._tell_once(
                    "config",
                    "%s: the server refused CONFIG SET notify-keyspace-events (%s); expiry and eviction "
                    "are not reported until its operator adds %r",
                    self._name,
                    exc,
                    missing,
                )
            return
        self._tell_once(
            "flags",
            "%s: the server's notify-keyspace-events is %r, without %r: expiry and eviction are not "
            "reported (set it on the server, or removals=enable)",
            self._name,
            current,
            missing,
        )

    def _report(self, keys: list[str]) -> None:
        hook = self._hook()
        if hook is None:
            self.unheard += len(keys)
            return
        self.heard += len(keys)
        try:
            hook(keys)
        except Exception:  # someone else's bug must not stop the listener
            log.exception("%s: on_removed hook failed", self._name)

    async def _drop(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            with contextlib.suppress(Exception):
                await pool.disconnect(inuse_connections=True)

    def _tell_once(self, topic: str, text: str, *args: Any) -> None:
        if topic not in self._told:
            self._told.add(topic)
            log.warning(text, *args)
