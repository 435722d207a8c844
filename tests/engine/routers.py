"""What a KV-aware router sees of an engine: vLLM's KV events, fetched from its ZMQ publisher's replay
socket and decoded with msgspec as ``KVEventBatch`` (what a router asks for after a gap; the live PUB stream
carries the same frames), and indexed by residency -- (medium, ownership) -> block hashes -- as vLLM tracks
its own offloading tiers."""

from __future__ import annotations

import json
import random
import socket
import time
from typing import Any

__all__ = ["Subscriber", "events_config", "events_flag", "free_port", "replayed_batches", "residency"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listen_port(taken: tuple[int, ...] = ()) -> int:
    """A port free on every interface (vLLM's publisher binds ``tcp://*``), below the kernel's ephemeral
    range. Why not :func:`free_port`: the engine binds it only after its start-up, and a pipeline-parallel
    start-up opens many connections (gloo's), any of which may take an ephemeral port as its own end in
    the meantime ("Address already in use", seen in CI)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, max(low, 10001))
        if port in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        return port
    return free_port()


def _fields() -> tuple[dict[str, Any], int, int]:
    pub_port = _listen_port()
    replay_port = _listen_port((pub_port,))
    fields = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub_port}",
        "replay_endpoint": f"tcp://*:{replay_port}",
    }
    return fields, pub_port, replay_port


def events_config() -> tuple[Any, int, int]:
    """vLLM's KV events on, published over ZMQ on free ports: the config for ``LLM``, the live stream's
    port and the replay port."""
    from vllm.config import KVEventsConfig

    fields, pub_port, replay_port = _fields()
    return KVEventsConfig(**fields), pub_port, replay_port


def events_flag() -> tuple[list[str], int]:
    """The same for ``vllm serve``: its ``--kv-events-config`` arguments and the replay port."""
    fields, _, replay_port = _fields()
    return ["--kv-events-config", json.dumps(fields)], replay_port


class Subscriber:
    """A router's live feed: a ZMQ SUB socket on the publisher's stream, every batch decoded as it comes."""

    def __init__(self, pub_port: int) -> None:
        import zmq

        self._context = zmq.Context()
        self._sock = self._context.socket(zmq.SUB)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(f"tcp://127.0.0.1:{pub_port}")
        time.sleep(0.5)  # ZMQ's slow joiner: what is published before the subscription arrives is not sent
        self.batches: list[Any] = []
        self.seqs: list[int] = []

    def drain(self, quiet_s: float = 1.0, limit_s: float = 30.0) -> list[Any]:
        """Every batch published so far: read until the stream has been quiet for ``quiet_s``."""
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and self._sock.poll(int(quiet_s * 1000)):
            _topic, seq, payload = self._sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            self.batches.append(decoder.decode(payload))
        return self.batches

    def close(self) -> None:
        self._sock.close(linger=0)
        self._context.term()


def replayed_batches(replay_port: int) -> list[Any]:
    """Every batch the publisher buffered, decoded as a router decodes them."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        sock.connect(f"tcp://127.0.0.1:{replay_port}")
        sock.send_multipart((b"", (0).to_bytes(8, "big")))
        batches = []
        while True:
            if not sock.poll(30_000):  # hang guard only: the publisher answers within its 0.1 s poll
                raise TimeoutError("the publisher's replay socket did not answer")
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == ZmqEventPublisher.END_SEQ:
                return batches
            batches.append(decoder.decode(payload))
    finally:
        sock.close(linger=0)
        context.term()


def residency(batches: list[Any]) -> dict[tuple[Any, Any], set[Any]]:
    """The events replayed in order, as a router indexes them: (medium, ownership) -> block hashes."""
    from tests.vllm.kv.test_support import EventRouter

    router = EventRouter()
    for batch in batches:
        router.publish(batch)
    return router.held
