"""The stores ``asyncconn bench serve`` compares, one strategy each, chosen once per ``--stores`` name.

A store knows what its two OpenAI servers are configured with (server 1 computes and saves, a fresh
server 2 loads), what must happen between them, and which counters on its store side prove where server
2's hits came from. The stores:

- ``none``: no connector (the reference that computes everything).
- ``file`` / ``redis``: asyncconn's connector with ``examples/vllm_kv_offload.json``, only the URL changed;
  ``redis`` gets a redis-server of its own on a free loopback port.
- ``lmcache``: LMCache's ``LMCacheMPConnector`` and one ``lmcache server`` (multi-process mode) shared by
  both servers, so server 2's hits come from that process's own RAM (its L1).
- ``lmcache-redis``: LMCache's Redis path: a redis-server of its own, configured like ``redis``'s, behind
  LMCache's RESP L2 adapter. Server 1 talks to one ``lmcache server``; once its stores to Redis have
  drained, a second, fresh ``lmcache server`` (empty L1) serves server 2, so its hits can only come from
  Redis. The redis-server's ``INFO`` (bytes sent, keyspace hits, commands) over server 2's run shows it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from asyncconn_tools import prometheus

__all__ = [
    "STORES",
    "LMCacheServer",
    "ServeStore",
    "asyncconn_kv_config",
    "counter_deltas",
    "lmcache_drained",
    "lmcache_server_args",
    "make_store",
    "redis_counters",
]

#: Every ``--stores`` name, in the order the servers are started and reported.
STORES = ("none", "file", "redis", "lmcache", "lmcache-redis")
#: The stores that run LMCache's connector from another environment (``--lmcache-venv``).
LMCACHE_STORES = ("lmcache", "lmcache-redis")
_LABELS = {
    "none": "no connector",
    "file": "file://",
    "redis": "redis://",
    "lmcache": "LMCache (MP, its server's RAM)",
    "lmcache-redis": "LMCache (MP, redis L2)",
}
_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "vllm_kv_offload.json"
#: What ``examples/vllm_kv_offload.json`` holds, for an installed package that ships without ``examples/``.
_FALLBACK_CONFIG: dict[str, Any] = {
    "kv_connector": "AsyncConnKVConnector",
    "kv_connector_module_path": "asyncconn.vllm",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {},
}
#: The redis ``INFO`` fields that say how much went in and out, and how many keys were read.
_REDIS_STATS = ("total_net_input_bytes", "total_net_output_bytes", "keyspace_hits", "keyspace_misses")
#: The commands the benchmark's own reading of the counters sends (its replies, a few KiB, stay in the bytes).
_OWN_COMMANDS = ("hello", "info", "dbsize")
#: Environment of every ``lmcache server``: no banner in the logs, no usage reports (nothing to reach).
_LMCACHE_ENV = {"LMCACHE_DISABLE_BANNER": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


class ServeStore(Protocol):
    """One store of the comparison: the strategy for its two servers."""

    name: str
    label: str
    #: The interpreter of its OpenAI servers.
    python: str

    def kv_config(self, phase: int) -> dict[str, Any] | None:
        """``--kv-transfer-config`` of server ``phase`` (1: computes and saves, 2: fresh, loads)."""
        ...

    def after_saves(self) -> None:
        """Called once server 1 has been measured, before server 2 is configured and started."""
        ...

    def counters(self) -> dict[str, float]:
        """Cumulative counters of the store side; their change over a measured run is reported."""
        ...

    def stop(self) -> None: ...


def asyncconn_kv_config(url: str, key_prefix: str) -> dict[str, Any]:
    """The example config with only the store URL (and a key prefix of this run) changed."""
    try:
        config: dict[str, Any] = json.loads(_EXAMPLE.read_text())
    except OSError:
        config = json.loads(json.dumps(_FALLBACK_CONFIG))
    config["kv_connector_extra_config"]["backend_url"] = url
    config["kv_connector_extra_config"]["key_prefix"] = key_prefix
    return config


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What changed between two counter snapshots (series that did not move are left out)."""
    out: dict[str, float] = {}
    for name in sorted(set(before) | set(after)):
        delta = after.get(name, 0.0) - before.get(name, 0.0)
        if delta:
            out[name] = round(delta, 3)
    return out


