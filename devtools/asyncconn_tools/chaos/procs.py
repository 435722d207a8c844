"""Real server processes that a chaos run (and the test suite) starts, freezes, kills and restarts.

Why here and not in the tests: ``asyncconn chaos`` is an operator-facing command that injects faults into a
real ``redis-server`` and a real ``asyncconn lookup-server``, so it needs the same process control the tests
use. Every server binds loopback on a free port, never a server that happens to run on a well-known port,
and ``restart`` comes back on the same port (clients reconnect to the address they were given).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

__all__ = ["LookupServerProcess", "RedisServer", "ServerProcess", "free_port", "wait_port"]


def free_port() -> int:
    """A TCP port nothing listens on right now (the usual bind-to-0 trick; a tiny race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    """Return once something accepts connections on ``127.0.0.1:port``; RuntimeError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout}s")


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in ``/proc``); True where there is no
    ``/proc`` to ask (nothing better can be done there) or the process is gone."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # the thread ended meanwhile
        state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
        if state not in (b"T", b"t", b"Z", b"X"):
            return False
    return True


class ServerProcess:
    """Signals for a server subprocess held in ``self.proc``: freeze, thaw, kill (fault injection)."""

    proc: subprocess.Popen[bytes] | None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pause(self) -> None:
        """SIGSTOP: the server keeps its sockets open but answers nothing (a hung store).

        Returns once every thread of the server is stopped: ``kill`` only queues the signal, and on a busy
        host a multi-threaded server (mooncake_master) was seen answering a request sent after it returned.
        """
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        while not _all_threads_stopped(self.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def resume(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)

    def start(self) -> ServerProcess:
        raise NotImplementedError

    def restart(self) -> None:
        """Kill and start again on the same port (redis comes back empty: it keeps nothing on disk)."""
        self.kill()
        self.start()

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT, so a frozen server dies too) and reap it."""
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)

    def _terminate(self) -> None:
        if self.alive:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


@dataclass
class RedisServer(ServerProcess):
    """One redis-server process on loopback; ``url`` is ready to hand to ``open_backend``."""

    port: int = field(default_factory=free_port)
    password: str | None = field(default=None, repr=False)
    extra_args: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="asyncconn-redis-"))

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        args = [
            binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            self.workdir,
            "--protected-mode",
            "no",
            "--loglevel",
            "warning",
        ]
        if self.password:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        self._terminate()
        shutil.rmtree(self.workdir, ignore_errors=True)


@dataclass
class LookupServerProcess(ServerProcess):
    """``asyncconn lookup-server`` in its own process, serving ``backend_url`` on a loopback TCP port."""

    backend_url: str = field(repr=False)  # it may hold the store's password
    key_prefix: str = ""
    block_size: int = 16
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def start(self, *, wait: bool = True) -> LookupServerProcess:
        """Launch the server; ``wait=False`` returns at once (clients reconnect when it is up)."""
        args = [
            sys.executable,
            "-m",
            "asyncconn",
            "lookup-server",
            "--backend",
            self.backend_url,
            "--bind",
            self.endpoint,
            "--key-prefix",
            self.key_prefix,
            "--block-size",
            str(self.block_size),
            "--timeout",
            "1",
        ]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the server accepts connections (a cold interpreter imports torch first)."""
        try:
            wait_port(self.port, timeout=timeout)
        except RuntimeError:
            self.kill()
            raise

    def stop(self) -> None:
        self._terminate()
