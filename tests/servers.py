"""Real servers for tests: a ``redis-server`` on a free loopback port, started and stopped by us.

Never depends on a server that happens to be running on 6379. The process control (pause with SIGSTOP,
resume, kill, restart on the same port) lives in :mod:`asyncconn_tools.chaos.procs`, shared with ``asyncconn
chaos``; this module re-exports it under the names the tests use.
"""

from __future__ import annotations

from asyncconn_tools.chaos.procs import LookupServerProcess, RedisServer, ServerProcess, free_port, wait_port

__all__ = ["LookupServerProcess", "RedisServer", "ServerProcess", "free_port", "wait_port"]
