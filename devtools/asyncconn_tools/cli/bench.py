"""``asyncconn bench <what>``: every benchmark, one module each under :mod:`asyncconn_tools.bench`.

A group: :mod:`asyncconn.cli.main` reads :data:`COMMANDS` as it reads its own table, so only the benchmark
being run is imported (``asyncconn bench --help`` imports none). Each module exposes
``add_arguments(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

__all__ = ["COMMANDS"]

#: name -> (module, help), in the order ``asyncconn bench --help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "backend": ("asyncconn_tools.bench.backend", "put/get/exists throughput and latency of a store"),
    "lookup": ("asyncconn_tools.bench.lookup", "lookup client cost on the caller's thread and throughput"),
    "transfer": ("asyncconn_tools.bench.transfer", "stream loader and save tracker figures"),
    "align": (
        "asyncconn_tools.bench.align",
        "direct reads by payload alignment: why frames pad to 64 bytes",
    ),
    "engine": (
        "asyncconn_tools.bench.engine",
        "vLLM's real engine: TTFT on a shared prefix vs recompute, decode with/without, EC per request",
    ),
    "gpu": ("asyncconn_tools.bench.gpu", "KV load/save and EC install through the worker sides, on CUDA"),
    "kv": (
        "asyncconn_tools.bench.kv",
        "KV connector: schedule() with lookups, wait_for_save, blocks per value",
    ),
    "ec-sim": (
        "asyncconn_tools.bench.ec_sim",
        "EC connector: ensure_cache_available / has_cache_item and PD step costs (offline engine)",
    ),
    "redis": (
        "asyncconn_tools.bench.redis",
        "redis:// side by side with redis-benchmark; eviction hit rate",
    ),
    "mooncake": (
        "asyncconn_tools.bench.mooncake",
        "mooncake:// side by side with the raw Mooncake client",
    ),
    "serve": (
        "asyncconn_tools.bench.serve",
        "two OpenAI servers sharing a store (one saves, a fresh one loads): TTFT/ITL by vLLM's client",
    ),
}
