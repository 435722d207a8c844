"""Discard-on-abort as a property over real sockets: our ZMQ server, a store that answers late and out of
order (per-request delays), random interleavings of submit / poll / discard / re-submit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncconn.backend import Buffer, StorageBackend, Value
from asyncconn.lookup import PREFIX, LookupClient, LookupServer, ZmqTransport, store_key
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from asyncconn.url import Param, StoreURL
from tests.lookup.fakes import noop, wait_until

PRESENT = [f"p{j}".encode() for j in range(32)]


class DelayedBackend(StorageBackend):
    """``exists`` sleeps for the largest delay named by a ``...#d<ms>`` key, so later requests can finish
    first; the first 32 ``p<j>`` block hashes are present."""

    params: ClassVar[dict[str, Param]] = {}

    def __init__(self) -> None:
        self.present = {store_key("", k) for k in PRESENT}

    @classmethod
    async def from_url(cls, url: StoreURL) -> StorageBackend:
        return cls()

    async def exists(self, keys: Sequence[str]) -> list[bool]:
        delay = 0
        for k in keys:
            text = bytes.fromhex(k).decode(errors="replace")
            if "#d" in text:
                delay = max(delay, int(text.rsplit("#d", 1)[1]))
        await asyncio.sleep(delay / 1000)
        return [k in self.present for k in keys]

    async def put(self, items: Sequence[tuple[str, Value]]) -> None:
        raise NotImplementedError

    async def get(self, keys: Sequence[str]) -> list[Sequence[Buffer] | None]:
        raise NotImplementedError

    async def delete(self, keys: Sequence[str]) -> int:
        raise NotImplementedError

    async def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Runtime, LookupServer]]:
    rt = Runtime(name="lookup-property").start()

    async def start() -> LookupServer:
        server = LookupServer(TensorStore(DelayedBackend()), "tcp://127.0.0.1:*")
        await server.start()
        return server

    server = rt.run(start())
    try:
        yield rt, server
    finally:
        rt.run(server.close())
        rt.close()


RIDS = ["a", "b", "c"]
op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(RIDS), st.integers(0, 15)),  # store delay in ms
    st.tuples(st.just("poll"), st.sampled_from(RIDS), st.just(0)),
    st.tuples(st.just("discard"), st.sampled_from(RIDS), st.just(0)),
    st.tuples(st.just("step"), st.just(""), st.integers(0, 8)),  # a scheduler step: wait, poll every id
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(op, max_size=30))
def test_real_server_never_serves_a_stale_answer(
    served: tuple[Runtime, LookupServer], ops: list[tuple[str, str, int]]
) -> None:
    rt, server = served
    assert server.endpoint is not None
    client = LookupClient(ZmqTransport(server.endpoint), PREFIX, runtime=rt, timeout=5.0)
    gen = dict.fromkeys(RIDS, 0)
    outstanding = dict.fromkeys(RIDS, False)
    try:
        for name, rid, arg in ops:
            if name == "submit":
                if not outstanding[rid]:
                    gen[rid] += 1
                    outstanding[rid] = True
                # generation g: g present leading blocks, then one absent block that carries the delay
                g = gen[rid]
                client.submit(rid, [*PRESENT[:g], f"{rid}-{g}#d{arg}".encode()])
            elif name == "poll":
                got = client.poll(rid)
                if not outstanding[rid]:
                    assert got is None
                elif got is not None:
                    assert got == gen[rid]  # an older generation's answer would be smaller
                    outstanding[rid] = False
            elif name == "discard":
                assert client.discard(rid) is outstanding[rid]
                outstanding[rid] = False
            else:
                time.sleep(arg / 1000)
                for other in RIDS:
                    got = client.poll(other)
                    if got is not None:
                        assert outstanding[other] and got == gen[other]
                        outstanding[other] = False
        for rid in RIDS:
            client.discard(rid)
        rt.run(noop())  # the loop has taken every discard notice
        wait_until(lambda: client.held()["inflight"] == 0 and server.busy() == 0)
        assert client.held() == {"entries": 0, "queued": 0, "inflight": 0, "transport": 0}
        assert client.metrics.errors == 0 and client.metrics.timeouts == 0
    finally:
        client.close()
