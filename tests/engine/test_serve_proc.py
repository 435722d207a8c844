"""The ``/proc`` readings the SIGTERM test relies on (:mod:`asyncconn_tools.openai_server`), checked on a
plain process tree, without vLLM: if they saw nothing, "nothing left behind" would pass vacuously."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from asyncconn_tools.openai_server import alive, descendants, listening_ports, shm_entries

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs Linux /proc")

_CHILD = r"""
import mmap, os, socket, subprocess, sys, time
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen()
name = f"asyncconn-test-{os.getpid()}"
fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)
mapped = mmap.mmap(fd, 4096)
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(sock.getsockname()[1], name, grandchild.pid, flush=True)
time.sleep(60)
"""


def test_tree_ports_and_shm_of_a_live_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    shm_path = ""
    try:
        assert child.stdout is not None
        port_text, shm_name, grandchild_text = child.stdout.readline().split()
        port, grandchild = int(port_text), int(grandchild_text)
        shm_path = f"/dev/shm/{shm_name}"
        tree = {child.pid, *descendants(child.pid)}
        assert grandchild in tree
        assert port in listening_ports(tree)
        assert port in listening_ports()
        assert shm_path in shm_entries(tree)
        assert listening_ports({os.getpid()}).isdisjoint({port})  # another process's socket is not ours
        os.kill(grandchild, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(grandchild)  # killed and not yet reaped (a zombie) counts as gone
    finally:
        child.kill()
        child.wait()
        if shm_path and os.path.exists(shm_path):
            os.unlink(shm_path)  # the child never unlinks it: it is killed
