"""Figures from vLLM's real engine: time to first token on a shared prefix, decode throughput, EC per request.

Every comparison is measured side by side in one process run, on the same model and prompts:

- ``ttft``: a second engine's time to first token on long prompts whose KV a first engine computed --
  recomputed (no connector), loaded by asyncconn over ``file://`` (default 1 block per value, and 4) and
  ``redis://``, and loaded by vLLM's in-tree ``ExampleConnector``, in alternating rounds of fresh engines;
  the comparison with ``ExampleConnector`` is the median of the per-round ratios. The copy limit is the
  prompt's KV bytes over this machine's measured memcpy bandwidth: what a load could not beat.
- ``decode``: decode tokens per second with the KV connector attached (``kv_both``, fresh prompts so
  nothing loads) and without, in alternating rounds.
- ``ec``: PD's time per image request with embeddings loaded from the store vs encoded locally.
- ``stall``: what a long prompt's load costs the requests already decoding on the engine: the step times
  they see from the prompt's arrival to its first token, asyncconn over ``file://`` against
  ``ExampleConnector`` (which loads inside the step that schedules the prompt), in alternating rounds.

Each figure is a median over the samples; the machine, command and date go with it into docs/benchmarks.md.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from asyncconn_tools.engines import Probe, close_llm, kv_config, make_llm

__all__ = [
    "decode_bench",
    "ec_bench",
    "long_prompt_engine",
    "memcpy_gbps",
    "stall_bench",
    "stored_prompts",
    "ttft_bench",
]


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def memcpy_gbps(nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """Median host memcpy bandwidth (GB/s) of one ``copy_`` of ``nbytes``: the floor for any KV load here."""
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times) / 1e9


@contextlib.contextmanager
def _redis_url() -> Iterator[str]:
    from asyncconn_tools.chaos.procs import RedisServer

    server = RedisServer(extra_args=("--maxmemory", "0")).start()
    try:
        yield server.url
    finally:
        server.stop()


def stored_prompts(tokens: int, prompts: int, seed: int) -> list[list[int]]:
    """``prompts`` random prompts of ``tokens + 17`` tokens (a 17-token tail past the last full block)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 8000) for _ in range(tokens + 17)] for _ in range(prompts)]


def long_prompt_engine(tokens: int, seqs: int = 1) -> dict[str, Any]:
    """Engine arguments for prompts of about ``tokens``, each prefilled in one step, ``seqs`` at a time."""
    return {
        "kv_cache_bytes": 2 << 30,
        "max_model_len": tokens + 64,
        "max_num_batched_tokens": tokens + 64,
        "max_num_seqs": seqs,
    }


def _kv_bytes_per_token(probe: Probe) -> int:
    total = 0
    for cache in probe.kv_caches().values():
        # CPU layout [blocks, kv_heads, block, 2*head]: one token is kv_heads * 2*head elements per layer
        total += cache[0].numel() // cache.shape[2] * cache.element_size()
    return total


