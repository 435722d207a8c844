"""vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) as a subprocess, for the serving
benchmark and the shutdown tests.

Why a subprocess and not the in-process engine of :mod:`asyncconn_tools.engines`: what an operator runs is
this server, in vLLM's default multiprocess mode (the HTTP front end in one process, the engine core in a
child), and what it does on SIGTERM, with requests in flight, is only visible there. The helper also reads
what a server leaves behind -- its process tree, its listening sockets, the ``/dev/shm`` entries it maps --
from ``/proc``, so a test can check that all of it is gone after the server exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from asyncconn_tools import prometheus
from asyncconn_tools.chaos.procs import free_port

__all__ = ["OpenAIServer", "alive", "descendants", "listening_ports", "server_env", "shm_entries", "stop_all"]


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields start after the last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = _ppid(int(entry))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] not in (b"Z", b"X")


def _socket_inodes(pid: int) -> set[str]:
    inodes: set[str] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    return inodes


def listening_ports(pids: Sequence[int] | set[int] | None = None) -> set[int]:
    """TCP ports in the LISTEN state (IPv4 and IPv6); only those of sockets ``pids`` hold, when given."""
    wanted: set[str] | None = None
    if pids is not None:
        wanted = set()
        for pid in pids:
            wanted |= _socket_inodes(pid)
    ports: set[int] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if len(cols) > 9 and cols[3] == "0A" and (wanted is None or cols[9] in wanted):
                    ports.add(int(cols[1].rsplit(":", 1)[1], 16))
    return ports


def shm_entries(pids: Sequence[int] | set[int]) -> set[str]:
    """The ``/dev/shm`` files ``pids`` map or hold open (what they leave behind unless unlinked)."""
    found: set[str] = set()
    for pid in pids:
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" in line:
                    found.add(line[line.index("/dev/shm/") :].strip().removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if target.startswith("/dev/shm/"):
                        found.add(target.removesuffix(" (deleted)"))
    return found


def server_env(**overrides: str) -> dict[str, str]:
    """The environment a CPU OpenAI server needs here: no model hub, vLLM's default multiprocess mode."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # in-process engines are for tests, not this server
    if env.get("VLLM_CPU_KVCACHE_SPACE") == "":  # vLLM's CPU platform crashes on an empty value
        del env["VLLM_CPU_KVCACHE_SPACE"]
    env.update(overrides)
    return env


@dataclass
class OpenAIServer:
    """One ``vllm.entrypoints.openai.api_server`` on loopback, on a tiny local model.

    ``kv_transfer_config`` is the JSON object an operator passes to ``--kv-transfer-config`` (None: no
    connector). The server's output goes to ``log_path`` (read back by :meth:`log_tail` when it fails).
    """

    model: Path
    log_path: Path
    kv_transfer_config: Mapping[str, Any] | None = None
    port: int = field(default_factory=free_port)
    max_model_len: int = 4096
    kv_cache_bytes: int = 256 << 20
    extra_args: Sequence[str] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    #: The interpreter that runs the server: another environment's (e.g. one with LMCache) for comparisons.
    python: str = sys.executable
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        args = [
            self.python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--block-size", "32", "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--enforce-eager", "--seed", "0",
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return args + list(self.extra_args)

    def start(self, *, wait: bool = True, timeout: float = 300.0) -> OpenAIServer:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.args(), env=server_env(**self.env), stdout=self._log, stderr=subprocess.STDOUT
        )
        if wait:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Return once ``/health`` answers; RuntimeError (with the log's tail) if the server dies or hangs."""
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the OpenAI server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base_url + "/health", timeout=2):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the OpenAI server did not come up in {timeout:.0f}s:\n{self.log_tail()}"
                    ) from None
                time.sleep(0.5)

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as series name -> value summed over label sets."""
        return prometheus.totals(self._scrape())

    def metrics_by(self, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
        """One series of ``/metrics`` by the value of one of its labels (summed over the others), of the
        samples whose labels include ``where``."""
        return prometheus.by_label(self._scrape(), name, label, where)

    def _scrape(self) -> str:
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=30) as reply:
            return str(reply.read().decode())

    def tree(self) -> set[int]:
        """The server's pid and every process below it."""
        if self.proc is None:
            return set()
        return {self.proc.pid, *descendants(self.proc.pid)}

    def signal(self, signum: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    @contextlib.contextmanager
    def running(self, start_timeout: float = 300.0, stop_timeout: float = 30.0) -> Iterator[OpenAIServer]:
        """Start and wait until ready; on leaving, stop and kill every process of the tree seen at the start
        or now, whatever failed (a test never leaves a server process to the next one)."""
        tree: set[int] = set()
        try:
            self.start(timeout=start_timeout)
            tree = self.tree()
            yield self
        finally:
            self.stop(timeout=stop_timeout)
            for pid in tree | self.tree():
                if alive(pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL whatever of the tree is left; the exit status."""
        stop_all([self], timeout)
        return None if self.proc is None else self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def stop_all(servers: Sequence[OpenAIServer], timeout: float = 60.0) -> None:
    """Stop ``servers`` together: SIGTERM to each, one shared ``timeout`` for all of them to exit, then
    SIGKILL for what is left of each tree (a server still starting may ignore SIGTERM until it is up)."""
    trees = [server.tree() for server in servers]
    for server in servers:
        server.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for server in servers:
        if server.proc is None:
            continue
        try:
            server.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait(10)
    for server, tree in zip(servers, trees, strict=True):
        for pid in tree - {server.proc.pid if server.proc else -1}:
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        server._close_log()
