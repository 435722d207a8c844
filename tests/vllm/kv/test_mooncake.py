"""The KV connector on a real ``mooncake_master``: loads from another live engine's segment, and a master
that dies between the lookup's answer and the loads (the requests recompute, nothing leaks or hangs).

Mooncake keeps values in the segments its live clients contribute, so the engine that saved stays up while
the second one loads (docs/distributed.md). ``private_master`` comes before ``make_sim`` in the signatures:
the engines are closed before the master stops.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import vllm  # noqa: F401  (installed by the README's test command: missing must fail, not skip)

from tests.servers_distributed import MooncakeMaster
from tests.vllm.kv.test_support import kv_spec, leaks, load_error_blocks, prompt, run_checked

pytestmark = pytest.mark.interface  # no model runner: scripts/lane-vllm033.sh runs this on vLLM 0.33 too


def _url(master: MooncakeMaster) -> str:
    return master.url(segment="32MiB", buffer="16MiB", timeout="1s", prefix=f"kv-{uuid.uuid4().hex[:8]}/")


def test_a_second_engine_loads_what_the_first_saved(private_master: MooncakeMaster, make_sim: Any) -> None:
    master = private_master
    url = _url(master)
    tokens = {f"r{i}": prompt(20 + i, 96) for i in range(3)}
    first = make_sim(kv=kv_spec(url))
    for rid, t in tokens.items():
        first.add_request(rid, t, max_tokens=2)
    run_checked(first)  # checks every block's bytes after every step
    second = make_sim(kv=kv_spec(url))
    for rid, t in tokens.items():
        second.add_request(f"again-{rid}", t, max_tokens=2)
    run_checked(second)
    worker = second.workers[0].kv_connector.worker_side
    assert worker.loader.loaded >= 3 * 5  # 95 usable tokens: 5 one-block values per request, from the store
    assert sum(second.tokens_computed.values()) < sum(first.tokens_computed.values())
    assert leaks(first) == [] and leaks(second) == []


def test_master_dies_between_lookup_and_load_recomputes(
    private_master: MooncakeMaster, make_sim: Any
) -> None:
    master = private_master
    url = _url(master)
    extra = {"store_timeout": "1s", "lookup_timeout": "1s"}
    tokens = prompt(6, 96)
    first = make_sim(kv=kv_spec(url, **extra))
    first.add_request("a", tokens, max_tokens=2)
    run_checked(first)

    second = make_sim(kv=kv_spec(url, **extra), kv_load_failure_policy="recompute")
    worker = second.workers[0].kv_connector.worker_side
    original = worker.issue_loads

    def kill_then_issue(meta: Any) -> None:
        # The master dies between the lookup's answer and the loads: before they are issued (on a CPU
        # engine at bind time, before start_load_kv).
        if meta.loads and master.alive:
            master.kill()
        original(meta)

    worker.issue_loads = kill_then_issue  # type: ignore[method-assign]
    second.add_request("b", tokens, max_tokens=3)
    # Bounded, not quick: once Mooncake's client is reconnecting, a read holds the caller's buffer ~4 s
    # past our 1 s timeout (measured), and the request waits for its loads to let go (~2 ms per idle step).
    records = run_checked(second, max_steps=20_000)
    assert len(load_error_blocks(records)) == 5  # 95 usable tokens: 5 blocks planned, all failed
    assert second.tokens_computed["b"] == 96 + 2  # everything recomputed
    assert second.outputs["b"] == [7, 7, 7]
    assert worker.loader.failures  # counted as store errors
    assert leaks(second) == []
    # Back on the same ports before the engines close: a Mooncake client closing against a dead master
    # retries its unmount for ~8 s (measured), which would only slow this test's teardown down.
    master.start()
