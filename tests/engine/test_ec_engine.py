"""The EC connector in vLLM's real engine: E (``ec_producer``) saves embeddings, PD (``ec_consumer``) loads.

What is proven, each by a check that fails if the path was not taken:
- E's stored values are byte for byte what E's vision encoder returned;
- PD's greedy tokens equal a reference engine's, and PD's encoder ran only for the requests a stalled V1
  engine released to it (docs/ec.md: vLLM's V1 runner calls no EC hook on an empty step, so an idle engine
  releases one request; it releases another if it idles again while prefetches are still unreported);
- PD used the stored embeddings: a store holding valid but *different* embeddings changes PD's output for
  exactly the requests it loaded;
- a corrupt stored value is encoded locally, and every connector structure is back to zero afterwards;
  PD removes it, so E's next run (which skips keys the store has) writes the good value again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pytest
import torch

from asyncconn.lookup.protocol import store_key
from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn_tools.engines import (
    Probe,
    close_llm,
    config_from_json,
    ec_params,
    forward_ec_params,
    make_llm,
    token_ids,
)
from asyncconn_tools.tiny_models import IMAGE_SIZE

pytestmark = pytest.mark.vllm

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PREFIX = "ec:"  # the examples' key_prefix

T = TypeVar("T")
N = 6
#: As in the demo: the released request decodes long enough for the others' prefetches to be reported
#: (at 6 tokens, reads slowed to 30 ms released 2-4 of 6; at 24, 1).
SAMPLING = {"max_tokens": 24, "temperature": 0.0, "ignore_eos": True}


def requests() -> list[dict[str, Any]]:
    from PIL import Image

    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)) for _ in range(N)
    ]
    return [
        {"prompt": f"w{10 + i} w11 w12 w13", "multi_modal_data": {"image": im}} for i, im in enumerate(images)
    ]


def run(model: Path, role: str | None, url: str, params: list[Any] | None = None) -> dict[str, Any]:
    """One engine over :func:`requests`; returns tokens, E's params, encoder outputs and connector state."""
    from vllm import SamplingParams

    # E and PD are configured from the example files an operator starts from (store URL replaced).
    ec = None
    if role is not None:
        example = EXAMPLES / f"vllm_{role}.json"
        ec = config_from_json(example.read_text(), backend_url=url)
        assert ec.ec_role == role
    llm = make_llm(model, ec=ec, max_model_len=512)
    try:
        probe = Probe(llm)
        sampling: Any = SamplingParams(**SAMPLING)
        if params is not None:
            sampling = [forward_ec_params(p, **SAMPLING) for p in params]
        with probe.encoder_outputs() as encoded:
            outputs = llm.generate(requests(), sampling)
        probe.settle()
        probe.ec_saves_done()
        out: dict[str, Any] = {"tokens": token_ids(outputs), "params": ec_params(outputs), "encoded": encoded}
        if role is not None:
            scheduler = probe.ec_scheduler_connector().scheduler_side
            worker = probe.ec_worker_connector().worker_side
            worker.poll()
            deadline = time.monotonic() + 5  # corrupt values being removed (fire and forget)
            while worker.held()["deletes"] and time.monotonic() < deadline:
                time.sleep(0.01)
            out["scheduler_counters"] = scheduler.held()
            stats = scheduler.totals()
            out["released"] = stats["encode_stalled"] + stats["encode_budget"]
            out["worker_counters"] = worker.held()
            out["worker"] = worker
        return out
    finally:
        close_llm(llm)


@pytest.fixture(scope="module")
def reference(vision_model: Path) -> dict[str, Any]:
    out = run(vision_model, None, "")
    assert len(out["encoded"]) == N
    assert len({tuple(t) for t in out["tokens"]}) > 1, "the model's tokens do not depend on the image"
    return out


