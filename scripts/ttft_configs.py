"""TTFT of loaded prompts under several KV connector configs, side by side, in vLLM's real CPU engine (not
run by the tests).

Usage: ``.venv/bin/python scripts/ttft_configs.py [--rounds N] [--json] CONFIG...`` where each CONFIG is
``file`` (``file://`` in a new directory) or ``redis[:KEY=VALUE,...]`` (a loopback redis-server of the
script's own, one database per config; ``KEY=VALUE`` pairs go to the connector's ``extra_config`` when the
key is a setting (``kv_blocks_per_value=2``) and to the store URL's query otherwise (``chunk_size=4MiB``)).
Example: ``file redis redis:kv_blocks_per_value=2,chunk_size=4MiB``.

The prompts and model are ``asyncconn bench engine --what ttft``'s (``text-100m``, three 4,113-token
prompts). Each config's store is filled by an engine of its own first; then in each round, a fresh engine per
config (the order reversed every other round) times every prompt twice, the second time after
``reset_prefix_cache`` (both loads from the store). Reported: each round's median TTFT per config (ms), and
per config the median over rounds of its ratio to the first config's TTFT in the same round.

Why a script, not a bench: it compares knobs of one store against another on demand; the figures it gives are
in docs/benchmarks.md with the command that made them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncconn_tools.bench.engine_runs import long_prompt_engine, stored_prompts
from asyncconn_tools.engines import Probe, close_llm, engine_env, kv_config, make_llm
from asyncconn_tools.tiny_models import build_model

#: Settings that go to ``extra_config`` (the rest of a config's pairs go to the store URL's query).
_SETTINGS = ("kv_blocks_per_value", "max_inflight_loads", "host_cache_bytes")


def _config(spec: str, index: int, work: Path, redis_base: str | None) -> Any:
    kind, _, pairs = spec.partition(":")
    settings: dict[str, Any] = {}
    query: list[str] = []
    for pair in filter(None, pairs.split(",")):
        key, _, value = pair.partition("=")
        if key in _SETTINGS:
            settings[key] = int(value) if value.isdigit() else value
        else:
            query.append(f"{key}={value}")
    if kind == "file":
        url = f"file://{work / f'store-{index}'}"
    elif kind == "redis" and redis_base is not None:
        url = f"{redis_base}/{index}"
    else:
        raise SystemExit(f"unknown config {spec!r}: file or redis[:KEY=VALUE,...]")
    if query:
        url += "?" + "&".join(query)
    return kv_config(backend_url=url, **settings)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the figures
    engine_env()  # before vLLM is imported
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from vllm import SamplingParams

    model = build_model("text-100m", progress=lambda m: print(m, file=sys.stderr))
    texts = stored_prompts(4096, 3, seed=7)  # the prompts of ``bench engine --what ttft``
    engine_args = long_prompt_engine(4096)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    work = Path(tempfile.mkdtemp(prefix="asyncconn-configs-"))
    with contextlib.ExitStack() as stack:
        redis_base = None
        if any(spec.startswith("redis") for spec in args.configs):
            from asyncconn_tools.chaos.procs import RedisServer

            server = RedisServer(extra_args=("--maxmemory", "0", "--databases", "64")).start()
            stack.callback(server.stop)
            redis_base = server.url.rsplit("/", 1)[0]
        names = list(args.configs)
        configs = {name: _config(name, i, work, redis_base) for i, name in enumerate(names)}
        for config in configs.values():  # fill each store
            llm = make_llm(model, kv=config, **engine_args)
            for text in texts:
                llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
            Probe(llm).settle(timeout=300)
            close_llm(llm)
        per_round: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(args.rounds):
            for name in names if round_ % 2 == 0 else names[::-1]:
                llm = make_llm(model, kv=configs[name], **engine_args)
                probe = Probe(llm)
                samples = []
                for pass_ in range(2):
                    if pass_:
                        probe.settle(timeout=300)
                        llm.reset_prefix_cache()
                    for text in texts:
                        started = time.perf_counter()
                        llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
                        samples.append(time.perf_counter() - started)
                per_round[name].append(statistics.median(samples))
                probe.settle(timeout=300)
                close_llm(llm)
    first = per_round[names[0]]
    out = {
        "ttft_ms_per_round": {
            name: [round(v * 1e3, 1) for v in values] for name, values in per_round.items()
        },
        "median_ratio_to_first": {
            name: round(statistics.median(a / b for a, b in zip(values, first, strict=True)), 3)
            for name, values in per_round.items()
        },
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for name in names:
            print(f"{name}: ratio {out['median_ratio_to_first'][name]}, ms {out['ttft_ms_per_round'][name]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
