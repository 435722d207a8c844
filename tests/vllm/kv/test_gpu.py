"""KV blocks saved from a ``[2, num_blocks, ...]`` (flash-attention) KV cache and loaded back into other
blocks hold exactly the saved bytes, even though the source blocks are overwritten right after the save (and
vLLM's ``handle_preemptions``, which precedes any reuse of a preempted request's blocks).
On an NVIDIA GPU (``gpu`` marker, skipped without CUDA) through the loader's and the save tracker's side
streams and pinned staging while the default stream keeps computing; the same test runs on the CPU device
everywhere. The worker side needs no vLLM: this runs where vLLM is not installed (the GPU proof machine)."""

from __future__ import annotations

import pytest
import torch

from tests.transfer.worker_sides import kv_round_trip

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("where", DEVICES)
def test_blocks_round_trip_through_the_store(where: str) -> None:
    kv_round_trip(where)