@pytest.fixture
def produced(vision_model: Path, tmp_path: Path, reference: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """E's run over a fresh file:// store."""
    url = f"file://{tmp_path / 'store'}"
    out = run(vision_model, "ec_producer", url)
    out["url"] = url
    yield out


def on_store(url: str, use: Callable[[TensorStore], Awaitable[T]]) -> T:
    """``use`` a store opened on ``url`` (closed afterwards), from this test's thread."""

    async def call() -> T:
        store = await TensorStore.open(url)
        try:
            return await use(store)
        finally:
            await store.close()

    return get_runtime().run(call(), 30)


def stored(url: str, hashes: list[str]) -> list[torch.Tensor | None]:
    return on_store(url, lambda store: store.get([store_key(PREFIX, h) for h in hashes]))


def present(url: str, hashes: list[str]) -> list[bool]:
    """Whether the store holds a value (good or bad) under each item's key."""
    return on_store(url, lambda store: store.exists([store_key(PREFIX, h) for h in hashes]))


def rewrite(url: str, values: dict[str, torch.Tensor]) -> None:
    on_store(url, lambda store: store.put([(store_key(PREFIX, h), v) for h, v in values.items()]))


def hashes_of(params: list[Any]) -> list[str]:
    out = []
    for p in params:
        assert p and len(p["asyncconn_saving"]) == 1, p
        out.append(p["asyncconn_saving"][0])
    return out


def assert_idle(run_out: dict[str, Any]) -> None:
    assert set(run_out["scheduler_counters"].values()) == {0}, run_out["scheduler_counters"]
    assert set(run_out["worker_counters"].values()) == {0}, run_out["worker_counters"]


def test_e_saves_exactly_what_its_encoder_returned(produced: dict[str, Any]) -> None:
    assert len(produced["encoded"]) == N
    assert all(t == [] for t in produced["tokens"])  # an encoder-only instance generates nothing
    values = stored(produced["url"], hashes_of(produced["params"]))
    for value in values:
        assert value is not None
        matches = [e for e in produced["encoded"] if e.shape == value.shape and torch.equal(e, value)]
        assert len(matches) == 1, "a stored embedding is not one E's encoder returned"
    assert_idle(produced)


def test_pd_loads_stored_embeddings_instead_of_encoding(
    vision_model: Path, reference: dict[str, Any], produced: dict[str, Any]
) -> None:
    pd = run(vision_model, "ec_consumer", produced["url"], produced["params"])
    assert pd["tokens"] == reference["tokens"]
    loaded = pd["worker"].loader.loaded
    # PD's encoder ran only for the requests its stalled engine released; every other image was loaded.
    assert pd["released"] == len(pd["encoded"]) < loaded
    assert loaded == N - len(pd["encoded"])
    assert_idle(pd)


def test_pd_output_follows_the_stored_embeddings(
    vision_model: Path, reference: dict[str, Any], produced: dict[str, Any]
) -> None:
    """Valid but different embeddings in the store change PD's output: PD really used what it loaded."""
    hashes = hashes_of(produced["params"])
    values = stored(produced["url"], hashes)
    assert all(v is not None for v in values)
    # Each key now holds the next image's embedding: well-formed, the right shape, the wrong content.
    rewrite(produced["url"], {h: values[(i + 1) % N] for i, h in enumerate(hashes)})  # type: ignore[misc]
    pd = run(vision_model, "ec_consumer", produced["url"], produced["params"])
    changed = sum(a != b for a, b in zip(pd["tokens"], reference["tokens"], strict=True))
    assert pd["released"] == len(pd["encoded"]) < changed
    assert changed == N - len(pd["encoded"])
    assert_idle(pd)


def test_a_corrupt_stored_embedding_is_encoded_locally(
    vision_model: Path, reference: dict[str, Any], produced: dict[str, Any]
) -> None:
    store_dir = Path(produced["url"][len("file://") :])
    damaged = 0
    for path in sorted(p for p in store_dir.rglob("*") if p.is_file() and not p.name.startswith(".")):
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload: the checksum must catch it
        path.write_bytes(bytes(data))
        damaged += 1
    assert damaged == N
    pd = run(vision_model, "ec_consumer", produced["url"], produced["params"])
    assert pd["tokens"] == reference["tokens"]
    assert len(pd["encoded"]) == N
    assert pd["worker"].loader.loaded == 0
    assert_idle(pd)
    # Every value PD tried to load is gone (a request a stalled engine released to its encoder may not have
    # tried); E, skipping keys the store has, writes exactly those again, byte for byte.
    hashes = hashes_of(produced["params"])
    left = [h for h, there in zip(hashes, present(produced["url"], hashes), strict=True) if there]
    assert pd["released"] < N
    assert len(left) <= pd["released"], (left, pd["released"])
    again = run(vision_model, "ec_producer", produced["url"])
    assert again["worker_counters"]["deletes"] == 0
    for h, value in zip(hashes, stored(produced["url"], hashes), strict=True):
        if h in left:
            assert value is None  # still damaged: a miss on read, and E skipped it as stored
        else:
            assert value is not None, h
            assert any(e.shape == value.shape and torch.equal(e, value) for e in again["encoded"]), h
