"""The faults a chaos run injects, one at a time, on a seeded schedule.

Server faults act on real processes: ``redis_kill`` (SIGKILL, restarted empty on the same port after a
pause), ``redis_pause`` (SIGSTOP then SIGCONT: a hung store), ``redis_slow`` (``CLIENT PAUSE`` bursts: a
store that answers, slowly), ``lookup_kill`` (the lookup server killed and restarted). Data faults go through
the backend API, so they look exactly like what another writer could leave: ``corrupt`` (bytes flipped),
``truncate`` (a value cut short) and ``replace`` (another key's valid value copied over this one -- only
the key binding of frames tells it apart). Every fault is healed when its window ends and by
:meth:`FaultInjector.heal_all`, so a run always drains on a healthy stack.
"""

from __future__ import annotations

import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import redis

from asyncconn.backend import StorageBackend
from asyncconn.runtime import Runtime
from asyncconn_tools.chaos.procs import LookupServerProcess, RedisServer

log = logging.getLogger(__name__)

__all__ = ["DATA_FAULTS", "SERVER_FAULTS", "FaultInjector"]

SERVER_FAULTS = ("redis_kill", "redis_pause", "redis_slow", "lookup_kill")
DATA_FAULTS = ("corrupt", "truncate", "replace")


@dataclass
class _Active:
    kind: str
    until: float


