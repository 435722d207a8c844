"""The remote store and the host-memory tier in vLLM's real engine: a second engine's time to first token.

On long prompts a first engine computed and saved, fresh engines in alternating rounds (one config after
another within a round, so a round's ratios compare engines timed seconds apart):

- ``file://`` (the page-cached local store: the reference);
- ``redis://`` cold: every load from a loopback redis-server;
- ``redis://`` with the host tier: the same engine times its prompts twice. The first pass loads from
  redis and fills the tier; after ``reset_prefix_cache`` (vLLM's own cache emptied) the second pass is
  served by the tier (warm). Its hits are counted, so a warm figure that the store served fails the bench.
- ``redis://`` behind a local ``file://`` store (``local_store_url``, an empty directory each round): the
  same two passes, the first filling the local store, the second served by it (its hits counted alike).

Memory: the tier's bytes after every request against its bound, and the process's peak RSS while each
engine ran (``VmHWM``, reset through ``/proc/self/clear_refs`` before each engine), with and without the
tier. Decode throughput with the tier attached against no connector is :func:`tier_decode_bench`.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from asyncconn_tools.bench.engine_runs import (
    _fill_stores,
    _redis_url,
    decode_bench,
    long_prompt_engine,
    stored_prompts,
)
from asyncconn_tools.engines import Probe, close_llm, kv_config, make_llm

__all__ = ["tier_decode_bench", "tiers_bench"]

_FILE, _COLD, _TIER_COLD, _WARM, _LOCAL_COLD, _LOCAL_WARM = (
    "file://",
    "redis:// cold",
    "redis:// + host tier, first pass (cold)",
    "redis:// + host tier, warm",
    "redis:// + local file://, first pass (cold)",
    "redis:// + local file://, warm",
)


def _say(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _source_tokens(llm: Any, source: str) -> int:
    """``vllm:prompt_tokens_cached_by_source{source=...}`` so far."""
    return int(
        sum(
            getattr(m, "value", 0)
            for m in llm.get_metrics()
            if m.name == "vllm:prompt_tokens_cached_by_source" and m.labels.get("source") == source
        )
    )


def tiers_bench(
    tokens: int = 4096, prompts: int = 3, rounds: int = 3, host_cache_bytes: int = 512 << 20
) -> dict[str, Any]:
    """TTFT of a fresh engine over ``file://``, cold ``redis://`` and ``redis://`` with a warm host tier."""
    from vllm import SamplingParams

    from asyncconn_tools.tiny_models import build_model

    model = build_model("text-100m", progress=_say)
    texts = stored_prompts(tokens, prompts, seed=7)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    engine_args = long_prompt_engine(tokens)
    workdir = Path(tempfile.mkdtemp(prefix="asyncconn-bench-tiers-"))
    names = (_FILE, _COLD, _TIER_COLD, _WARM, _LOCAL_COLD, _LOCAL_WARM)
    samples: dict[str, list[float]] = {name: [] for name in names}
    per_round: dict[str, list[float]] = {name: [] for name in samples}
    peak_rss: dict[str, list[float]] = {"no tier (redis:// cold)": [], "host tier": []}
    tier_peak = 0
    tier_hits = 0
    expected_hits = 0
    local_hits = 0
    local_expected = 0
    host_counted = 0  # warm-pass tokens vLLM's prompt_tokens_cached_by_source put under "host"
    disk_counted = 0  # local-store warm-pass tokens it put under "disk"
    local_dirs = iter(range(1 << 20))

    def run(make: Callable[[], Any], passes: list[str], tiered: bool) -> None:
        nonlocal tier_peak, tier_hits, expected_hits, local_hits, local_expected, host_counted, disk_counted
        _reset_peak_rss()
        llm = make_llm(model, kv=make(), **engine_args)
        probe = Probe(llm)
        store = probe.kv_worker_connector().worker_side.store
        tier = store.host_tier if tiered else None
        layered = store.layered
        try:
            this_run: dict[str, list[float]] = {}
            for index, name in enumerate(passes):
                if index:
                    probe.settle(timeout=300)
                    if not llm.reset_prefix_cache():
                        raise RuntimeError("vLLM refused to reset its prefix cache (requests still running)")
                hits_before = tier.stats.hits if tier is not None else 0
                host_before, disk_before = _source_tokens(llm, "host"), _source_tokens(llm, "disk")
                local_before = layered.stats.local_hits if layered is not None else 0
                timed = []
                for text in texts:
                    started = time.perf_counter()
                    llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
                    timed.append(time.perf_counter() - started)
                    if tier is not None:
                        tier_peak = max(tier_peak, tier.lru.used)
                samples[name].extend(timed)
                this_run.setdefault(name, []).extend(timed)
                if tier is not None and name == _WARM:
                    tier_hits += tier.stats.hits - hits_before
                    host_counted += _source_tokens(llm, "host") - host_before
                    expected_hits += len(texts) * (tokens // 32)
                if layered is not None and name == _LOCAL_WARM:
                    local_hits += layered.stats.local_hits - local_before
                    disk_counted += _source_tokens(llm, "disk") - disk_before
                    local_expected += len(texts) * (tokens // 32)
                _say(f"{name}: TTFT {[round(x, 3) for x in timed]} s")
            probe.settle(timeout=300)
            loaded = probe.metrics().get("vllm:external_prefix_cache_hits", 0)
            wanted = len(passes) * len(texts) * (tokens // 32) * 32
            if loaded < wanted:  # a figure of recomputed prompts would not be a load's
                raise RuntimeError(f"{passes[0]}: {loaded} of {wanted} prompt tokens came from the connector")
            for name, timed in this_run.items():
                per_round[name].append(statistics.median(timed))
        finally:
            close_llm(llm)
        if passes[0] in (_COLD, _TIER_COLD):
            peak_rss["host tier" if tiered else "no tier (redis:// cold)"].append(_peak_rss_mib())

    with _redis_url() as redis_url:
        configs: dict[str, tuple[Callable[[], Any], list[str], bool]] = {
            _FILE: (lambda: kv_config(backend_url=f"file://{workdir / 'store'}"), [_FILE, _FILE], False),
            _COLD: (lambda: kv_config(backend_url=redis_url), [_COLD], False),
            _WARM: (
                lambda: kv_config(backend_url=redis_url, host_cache_bytes=host_cache_bytes),
                [_TIER_COLD, _WARM],
                True,
            ),
            _LOCAL_WARM: (
                lambda: kv_config(
                    backend_url=redis_url, local_store_url=f"file://{workdir / f'local-{next(local_dirs)}'}"
                ),
                [_LOCAL_COLD, _LOCAL_WARM],
                False,
            ),
        }
        _fill_stores(model, {_FILE: configs[_FILE][0], _COLD: configs[_COLD][0]}, texts, engine_args)
        for round_ in range(rounds):
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                run(*configs[name])
    file_rounds = per_round[_FILE]
    figures: dict[str, Any] = {"prompt tokens": tokens + 17, "host_cache_bytes": host_cache_bytes}
    for name, values in samples.items():
        figures[f"{name}: TTFT median s"] = round(statistics.median(values), 4)
    for name in (_COLD, _TIER_COLD, _WARM, _LOCAL_COLD, _LOCAL_WARM):
        ratios = [r / f for r, f in zip(per_round[name], file_rounds, strict=True)]
        figures[f"{name} / file://, per round"] = [round(r, 3) for r in ratios]
        figures[f"{name} / file:// (median of the rounds)"] = round(statistics.median(ratios), 3)
    figures["warm passes: values served by the tier / values loaded"] = f"{tier_hits} / {expected_hits}"
    figures["warm passes: values served by the local store / values loaded"] = (
        f"{local_hits} / {local_expected}"
    )
    figures["warm passes: tokens vLLM counted as source=host / tokens loaded"] = (
        f"{host_counted} / {expected_hits * 32}"
    )
    figures["warm passes: tokens vLLM counted as source=disk (local store) / tokens loaded"] = (
        f"{disk_counted} / {local_expected * 32}"
    )
    figures["host tier bytes, most seen / bound"] = f"{tier_peak} / {host_cache_bytes}"
    for name, values in peak_rss.items():
        figures[f"peak RSS MiB while the engine ran, {name}"] = [round(v) for v in values]
    if expected_hits and tier_hits < expected_hits:
        _say(f"only {tier_hits} of {expected_hits} warm values came from the tier")
    if local_expected and local_hits < local_expected:
        _say(f"only {local_hits} of {local_expected} warm values came from the local store")
    title = f"TTFT over redis:// and the host tier on {tokens}-token prompts (text-100m, {rounds} rounds)"
    return {"title": title, "figures": figures}


def tier_decode_bench(rounds: int = 3, host_cache_bytes: int = 512 << 20) -> dict[str, Any]:
    """Decode tokens/s with the KV connector and its host tier attached (``redis://``, nothing to load)
    against no connector, and against the same connector without the tier, on ``text-100m``."""
    with _redis_url() as redis_url:
        return decode_bench(
            model_name="text-100m",
            rounds=rounds,
            kv_extra={"backend_url": redis_url, "host_cache_bytes": host_cache_bytes},
            label="asyncconn kv_both (redis://, host tier)",
            also=("asyncconn kv_both (redis://, no tier)", {"backend_url": redis_url}),
        )
