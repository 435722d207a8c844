"""``asyncconn bench serve``'s own logic: which stores run, how each is configured, what its counters say.

The benchmark itself (OpenAI servers, LMCache's environment) is run by hand; these tests need neither:
the redis counters are read from a real redis-server, the LMCache server's command line and status are
checked as data.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import redis

from asyncconn_tools.bench import serve
from asyncconn_tools.bench.serve_stores import (
    STORES,
    _read_redis,
    asyncconn_kv_config,
    counter_deltas,
    lmcache_drained,
    lmcache_server_args,
    make_store,
    redis_counters,
)
from asyncconn_tools.chaos.procs import RedisServer


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_stores_run_in_a_fixed_order_and_lmcache_redis_is_one_of_them() -> None:
    args = _args("--stores", "lmcache-redis,redis,none", "--lmcache-venv", "/v")
    assert serve._stores_of(args) == ["none", "redis", "lmcache-redis"]
    assert "lmcache-redis" in STORES and "lmcache" in STORES
    assert serve._stores_of(_args()) == ["none", "file", "redis"]


@pytest.mark.parametrize("stores", ["lmcache", "lmcache-redis", "redis,lmcache-redis"])
def test_an_lmcache_store_without_its_venv_is_refused_before_anything_starts(stores: str) -> None:
    with pytest.raises(SystemExit, match="needs --lmcache-venv"):
        serve._stores_of(_args("--stores", stores))
    with pytest.raises(ValueError, match="needs --lmcache-venv"):
        last = stores.rsplit(",", maxsplit=1)[-1]
        make_store(last, work=Path("/w"), logs=Path("/l"), key_prefix="t-", lmcache_venv=None)


def test_an_unknown_store_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _args("--stores", "redis,lmcache-valkey")
    assert "lmcache-valkey" in capsys.readouterr().err


def test_the_help_names_every_store() -> None:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    text = " ".join(parser.format_help().split())
    for name in STORES:
        assert name in text
    assert "lmcache-redis: LMCache over a redis-server" in text


def test_lmcache_redis_server_gets_a_resp_l2_adapter_on_its_own_redis() -> None:
    args = lmcache_server_args(Path("/venv"), 5555, 5556, redis_port=6390)
    assert args[:2] == ["/venv/bin/lmcache", "server"]
    assert args[args.index("--port") + 1] == "5555" and args[args.index("--http-port") + 1] == "5556"
    adapter = json.loads(args[args.index("--l2-adapter") + 1])
    assert adapter == {"type": "resp", "host": "127.0.0.1", "port": 6390}
    # The L1-only store (``lmcache``) has no L2 at all.
    assert "--l2-adapter" not in lmcache_server_args(Path("/venv"), 5555, 5556)


def test_an_lmcache_server_is_drained_only_with_nothing_pending_or_in_flight() -> None:
    def status(pending: int, in_flight: int) -> dict[str, object]:
        controller = {"pending_keys_count": pending, "in_flight_task_count": in_flight}
        return {"storage_manager": {"store_controllers": {"_default": controller}}}

    assert lmcache_drained(status(0, 0))
    assert not lmcache_drained(status(3, 0)) and not lmcache_drained(status(0, 1))
    # The single-L1 form of the status, and a status that says nothing, which must not count as drained.
    single = {"pending_keys_count": 0, "in_flight_task_count": 0}
    assert lmcache_drained({"storage_manager": {"store_controller": single}})
    assert not lmcache_drained({})


def test_asyncconn_stores_change_only_the_url_and_key_prefix_of_the_example() -> None:
    config = asyncconn_kv_config("redis://127.0.0.1:1/0", "serve-1-")
    example = json.loads(
        (Path(__file__).resolve().parents[2] / "examples" / "vllm_kv_offload.json").read_text()
    )
    extra = config.pop("kv_connector_extra_config")
    example_extra = example.pop("kv_connector_extra_config")
    assert config == example
    assert extra == {**example_extra, "backend_url": "redis://127.0.0.1:1/0", "key_prefix": "serve-1-"}


def test_counter_deltas_keep_only_what_moved() -> None:
    before = {"a": 1.0, "b": 2.0}
    after = {"a": 1.0, "b": 5.0, "c": 4.0}
    assert counter_deltas(before, after) == {"b": 3.0, "c": 4.0}


def test_redis_counters_show_the_bytes_and_gets_of_a_read(fresh_redis: RedisServer) -> None:
    """The counters the benchmark reads around a run move by what a client really reads."""
    client = redis.Redis.from_url(fresh_redis.url)
    try:
        client.set("k", b"x" * (1 << 20))
        before = _read_redis(fresh_redis.url)
        assert client.get("k") == b"x" * (1 << 20)
        after = _read_redis(fresh_redis.url)
    finally:
        client.close()
    moved = counter_deltas(before, after)
    assert before["redis.keys"] == 1
    assert moved["redis.total_net_output_bytes"] >= 1 << 20
    assert moved["redis.keyspace_hits"] == 1 and moved["redis.calls.get"] == 1
    # Nothing else moved: not the keys, not the counters' own INFO/DBSIZE (memory may shift by buffers).
    assert set(moved) - {"redis.used_memory"} == {
        "redis.total_net_input_bytes",
        "redis.total_net_output_bytes",
        "redis.keyspace_hits",
        "redis.calls.get",
    }


def test_redis_counters_parse_commandstats_and_ignore_other_fields() -> None:
    info = {
        "total_net_output_bytes": 10,
        "keyspace_hits": 2,
        "used_memory": 7,
        "cmdstat_mget": {"calls": 3},
        "cmdstat_info": {"calls": 5},
        "cmdstats_note": "x",
    }
    counters = redis_counters(info, keys=4)
    assert counters["redis.total_net_output_bytes"] == 10 and counters["redis.calls.mget"] == 3
    assert counters["redis.keys"] == 4 and counters["redis.total_net_input_bytes"] == 0
    # The benchmark's own INFO is not counted as the store's traffic.
    assert not any(name.startswith("redis.calls.info") or "note" in name for name in counters)


def test_checks_want_redis_bytes_out_and_an_empty_l1_for_lmcache_redis() -> None:
    def row(store: str, phase: int, start: dict[str, float], during: dict[str, float]) -> dict[str, object]:
        return {
            "store": store,
            "phase": phase,
            "failed": 0,
            "external_hit_tokens": 256,
            "store_at_start": start,
            "store_during_run": during,
        }

    good = {
        "a": row("redis", 2, {"redis.keys": 9}, {"redis.total_net_output_bytes": 100}),
        "b": row(
            "lmcache-redis",
            2,
            {"redis.keys": 9, "lmcache.l1_objects": 0},
            {"redis.total_net_output_bytes": 5},
        ),
        "c": row("lmcache", 2, {"lmcache.l1_objects": 16}, {}),
    }
    assert all(serve._checks(good).values())
    unread = {**good, "b": row("lmcache-redis", 2, {"redis.keys": 9, "lmcache.l1_objects": 0}, {})}
    assert not serve._checks(unread)["every server 2 on redis read from redis"]
    warm = {**good, "b": row("lmcache-redis", 2, {"redis.keys": 9, "lmcache.l1_objects": 3}, {"x": 1})}
    assert not serve._checks(warm)["LMCache's redis server 2 started with an empty L1"]
