"""examples/custom_connector.py: a connector written on the library's lookup client, loader and save tracker
works against vLLM's real scheduler: E saves, PD loads instead of encoding, nothing leaks."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
import torch
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn_tools.sim.engine import ConnectorSpec, MMItem, SimShape, embedding_for

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too

CLASS, MODULE = "LibraryECConnector", "examples.custom_connector"


def wait_stored(url: str, key: str, timeout: float = 5.0) -> None:
    async def exists() -> bool:
        store = await TensorStore.open(url)
        try:
            return (await store.exists([key]))[0]
        finally:
            await store.close()

    deadline = time.monotonic() + timeout
    while not get_runtime().run(exists(), 5):
        assert time.monotonic() < deadline, f"{key} was never saved"
        time.sleep(0.01)


def test_library_connector_producer_then_consumer(make_sim: Any) -> None:
    url = f"memory://custom-{uuid.uuid4().hex[:8]}"
    extra = {"backend_url": url, "key_prefix": "mm:"}
    img = MMItem("img-lib", offset=8, length=16)
    e = make_sim(ec=ConnectorSpec(CLASS, MODULE, "ec_producer", extra))
    e.add_request("e1", list(range(40)), mm_items=[img])
    e.run_until_idle()
    assert e.encoder_runs() == [("e1", "img-lib")]
    assert e.leak_check() == []
    wait_stored(url, "mm:img-lib")

    pd = make_sim(ec=ConnectorSpec(CLASS, MODULE, "ec_consumer", extra), num_workers=2)
    pd.add_request("r1", list(range(40)), max_tokens=3, mm_items=[img])
    pd.add_request("r2", list(range(100, 140)), max_tokens=3, mm_items=[MMItem("img-unknown", 8, 16)])
    for _ in range(2000):
        if not pd.scheduler.has_requests():
            break
        pd.step()
        time.sleep(0.0005)
    assert pd.encoder_runs() == [("r2", "img-unknown")]  # only the image that was never stored
    used = pd.embeddings_used("r1")["img-lib"]
    assert torch.equal(used, embedding_for("img-lib", 16, SimShape().hidden_size))
    assert pd.leak_check() == []
    for worker in pd.workers:
        assert all(v == 0 for v in worker.ec_connector.loader.held().values())
    assert pd.scheduler.ec_connector.lookup.held()["entries"] == 0
