"""A ZMQ lookup server in a few lines and a pipelined client asking it: ``python examples/lookup_server.py``.

In production run ``asyncconn lookup-server --backend redis://... --bind ipc:///run/asyncconn/lookup.sock``
and point vLLM's connector at it with ``"lookup_server": "ipc:///run/asyncconn/lookup.sock"`` in its
extra_config. The same server answers vLLM's MooncakeStoreConnector REQ clients unchanged.
"""

from __future__ import annotations

from asyncconn.lookup import PREFIX, LookupConfig, LookupServer, open_lookup_client, store_key
from asyncconn.runtime import get_runtime, shutdown_runtime
from asyncconn.store import TensorStore

BLOCKS = [bytes([i]) * 32 for i in range(4)]  # block hashes, as vLLM computes them


async def start_server() -> tuple[TensorStore, LookupServer]:
    store = await TensorStore.open("memory://example")
    await store.backend.put([(store_key("kv:", h), b"...") for h in BLOCKS[:3]])  # a saver wrote 3 blocks
    server = LookupServer(store, "tcp://127.0.0.1:*", key_prefix="kv:", block_size=16)
    await server.start()
    return store, server


def main() -> None:
    rt = get_runtime()  # the library's background loop; the server may share it or run anywhere
    store, server = rt.run(start_server())
    assert server.endpoint is not None
    client = open_lookup_client(LookupConfig(lookup_server=server.endpoint), PREFIX)
    try:
        client.submit("req-1", BLOCKS)  # from the scheduler: returns at once
        print("first poll:", client.poll("req-1"))  # None: ask again next step
        print("leading blocks present:", client.lookup_sync("req-2", BLOCKS))  # 3
        print("metrics:", client.metrics.snapshot())
    finally:
        client.close()
        rt.run(server.close())
        rt.run(store.close())
        shutdown_runtime()


if __name__ == "__main__":
    main()