def redis_counters(info: Mapping[str, Any], keys: int) -> dict[str, float]:
    """The counters read from a redis-server's ``INFO all`` (as redis-py parses it) and ``DBSIZE``."""
    out = {f"redis.{name}": float(info.get(name, 0)) for name in _REDIS_STATS}
    out["redis.keys"] = float(keys)
    out["redis.used_memory"] = float(info.get("used_memory", 0))
    for name, stats in info.items():
        command = name.removeprefix("cmdstat_")
        if name != command and isinstance(stats, Mapping) and command not in _OWN_COMMANDS:
            out[f"redis.calls.{command}"] = float(stats.get("calls", 0))
    return out


def _read_redis(url: str) -> dict[str, float]:
    import redis

    client = redis.Redis.from_url(url)
    try:
        return redis_counters(client.info("all"), int(client.dbsize()))
    finally:
        client.close()


def lmcache_server_args(venv: Path, port: int, http_port: int, redis_port: int | None = None) -> list[str]:
    """The ``lmcache server`` command line: LMCache's own store in its multi-process mode, with a 4 GB
    L1 in its RAM and, given ``redis_port``, a RESP (Redis) L2 adapter on ``127.0.0.1:redis_port``."""
    args = [
        str(venv / "bin" / "lmcache"), "server", "--host", "127.0.0.1", "--port", str(port),
        "--l1-size-gb", "4", "--l1-init-size-gb", "1", "--eviction-policy", "LRU",
        "--supported-transfer-mode", "auto", "--http-host", "127.0.0.1", "--http-port", str(http_port),
    ]  # fmt: skip
    if redis_port is not None:
        # The default L2 store policy writes every chunk to every adapter and keeps it in L1 too.
        args += ["--l2-adapter", json.dumps({"type": "resp", "host": "127.0.0.1", "port": redis_port})]
    return args


def lmcache_drained(status: Mapping[str, Any]) -> bool:
    """Whether an ``lmcache server``'s ``/status`` shows no store to L2 still queued or in flight."""
    manager = status.get("storage_manager", {})
    controllers = manager.get("store_controllers") or {"_default": manager.get("store_controller", {})}
    return all(
        c.get("pending_keys_count", 1) == 0 and c.get("in_flight_task_count", 1) == 0
        for c in controllers.values()
    )


