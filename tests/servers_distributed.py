"""Real distributed stores for tests: a 3-master Redis Cluster and a ``mooncake_master``, on loopback.

Both are started and stopped by us on free ports; nothing depends on a server that happens to be running.
The cluster is built the way operators build one (``redis-server --cluster-enabled yes`` per node, then
``redis-cli --cluster create ... --cluster-yes``) and each node keeps its ``nodes.conf`` across a kill, so
a node restarted on its port rejoins the cluster with its slots.
"""

from __future__ import annotations

import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from tests.servers import RedisServer, ServerProcess, wait_port

#: Redis Cluster nodes talk to each other on ``port + 10000`` (the cluster bus).
_BUS_OFFSET = 10000


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port(taken: set[int]) -> int:
    """A loopback port whose cluster-bus twin (``port + 10000``) is free as well."""
    for _ in range(1000):
        port = random.randint(20000, 40000)
        if port in taken or port + _BUS_OFFSET in taken:
            continue
        if _port_free(port) and _port_free(port + _BUS_OFFSET):
            return port
    raise RuntimeError("no free port pair for a Redis Cluster node")


def _redis_cli(*args: str, timeout: float = 20.0) -> str:
    binary = shutil.which("redis-cli")
    if binary is None:
        raise RuntimeError("redis-cli is not installed (apt-get install redis-tools)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"redis-cli {' '.join(args)} failed: {done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class RedisCluster:
    """Three (``masters``) cluster-mode redis-servers joined into one cluster; ``url`` names them all."""

    masters: int = 3
    #: How long a node may be unresponsive before the others mark it failed (the cluster is then down).
    #: Long by default: on a loaded 2-core box a node stalls for a second now and then, and a shared
    #: cluster marked down fails tests that killed nothing. Tests that kill a node use a short one.
    node_timeout_ms: int = 15000
    nodes: list[RedisServer] = field(default_factory=list)

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in self.ports)

    def start(self) -> RedisCluster:
        taken: set[int] = set()
        try:
            for _ in range(self.masters):
                port = free_cluster_port(taken)
                taken |= {port, port + _BUS_OFFSET}
                node = RedisServer(
                    port=port,
                    extra_args=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        str(self.node_timeout_ms),
                    ),
                )
                self.nodes.append(node.start())
            addresses = [f"127.0.0.1:{p}" for p in self.ports]
            _redis_cli("--cluster", "create", *addresses, "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Wait until every live node reports ``cluster_state:ok`` and knows every slot's owner."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if all(self._node_ok(n.port) for n in self.nodes if self._alive(n)):
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"Redis Cluster on {self.ports} not ok after {timeout}s")
            time.sleep(0.05)

    @staticmethod
    def _alive(node: RedisServer) -> bool:
        return node.proc is not None and node.proc.poll() is None

    @staticmethod
    def _node_ok(port: int) -> bool:
        info = _redis_cli("-p", str(port), "cluster", "info", timeout=2)
        slots = _redis_cli("-p", str(port), "cluster", "slots", timeout=2)
        return "cluster_state:ok" in info and "cluster_slots_assigned:16384" in info and bool(slots)

    def node_for(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def owner_of(self, key: str) -> RedisServer:
        """The node that serves ``key``'s slot (asked of the cluster, not computed here)."""
        slot = int(_redis_cli("-p", str(self.ports[0]), "cluster", "keyslot", key).strip())
        for line in _redis_cli("-p", str(self.ports[0]), "cluster", "nodes").splitlines():
            fields = line.split()
            if "master" not in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for span in fields[8:]:
                lo, _, hi = span.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return self.node_for(port)
        raise RuntimeError(f"no master owns slot {slot}")

    def kill(self, node: RedisServer) -> None:
        node.kill()

    def restart(self, node: RedisServer) -> None:
        """Start a killed node again on its port; its ``nodes.conf`` makes it rejoin with its slots."""
        node.start()
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


@dataclass
class MooncakeMaster(ServerProcess):
    """One ``mooncake_master`` with its HTTP metadata server, both on free loopback ports."""

    rpc_port: int = 0
    http_port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="asyncconn-mooncake-"))
    extra_args: tuple[str, ...] = ()

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def url(self, **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in {"metadata": self.metadata_url, **params}.items())
        return f"mooncake://127.0.0.1:{self.rpc_port}?{query}"

    def start(self) -> MooncakeMaster:
        binary = find_mooncake_master()
        if binary is None:
            raise RuntimeError("mooncake_master not found (pip install mooncake-transfer-engine-non-cuda)")
        if not self.rpc_port:
            self.rpc_port = _free_port()
        if not self.http_port:
            self.http_port = _free_port()
        if not self.metrics_port:  # the default (9003) would collide between masters on one host
            self.metrics_port = _free_port()
        args = [
            binary,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={self.metrics_port}",
            *self.extra_args,
        ]
        log = open(Path(self.workdir) / "master.log", "ab")  # handed to the process
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        finally:
            log.close()
        wait_port(self.rpc_port, timeout=15)
        self._wait_http()
        return self

    def _wait_http(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{self.metadata_url}?key=probe", timeout=1):
                    return
            except urllib.error.HTTPError:
                return  # the server answered (404 for an unknown key): it is up
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mooncake metadata server not up on {self.http_port}") from None
                time.sleep(0.05)

    def log_text(self) -> str:
        path = Path(self.workdir) / "master.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.workdir, ignore_errors=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def find_mooncake_master() -> str | None:
    """The ``mooncake_master`` binary: on PATH, or next to this interpreter (the wheel's console script)."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else None


def mooncake_contract_url(master: MooncakeMaster) -> str:
    """A ``mooncake://`` URL for the contract suite: a small segment, short timeout, loopback TCP."""
    return master.url(
        protocol="tcp",
        segment="256MiB",
        buffer="64MiB",
        timeout="3s",
        prefix=f"contract-{uuid.uuid4().hex[:8]}/",
    )