def ttft_bench(
    tokens: int = 4096, prompts: int = 3, model_name: str = "text-100m", rounds: int = 3
) -> dict[str, Any]:
    """Time to first token of a fresh engine on prompts another engine computed (see the module doc).

    Each config's store is filled once by an engine that computes the prompts. Then, in each of
    ``rounds`` rounds, every loading config gets a fresh engine (in alternating order), timed on the
    prompts twice: as it comes, and again after ``reset_prefix_cache`` (so the prompts come from the store
    again). Why rounds of fresh engines side by side: this VM drifts by more than the differences measured
    here within minutes, so one config's run after another's compares two moments, not two connectors; a
    per-round ratio compares engines timed a few seconds apart. Recompute is timed once (it is ~50x away).
    """
    from vllm import SamplingParams

    from asyncconn_tools.tiny_models import build_model

    model = build_model(model_name, progress=_say)
    texts = stored_prompts(tokens, prompts, seed=7)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine_args = long_prompt_engine(tokens)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-"))
    per_token = 0

    def timed(make: Callable[[], Any] | None, passes: int) -> list[float]:
        nonlocal per_token
        llm = make_llm(model, kv=None if make is None else make(), **engine_args)
        probe = Probe(llm)
        per_token = per_token or _kv_bytes_per_token(probe)
        samples = []
        for pass_ in range(passes):
            if pass_:
                probe.settle(timeout=300)
                if not llm.reset_prefix_cache():
                    raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
            for text in texts:
                started = time.perf_counter()
                llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
                samples.append(time.perf_counter() - started)
        probe.settle(timeout=300)
        hits = probe.metrics().get("vllm:external_prefix_cache_hits", 0)
        if make is not None and hits < passes * prompts * (tokens // 32) * 32 * 0.99:
            _say(f"only {hits} tokens came from the store")
        close_llm(llm)
        return samples

    example_name = "vLLM ExampleConnector"
    with _redis_url() as redis_url:
        loaders: dict[str, Callable[[], Any]] = {
            "asyncconn file://": lambda: kv_config(backend_url=f"file://{workdir / 'store'}"),
            "asyncconn file://, 4 blocks per value": lambda: kv_config(
                backend_url=f"file://{workdir / 'store-4'}", kv_blocks_per_value=4
            ),
            _SYNC_LOADS: lambda: kv_config(backend_url=f"file://{workdir / 'store'}", kv_sync_loads=True),
            "asyncconn redis://": lambda: kv_config(backend_url=redis_url),
            example_name: lambda: _example_connector(workdir / "example"),
        }
        _fill_stores(model, _store_owners(loaders), texts, engine_args)
        _say("recompute (no connector): a fresh engine's time to first token")
        results: dict[str, list[float]] = {"recompute (no connector)": timed(None, 1)}
        per_round: dict[str, list[float]] = {name: [] for name in loaders}
        for round_ in range(rounds):
            order = list(loaders) if round_ % 2 == 0 else list(reversed(loaders))
            for name in order:
                samples = timed(loaders[name], 2)
                _say(f"round {round_ + 1}, {name}: TTFT samples {[round(x, 3) for x in samples]} s")
                results.setdefault(name, []).extend(samples)
                per_round[name].append(statistics.median(samples))
    bandwidth = memcpy_gbps()
    kv_bytes = per_token * (tokens // 32) * 32
    copy_limit = kv_bytes / (bandwidth * 1e9)
    recompute = statistics.median(results["recompute (no connector)"])
    figures: dict[str, Any] = {
        "prompt tokens": tokens + 17,
        "KV bytes per prompt": kv_bytes,
        "memcpy GB/s (median of 5, 256 MiB)": round(bandwidth, 2),
        "copy limit (KV bytes / memcpy) s": round(copy_limit, 4),
    }
    for name, samples in results.items():
        median = statistics.median(samples)
        figures[f"{name}: TTFT median s"] = round(median, 3)
        figures[f"{name}: speed-up vs recompute"] = round(recompute / median, 1)
        figures[f"{name}: x copy limit"] = round(median / copy_limit, 1)
    for name, medians in per_round.items():
        if name == example_name:
            continue
        ratios = [e / ours for e, ours in zip(per_round[example_name], medians, strict=True)]
        figures[f"{name}: vs ExampleConnector per round (its TTFT / ours)"] = [round(r, 3) for r in ratios]
        figures[f"{name}: vs ExampleConnector (median of the rounds)"] = round(statistics.median(ratios), 3)
    title = f"TTFT on {tokens}-token prompts another engine computed ({model_name}, {rounds} rounds)"
    return {"title": title, "figures": figures}


def stall_bench(
    tokens: int = 4096, prompts: int = 3, decoders: int = 4, rounds: int = 3, model_name: str = "text-100m"
) -> dict[str, Any]:
    """The steps that requests already decoding see while a long stored prompt arrives and loads.

    Why: a connector that loads inside the step that schedules the prompt (``ExampleConnector``) adds the
    whole load to one step of every running request -- an inter-token stall -- where asyncconn loads on its
    own threads while the engine keeps stepping. Each engine runs ``decoders`` requests decoding; then the
    ``prompts`` long prompts (stored by another engine) arrive one at a time, each after ``_LEAD`` decode
    steps that give that prompt's baseline step time. Per prompt: the longest step between its arrival and
    its first token, the time those steps took beyond the baseline, and its time to first token. Configs
    alternate in each round on fresh engines; the comparison is the median of the per-round ratios.
    """
    from vllm import SamplingParams

    from asyncconn_tools.tiny_models import build_model

    model = build_model(model_name, progress=_say)
    rng = random.Random(11)  # the decoders' prompts follow on from the same generator
    long_prompts = [[rng.randrange(5, 8000) for _ in range(tokens + 17)] for _ in range(prompts)]
    one = SamplingParams(max_tokens=1, temperature=0.0)
    endless = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    engine_args = long_prompt_engine(tokens, seqs=decoders + 1)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-"))
    example_name = "vLLM ExampleConnector"
    configs: dict[str, Callable[[], Any]] = {
        "asyncconn file://": lambda: kv_config(backend_url=f"file://{workdir / 'store'}"),
        _SYNC_LOADS: lambda: kv_config(backend_url=f"file://{workdir / 'store'}", kv_sync_loads=True),
        example_name: lambda: _example_connector(workdir / "example"),
    }
    _fill_stores(model, _store_owners(configs), long_prompts, engine_args)

    def measured(make: Callable[[], Any]) -> list[dict[str, float]]:
        llm = make_llm(model, kv=make(), **engine_args)
        engine = llm.llm_engine
        try:
            running = [f"decode-{i}" for i in range(decoders)]
            for rid in running:
                prompt = [rng.randrange(5, 8000) for _ in range(64)]
                engine.add_request(rid, {"prompt_token_ids": prompt}, endless)
            for _ in range(2 * _LEAD):  # all admitted, prefilled and decoding
                engine.step()
            samples = []
            for index, prompt in enumerate(long_prompts):
                lead = []
                for _ in range(_LEAD):
                    started = time.perf_counter()
                    engine.step()
                    lead.append(time.perf_counter() - started)
                arrived = time.perf_counter()
                engine.add_request(f"long-{index}", {"prompt_token_ids": prompt}, one)
                window: list[float] = []
                while True:
                    started = time.perf_counter()
                    outputs = engine.step()
                    window.append(time.perf_counter() - started)
                    if any(o.request_id == f"long-{index}" and o.finished for o in outputs):
                        break
                    if time.perf_counter() - arrived > 120:
                        raise RuntimeError(f"long prompt {index} did not finish within 120 s")
                base = statistics.median(lead)
                samples.append(
                    {
                        "base": base,
                        "longest": max(window),
                        "excess": sum(window) - base * len(window),
                        "ttft": time.perf_counter() - arrived,
                    }
                )
            engine.abort_request(running)
            Probe(llm).settle(timeout=300)
            return samples
        finally:
            close_llm(llm)

    results: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    per_round: dict[str, dict[str, list[float]]] = {"longest": {}, "ttft": {}}
    for round_ in range(rounds):
        order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
        for name in order:
            samples = measured(configs[name])
            longest = [round(x["longest"] * 1e3, 1) for x in samples]
            _say(f"round {round_ + 1}, {name}: longest step per prompt {longest} ms")
            results[name].extend(samples)
            for field, medians in per_round.items():
                medians.setdefault(name, []).append(statistics.median(x[field] for x in samples))
    figures: dict[str, Any] = {}
    for name, samples in results.items():
        for field, label in (
            ("base", "decode step before the prompt, median ms"),
            ("longest", "longest step, arrival to first token, median ms"),
            ("excess", "step time beyond the decode step, arrival to first token, median ms"),
            ("ttft", "the long prompt's TTFT, median ms"),
        ):
            figures[f"{name}: {label}"] = round(statistics.median(x[field] for x in samples) * 1e3, 1)
    for field, label in (("longest", "longest step"), ("ttft", "TTFT")):
        medians = per_round[field]
        for name in configs:
            if name == example_name:
                continue
            ratios = [e / o for e, o in zip(medians[example_name], medians[name], strict=True)]
            figures[f"{name}: ExampleConnector's {label} / ours, per round"] = [round(r, 3) for r in ratios]
            figures[f"{name}: ExampleConnector's {label} / ours (median of the rounds)"] = round(
                statistics.median(ratios), 3
            )
    title = (
        f"steps of {decoders} decoding requests while a {tokens}-token stored prompt loads "
        f"({model_name}, {prompts} prompts per engine, {rounds} rounds)"
    )
    return {"title": title, "figures": figures}


#: Decode steps timed before each long prompt arrives (its baseline).
_LEAD = 8


#: asyncconn over ``file://`` with ``kv_sync_loads``: it reads the store of plain ``asyncconn file://``.
_SYNC_LOADS = "asyncconn file://, sync loads"
#: Configs that load from another config's store (the same URL): filled once, by that one.
_SHARED_STORE = frozenset({_SYNC_LOADS})


def _store_owners(configs: dict[str, Callable[[], Any]]) -> dict[str, Callable[[], Any]]:
    """The configs whose store ``_fill_stores`` fills (see ``_SHARED_STORE``)."""
    return {name: make for name, make in configs.items() if name not in _SHARED_STORE}


def _fill_stores(
    model: Path, configs: dict[str, Callable[[], Any]], prompts: list[list[int]], engine_args: dict[str, Any]
) -> None:
    """Per config, an engine computes ``prompts`` and saves them through its connector, then closes."""
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    for name, make in configs.items():
        _say(f"{name}: engine 1 computes and saves {len(prompts)} prompts of {len(prompts[0])} tokens")
        llm = make_llm(model, kv=make(), **engine_args)
        for prompt in prompts:  # one at a time: ExampleConnector mis-saves chunked prefills
            llm.generate([{"prompt_token_ids": prompt}], one, use_tqdm=False)
        Probe(llm).settle(timeout=300)
        close_llm(llm)


def _example_connector(path: Path) -> Any:
    from vllm.config import KVTransferConfig

    return KVTransferConfig(
        kv_connector="ExampleConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"shared_storage_path": str(path)},
    )


def decode_bench(
    model_name: str = "text",
    rounds: int = 3,
    requests: int = 8,
    max_tokens: int = 128,
    batches: int = 5,
    *,
    kv_extra: dict[str, Any] | None = None,
    label: str = "asyncconn kv_both (file://)",
    also: tuple[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Decode tokens/s with the KV connector attached (nothing to load) vs without, alternating rounds.

    ``kv_extra``: the connector's ``extra_config`` (default: a fresh ``file://`` store), named ``label``.
    ``also``: a third engine in every round, ``(its label, its extra_config)``, and the ratio of ``label``'s
    rate to its own, per round (e.g. the same store without a host tier: what the tier itself costs).

    Each engine is timed on ``batches`` batches of fresh prompts (its median is its rate), and the ratio is
    the median of the per-round ratios: the two engines of a round run back to back, so a box whose speed
    drifts between rounds (a shared VM's does, by 30%) moves both sides of a round's ratio alike.
    """
    from vllm import SamplingParams

    from asyncconn_tools.tiny_models import build_model

    model = build_model(model_name, progress=_say)
    vocab = 8000 if model_name == "text-100m" else 1000
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-"))
    without, with_kv = "no connector", label
    extra = kv_extra if kv_extra is not None else {"backend_url": f"file://{workdir / 'store'}"}
    rates: dict[str, list[float]] = {without: [], with_kv: []}
    extras: dict[str, dict[str, Any]] = {with_kv: extra}
    if also is not None:
        rates[also[0]] = []
        extras[also[0]] = also[1]
    rng = random.Random(3)
    # One in-process engine at a time (closing one tears down vLLM's process groups): each round builds
    # both engines afresh, in alternating order.
    for round_no in range(rounds):
        names = list(rates) if round_no % 2 == 0 else list(reversed(rates))
        for name in names:
            kv = None if name == without else kv_config(**extras[name])
            llm = make_llm(model, kv=kv, max_num_seqs=requests)
            try:
                warm = [[rng.randrange(5, vocab) for _ in range(64)]]
                llm.generate([{"prompt_token_ids": p} for p in warm], sampling, use_tqdm=False)
                samples = []
                for _ in range(batches):
                    prompts = [[rng.randrange(5, vocab) for _ in range(64)] for _ in range(requests)]
                    started = time.perf_counter()
                    outputs = llm.generate(
                        [{"prompt_token_ids": p} for p in prompts], sampling, use_tqdm=False
                    )
                    elapsed = time.perf_counter() - started
                    samples.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
                rates[name].append(statistics.median(samples))
                Probe(llm).settle()
            finally:
                close_llm(llm)
    ratios = [w / b for w, b in zip(rates[with_kv], rates[without], strict=True)]
    figures: dict[str, Any] = {}
    for name, values in rates.items():
        figures[f"{name}: tokens/s median"] = round(statistics.median(values), 1)
    figures["with connector / without, per round"] = [round(r, 3) for r in ratios]
    figures["with connector / without"] = round(statistics.median(ratios), 3)
    if also is not None:
        versus = [w / b for w, b in zip(rates[with_kv], rates[also[0]], strict=True)]
        figures[f"{with_kv} / {also[0]}, per round"] = [round(r, 3) for r in versus]
        figures[f"{with_kv} / {also[0]}"] = round(statistics.median(versus), 3)
    return {
        "title": (
            f"decode throughput, {requests} requests x {max_tokens} tokens ({model_name}), "
            f"{batches} batches per engine, {rounds} rounds"
        ),
        "figures": figures,
    }


def ec_bench(images: int = 8, rounds: int = 3) -> dict[str, Any]:
    """PD's time per image request with stored embeddings vs encoding locally (tiny vision model)."""
    import numpy as np
    from PIL import Image
    from vllm import SamplingParams

    from asyncconn_tools.engines import ec_config, ec_params, forward_ec_params
    from asyncconn_tools.tiny_models import IMAGE_SIZE, build_model

    model = build_model("vision", progress=_say)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-"))
    url = f"file://{workdir / 'store'}"
    sampling = {"max_tokens": 1, "temperature": 0.0}
    local: list[float] = []
    loaded: list[float] = []
    loaded_items: list[int] = []
    rng = np.random.default_rng(5)
    for _ in range(rounds):
        batch = [
            {
                "prompt": "w10 w11",
                "multi_modal_data": {
                    "image": Image.fromarray(
                        rng.integers(0, 255, (IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
                    )
                },
            }
            for _ in range(images)
        ]
        e = make_llm(model, ec=ec_config("ec_producer", backend_url=url), max_model_len=512)
        params = ec_params(e.generate(batch, SamplingParams(**sampling), use_tqdm=False))
        Probe(e).ec_saves_done()
        close_llm(e)
        for name, into in (("local", local), ("loaded", loaded)):
            ec = ec_config("ec_consumer", backend_url=url) if name == "loaded" else None
            pd = make_llm(model, ec=ec, max_model_len=512)
            try:
                # All requests at once: on vLLM's V1 runner an idle PD encodes the first request it sees
                # (docs/ec.md), the rest are loaded; counted below.
                sampling_list = [forward_ec_params(p, **sampling) for p in params]
                started = time.perf_counter()
                pd.generate(batch, sampling_list, use_tqdm=False)
                into.append((time.perf_counter() - started) / images)
                if ec is not None:
                    loader = Probe(pd).ec_worker_connector().worker_side.loader
                    loaded_items.append(loader.loaded)
            finally:
                close_llm(pd)
    return {
        "title": f"EC: PD time per image request (tiny BLIP-2, {images} requests at once)",
        "figures": {
            "encoded locally: ms per request (median)": round(1000 * statistics.median(local), 2),
            "from the store (file://): ms per request (median)": round(1000 * statistics.median(loaded), 2),
            "images loaded per round (the rest encoded)": min(loaded_items),
        },
    }