class LMCacheServer:
    """LMCache's own server in its multi-process mode (``lmcache server``), the store LMCacheMPConnector
    talks to: what an operator comparing the two runs beside vLLM."""

    def __init__(self, venv: Path, log_path: Path, redis_port: int | None = None) -> None:
        from asyncconn_tools.chaos.procs import free_port, wait_port

        self.port = free_port()
        self.http_port = free_port()
        self.log_path = log_path
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            lmcache_server_args(venv, self.port, self.http_port, redis_port),
            env={**os.environ, **_LMCACHE_ENV},
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 180
        for port in (self.port, self.http_port):
            while True:
                try:
                    wait_port(port, timeout=1)
                    break
                except RuntimeError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"lmcache server did not come up; its log: {log_path}") from None

    def kv_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port},
        }

    def _get(self, path: str) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=30) as reply:
            return str(reply.read().decode())

    def status(self) -> dict[str, Any]:
        status: dict[str, Any] = json.loads(self._get("/status"))
        return status

    def counters(self) -> dict[str, float]:
        """Its own ``lmcache_*_total`` counters from ``/metrics`` (e.g. ``mp_lookup_hit_l2_tokens_total``:
        tokens found only in L2), and the objects its L1 holds now."""

        def wanted(name: str) -> bool:
            return name.startswith("lmcache_") and name.endswith("_total")

        out = {
            f"lmcache.{name.removeprefix('lmcache_')}": value
            for name, value in prometheus.totals(self._get("/metrics"), wanted).items()
        }
        manager = self.status().get("storage_manager", {})
        out["lmcache.l1_objects"] = float(manager.get("l1_manager", {}).get("total_object_count", 0))
        return out

    def wait_drained(self, timeout: float = 300.0) -> None:
        """Return once no store to L2 is queued or in flight (seen twice in a row); RuntimeError after
        ``timeout``: server 2 must not start before what server 1 saved has reached the store."""
        deadline = time.monotonic() + timeout
        calm = 0
        while calm < 2:
            calm = calm + 1 if lmcache_drained(self.status()) else 0
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"lmcache server still storing to L2 after {timeout:.0f}s: {self.log_path}"
                )
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@dataclass
class _NoStore:
    name: str = "none"
    label: str = _LABELS["none"]
    python: str = sys.executable

    def kv_config(self, phase: int) -> dict[str, Any] | None:
        return None

    def after_saves(self) -> None:
        return None

    def counters(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        return None


@dataclass
class _AsyncConnStore:
    """asyncconn's connector on ``url``; ``redis`` (when given) is the server behind it, stopped with it."""

    name: str
    url: str
    key_prefix: str
    redis: Any = None
    label: str = ""
    python: str = sys.executable

    def __post_init__(self) -> None:
        self.label = _LABELS[self.name]

    def kv_config(self, phase: int) -> dict[str, Any] | None:
        return asyncconn_kv_config(self.url, self.key_prefix)

    def after_saves(self) -> None:
        return None

    def counters(self) -> dict[str, float]:
        return _read_redis(self.url) if self.redis is not None else {}

    def stop(self) -> None:
        if self.redis is not None:
            self.redis.stop()


@dataclass
class _LMCacheL1Store:
    """One ``lmcache server`` for both OpenAI servers: server 2 loads from that process's RAM."""

    server: LMCacheServer
    python: str
    name: str = "lmcache"
    label: str = _LABELS["lmcache"]

    def kv_config(self, phase: int) -> dict[str, Any] | None:
        return self.server.kv_config()

    def after_saves(self) -> None:
        return None

    def counters(self) -> dict[str, float]:
        return self.server.counters()

    def stop(self) -> None:
        self.server.stop()


@dataclass
class _LMCacheRedisStore:
    """LMCache over a redis-server: one ``lmcache server`` per phase, both with the same RESP L2."""

    redis: Any
    venv: Path
    logs: Path
    python: str
    name: str = "lmcache-redis"
    label: str = _LABELS["lmcache-redis"]
    servers: list[LMCacheServer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.servers.append(self._start(1))

    def _start(self, phase: int) -> LMCacheServer:
        log = self.logs / f"lmcache-redis-server-{phase}.log"
        return LMCacheServer(self.venv, log, redis_port=self.redis.port)

    def kv_config(self, phase: int) -> dict[str, Any] | None:
        return self.servers[min(phase, len(self.servers)) - 1].kv_config()

    def after_saves(self) -> None:
        # Server 1's chunks reach Redis behind its requests; a fresh lmcache server (nothing in its L1)
        # for server 2 then has Redis as its only source.
        self.servers[0].wait_drained()
        self.servers.append(self._start(2))

    def counters(self) -> dict[str, float]:
        return {**_read_redis(self.redis.url), **self.servers[-1].counters()}

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
        self.redis.stop()


def make_store(
    name: str, *, work: Path, logs: Path, key_prefix: str, lmcache_venv: Path | None
) -> ServeStore:
    """The strategy for ``name`` (one of :data:`STORES`), with what it runs started."""
    from asyncconn_tools.chaos.procs import RedisServer

    if name == "none":
        return _NoStore()
    if name == "file":
        return _AsyncConnStore(name, f"file://{work}/store?max_bytes=4GiB", key_prefix)
    if name == "redis":
        redis = RedisServer().start()
        return _AsyncConnStore(name, redis.url, key_prefix, redis=redis)
    if lmcache_venv is None or name not in LMCACHE_STORES:
        raise ValueError(f"store {name!r} needs --lmcache-venv" if name in LMCACHE_STORES else name)
    python = str(lmcache_venv / "bin" / "python")
    if name == "lmcache":
        return _LMCacheL1Store(LMCacheServer(lmcache_venv, logs / "lmcache-server.log"), python)
    redis = RedisServer().start()
    try:
        return _LMCacheRedisStore(redis, lmcache_venv, logs, python)
    except BaseException:
        redis.stop()
        raise