class FaultInjector:
    """Starts a fault every ``interval`` seconds on average and ends each after its window.

    Kinds are drawn without replacement (every kind once per round, in a seeded random order), so even a
    short run covers each of them.

    ``keys`` returns store keys that hold values now (the data faults pick among them). Counts go to
    :attr:`injected` and :attr:`healed`; an injection that could not be made (no keys yet) is not counted.
    """

    def __init__(
        self,
        *,
        rng: random.Random,
        runtime: Runtime,
        backend: StorageBackend,
        redis_server: RedisServer | None,
        lookup_server: LookupServerProcess | None,
        keys: Callable[[], Sequence[str]],
        interval: float,
        kinds: Sequence[str] = SERVER_FAULTS + DATA_FAULTS,
    ) -> None:
        self.rng = rng
        self.runtime = runtime
        self.backend = backend
        self.redis = redis_server
        self.lookup = lookup_server
        self.keys = keys
        self.interval = interval
        self.kinds = [k for k in kinds if self._possible(k)]
        self.injected: Counter[str] = Counter()
        self.healed: Counter[str] = Counter()
        self.values_damaged = 0
        self._active: _Active | None = None
        self._next = time.monotonic() + rng.uniform(0.3, 1.0) * interval
        self._slow_next = 0.0
        self._control: redis.Redis | None = None
        self._bag: list[str] = []
        self.lookup_restarts = 0  # by the supervisor below, not by a fault's end
        self._restart_after = 0.0

    def _possible(self, kind: str) -> bool:
        if kind.startswith("redis_"):
            return self.redis is not None
        if kind == "lookup_kill":
            return self.lookup is not None
        return True

    @property
    def active(self) -> str | None:
        return self._active.kind if self._active is not None else None

    def tick(self, now: float) -> None:
        """Advance the schedule: end a fault whose window is over, start the next one when due."""
        self._supervise(now)
        active = self._active
        if active is not None:
            if now >= active.until:
                self._heal(active.kind)
                self._active = None
                self._next = now + self.rng.expovariate(1.0 / self.interval)
            elif active.kind == "redis_slow" and now >= self._slow_next:
                self._slow_burst()
                self._slow_next = now + 0.06
            return
        if now < self._next or not self.kinds:
            return
        if not self._bag:  # every kind once, in a random order, before any kind twice
            self._bag = list(self.kinds)
            self.rng.shuffle(self._bag)
        kind = self._bag.pop()
        if kind in DATA_FAULTS:
            if self._damage(kind):
                self.injected[kind] += 1
            self._next = now + self.rng.expovariate(1.0 / self.interval)
            return
        window = self.rng.uniform(0.2, 1.5)
        self._start(kind)
        self.injected[kind] += 1
        self._active = _Active(kind, now + window)

    def heal_all(self) -> None:
        """End the active fault now (the run's drain phase starts on a healthy stack)."""
        if self._active is not None:
            self._heal(self._active.kind)
            self._active = None
        if self.lookup is not None:
            self._supervise(time.monotonic() + 1e9)
            self.lookup.wait_ready()
        if self._control is not None:
            self._control.close()
            self._control = None

    def _supervise(self, now: float) -> None:
        """Restart the lookup server when it has exited outside a ``lookup_kill`` window, as a supervisor
        (systemd, Kubernetes) would: it exits when the store is unreachable as it starts -- a restart that
        overlapped a ``redis_kill`` (seen: the run then ended waiting 30 s for a server that was gone).
        At most one restart a second: each one is a cold interpreter importing torch."""
        lookup = self.lookup
        if lookup is None or lookup.proc is None or lookup.alive or now < self._restart_after:
            return
        if self._active is not None and self._active.kind == "lookup_kill":
            return
        log.info("chaos: the lookup server exited; restarting it")
        lookup.start(wait=False)
        self.lookup_restarts += 1
        self._restart_after = now + 1.0

    # -- server faults ----------------------------------------------------------------------------------
    def _start(self, kind: str) -> None:
        log.info("chaos: %s", kind)
        if kind == "redis_kill":
            assert self.redis is not None
            self.redis.kill()
        elif kind == "redis_pause":
            assert self.redis is not None
            self.redis.pause()
        elif kind == "lookup_kill":
            assert self.lookup is not None
            self.lookup.kill()
        elif kind == "redis_slow":
            self._slow_burst()
            self._slow_next = time.monotonic() + 0.06

    def _heal(self, kind: str) -> None:
        if kind == "redis_kill":
            assert self.redis is not None
            self.redis.start()
        elif kind == "redis_pause":
            assert self.redis is not None
            self.redis.resume()
        elif kind == "lookup_kill":
            assert self.lookup is not None
            self.lookup.start(wait=False)  # comes up in the background, as a supervisor would restart it
        self.healed[kind] += 1

    def _slow_burst(self) -> None:
        """``CLIENT PAUSE 40 ALL``: the store holds every client's commands for 40 ms, then serves them."""
        assert self.redis is not None
        if self._control is None:
            self._control = redis.Redis(
                host="127.0.0.1", port=self.redis.port, socket_timeout=0.5, socket_connect_timeout=0.5
            )
        try:
            self._control.execute_command("CLIENT", "PAUSE", "40", "ALL")  # type: ignore[no-untyped-call]
        except redis.RedisError as exc:
            log.info("chaos: slow burst not applied: %s", exc)

    # -- data faults --------------------------------------------------------------------------------------
    def _damage(self, kind: str) -> bool:
        keys = list(self.keys())
        if not keys:
            return False
        victims = self.rng.sample(keys, min(len(keys), self.rng.randint(1, 3)))
        try:
            done = self.runtime.run(self._damage_values(kind, victims, keys), 5.0)
        except Exception as exc:  # a store that is down during injection: no fault made
            log.info("chaos: %s not applied: %s", kind, exc)
            return False
        self.values_damaged += done
        return done > 0

    async def _damage_values(self, kind: str, victims: list[str], keys: list[str]) -> int:
        values = await self.backend.get(victims)
        writes: list[tuple[str, bytes]] = []
        for key, chunks in zip(victims, values, strict=True):
            if chunks is None:
                continue
            raw = b"".join(bytes(c) for c in chunks)
            if kind == "corrupt" and raw:
                data = bytearray(raw)
                for _ in range(self.rng.randint(1, 4)):
                    data[self.rng.randrange(len(data))] ^= 1 << self.rng.randrange(8)
                writes.append((key, bytes(data)))
            elif kind == "truncate" and raw:
                writes.append((key, raw[: self.rng.randrange(len(raw))]))
            elif kind == "replace":
                # A donor of the same kind (KV for KV, EC for EC): same shape and dtype, a valid frame.
                space = key.split(":", 1)[0]
                donors = [k for k in keys if k != key and k.split(":", 1)[0] == space]
                if not donors:
                    continue
                (donor,) = await self.backend.get([self.rng.choice(donors)])
                if donor is None:
                    continue
                writes.append((key, b"".join(bytes(c) for c in donor)))
        if writes:
            await self.backend.put(writes)
        return len(writes)
