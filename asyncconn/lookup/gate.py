"""The lookup server's bound on connections: counted by the socket's monitor, enforced by ZAP at handshake.

Why this shape: libzmq accepts every TCP (or ipc) connection offered to a bound socket and gives the
application no say -- yet each one costs a file descriptor and the engine's buffers, so one client opening
thousands of them would exhaust the server. What libzmq does offer is a say at the handshake: with a ZAP
handler bound on the context it asks that handler about every new connection (under CURVE always; under the
NULL mechanism only when the socket has a ZAP domain, so :meth:`ConnectionGate.watch` sets one) and drops
the peer when told no.

:class:`ConnectionGate` is that handler. It *is* pyzmq's :class:`~zmq.auth.asyncio.AsyncioAuthenticator`,
so CURVE's client allow-list is the authenticator's own check, unchanged; the gate adds one rule on top,
applied only to a connection the authenticator admits: when more than ``max_connections`` connections are
open, the answer becomes "400 too many connections". It never turns a refusal into an admission, so it
cannot weaken authentication. The rule is hooked in through ``lookup.zap_hook`` (the one override of a
private pyzmq method, and why it is needed).

Counting. The ROUTER's monitor reports ``ACCEPTED`` and ``DISCONNECTED`` with the connection's fd; the gate
keeps the set of open fds, exact and self-healing (a reused fd number is one entry). libzmq 4.3's handshake
events carry no fd, so a connection still in its handshake cannot be told from an admitted one: the gate
counts every open connection, handshaking ones included -- which is also what the resources are. A
connection's ``ACCEPTED`` is emitted before its ZAP request (one I/O thread, the default, does both in that
order) and the gate reads every pending monitor event before deciding, so the count it decides on includes
the asking connection and every connection admitted before it. Hence the invariant: at most
``max_connections`` connections past their handshake at any time. Connections still in their handshake are
bounded in time, not number: libzmq drops one that has not finished within ``ZMQ_HANDSHAKE_IVL`` (30 s).
The price of counting them: connections arriving together see each other open, so a burst near the bound
may be refused more than strictly needed (a burst of 100 against a bound of 8 admits between 0 and 8).

Why not count handshakes by their events: libzmq reports none for a peer it drops during the greeting
(an HTTP request, a ZMTP 1.0/2.0 greeting -- measured), so a count of outcomes would drift down, and the
bound with it, by one per such peer.

Refusal is ZAP status 400, not 300 ("try later"): measured on libzmq 4.3.5, a 300 leaves the connection
open until its handshake timer fires -- so a refused client would keep a descriptor 30 s and then retry,
which is no bound at all. After a 400 libzmq sends ZMTP ``ERROR`` and closes the connection at once, and a
libzmq client treats that as final for the socket: it does not reconnect. So a refused client stays
refused until it makes a new socket; ``max_connections`` is sized above the connections the engines need.

The monitor's own pipe is unbounded (receive high-water mark 0): libzmq writes monitor events from its I/O
thread with a blocking send, and a full pipe would stall every connection of the server until the loop
caught up -- or deadlock the shutdown. The loop drains it continuously, so it holds a few events at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import struct
from collections.abc import Callable

import zmq
import zmq.asyncio

from asyncconn.exceptions import ConfigError
from asyncconn.lookup.zap_hook import VerdictAuthenticator

__all__ = ["ZAP_DOMAIN", "ConnectionGate"]

#: The ZAP domain the server's socket is given (and CURVE certificates are configured under).
ZAP_DOMAIN = "asyncconn.lookup"
#: The ZAP reply to a connection past the bound (RFC 27: 400 is a refusal, sent to the peer as ERROR).
REFUSED = (b"400", b"too many connections")

_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
_EVENT_HEADER = struct.Struct("=HI")  # monitor event v1: event id, value (the fd for these two)
_monitor_ids = itertools.count()


def _ignore(_: int) -> None:
    pass


class ConnectionGate(VerdictAuthenticator):
    """Admit at most ``max_connections`` connections of one socket at its handshake; count the rest refused.

    ``start()`` (on the loop, before the socket binds), ``watch(sock)``, then ``close()`` before the
    context is terminated. ``on_change(n)`` is called with the open count whenever it changes,
    ``on_refused(n)`` once per refused connection with the count that refused it (both on the loop).
    """

    def __init__(
        self,
        context: zmq.asyncio.Context,
        max_connections: int,
        *,
        on_change: Callable[[int], None] = _ignore,
        on_refused: Callable[[int], None] = _ignore,
    ) -> None:
        super().__init__(context)
        self.max_connections = max_connections
        self.refused = 0
        self._actx = context
        self._on_change = on_change
        self._on_refused = on_refused
        self._open: set[int] = set()
        self._watched: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._events: zmq.Socket[bytes] | None = None  # sync shadow of _monitor, for non-blocking drains
        self._reader: asyncio.Task[None] | None = None

    @property
    def connections(self) -> int:
        """Connections open now (handshaking ones included)."""
        return len(self._open)

    def watch(self, sock: zmq.asyncio.Socket) -> None:
        """Count ``sock``'s connections and put each through this gate at its handshake (before it binds)."""
        if self._watched is not None:
            raise RuntimeError("a ConnectionGate watches one socket")
        if self._actx.get(zmq.IO_THREADS) != 1:  # the count's ordering argument (module docstring) needs it
            raise ConfigError("lookup server: the connection bound needs a context with one I/O thread")
        addr = f"inproc://asyncconn.lookup.monitor-{id(self):x}-{next(_monitor_ids)}"
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.monitor(addr, _EVENTS)
        self._watched = sock
        monitor = self._actx.socket(zmq.PAIR)
        monitor.setsockopt(zmq.LINGER, 0)
        monitor.setsockopt(zmq.RCVHWM, 0)  # before connect: the inproc pipe takes its limit then
        monitor.connect(addr)
        self._monitor = monitor
        self._events = zmq.Socket.shadow(monitor.underlying)
        self._reader = asyncio.get_running_loop().create_task(self._read(monitor))

    def close(self) -> None:
        """Stop counting and answering; close the monitor and ZAP sockets. The watched socket stays open."""
        watched, self._watched = self._watched, None
        if watched is not None and not watched.closed:
            # First: libzmq's side of the monitor must go before ours, or an event sent to a peerless PAIR
            # would block the I/O thread.
            with contextlib.suppress(zmq.ZMQError):
                watched.disable_monitor()
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.cancel()
        monitor, self._monitor, self._events = self._monitor, None, None
        if monitor is not None:
            monitor.close(0)
        self.stop()
        if self._open:
            self._open.clear()
            self._on_change(0)

    async def _read(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            first = await monitor.recv_multipart()
            self._drain(first)

    def _drain(self, first: list[bytes] | None = None) -> None:
        """Apply ``first`` and every monitor event pending now."""
        before = len(self._open)
        if first is not None:
            self._apply(first)
        events = self._events
        while events is not None:
            try:
                frames = events.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # EAGAIN: drained (or the socket is closing)
                break
            self._apply(frames)
        if len(self._open) != before:
            self._on_change(len(self._open))

    def _apply(self, frames: list[bytes]) -> None:
        if len(frames) != 2 or len(frames[0]) != _EVENT_HEADER.size:
            return
        event, fd = _EVENT_HEADER.unpack(frames[0])
        if event == zmq.EVENT_ACCEPTED:
            self._open.add(fd)
        elif event == zmq.EVENT_DISCONNECTED:
            self._open.discard(fd)

    def refusal(self) -> tuple[bytes, bytes] | None:
        """Every admission of the authenticator is asked here: one past the bound becomes a refusal."""
        if self._monitor is None:
            return None
        self._drain()
        if len(self._open) <= self.max_connections:
            return None
        self.refused += 1
        self._on_refused(len(self._open))
        return REFUSED
