"""Where a loaded prompt's time to first token goes, in vLLM's real CPU engine (not run by the tests).

Usage: ``.venv/bin/python scripts/ttft_phases.py [--rounds N] [--tokens N] [--redis] [--json]`` (defaults: 3
rounds, 4096 tokens). The same model, prompts and store fill as ``asyncconn bench engine --what ttft``
(``--redis``: ``redis://`` on a loopback redis-server of its own beside ``file://``, the others left out);
in each round a fresh engine per config (alternating order) is timed on the prompts twice, the second time
after ``reset_prefix_cache``, and every sample is cut into phases from timestamps taken around a few calls:

- asyncconn: ``issue`` (the worker issuing the step's loads on vLLM's thread), ``prep`` (from there until the
  store's first read starts: the loop preparing the batch), ``read`` (from the first read's start to the last
  read's end: the ``file://`` batches on their threads, checksum included; on ``redis://`` the ``GET`` replies
  received in place), ``after`` (from the last read to the forward), and ``after`` cut in four:
  ``reported`` (until the worker's ``get_finished`` returns with the load: hand-back and poll),
  ``rescheduled`` (until vLLM's next ``schedule()`` has run), ``inputs`` (until that step's
  ``_prepare_inputs`` has run) and ``to_forward``; ``copy``: the time vLLM's thread spent writing staged
  values into their blocks (values read in place have none), and ``copy_after_reads`` the part of it after
  the last read; ``idle_waits`` (a count, not ms): how often vLLM's thread returned from an idle step's
  wait for the loads (``StreamLoader.wait``: each return a wake-up) before the forward;
- ``ExampleConnector``: ``load`` (its ``start_load_kv``, on vLLM's thread) and ``after`` (until the forward);
- both: ``start`` (from ``generate`` to the first of those), ``forward_at`` (from ``generate`` to the forward
  of the prompt's tail), ``forward`` (its length) and ``ttft``.

It also reads every thread's CPU time (``/proc/self/task/*/schedstat``) around each sample and reports it per
sample by thread (``cpu_ms``): Python threads by name, numbered pool threads pooled, other native threads
(vLLM's OpenMP worker among them) as ``native``; with ``--redis``, the redis-server process's too
(``redis-server``, from its ``/proc/PID/task/*/schedstat``). That is how a thread that competes with the reads
shows.

Why a script, not a bench: it times vLLM's own methods by wrapping them for the run (``_model_forward``),
which the library never does. Medians over every sample of every round, in milliseconds (but ``idle_waits``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from asyncconn_tools.engines import Probe, close_llm, engine_env, kv_config, make_llm
from asyncconn_tools.tiny_models import build_model

#: (start, end, label) of every timed call while a sample runs; appended from any thread (atomic).
_EVENTS: list[tuple[float, float, str]] = []
_TIMING = threading.Event()


def _thread_cpu(proc: str = "self") -> dict[int, int]:
    """Nanoseconds on a CPU so far, by native thread id, for every thread of process ``proc``."""
    out = {}
    for task in Path(f"/proc/{proc}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return out


def _thread_label(tid: int, names: dict[int, str]) -> str:
    """``tid``'s label: its Python name without a pool index (``asyncconn-file_1`` -> ``asyncconn-file``),
    or ``native`` for a thread Python did not start."""
    name = names.get(tid)
    if name is None:
        return "native"
    stem, _, index = name.rpartition("_")
    return stem if stem and index.isdigit() else name


def _cpu_ms(before: dict[int, int], after: dict[int, int]) -> dict[str, float]:
    """CPU milliseconds by thread label between two :func:`_thread_cpu` readings."""
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = {}
    for tid, ns in after.items():
        label = _thread_label(tid, names)
        out[label] = out.get(label, 0.0) + (ns - before.get(tid, 0)) / 1e6
    return out


@contextmanager
def _timed_calls(targets: list[tuple[type, str, str]]) -> Iterator[None]:
    """Wrap ``cls.name`` to record its calls as ``label`` while ``_TIMING`` is set; restore them after."""
    saved = []
    for cls, name, label in targets:
        original = cls.__dict__[name]
        saved.append((cls, name, original))
        if inspect.iscoroutinefunction(original):
            setattr(cls, name, functools.wraps(original)(_timed_async(original, label)))
            continue

        def timed(*args: Any, _f: Callable[..., Any] = original, _label: str = label, **kwargs: Any) -> Any:
            if not _TIMING.is_set():
                return _f(*args, **kwargs)
            started = time.perf_counter()
            try:
                return _f(*args, **kwargs)
            finally:
                _EVENTS.append((started, time.perf_counter(), _label))

        setattr(cls, name, functools.wraps(original)(timed))
    try:
        yield
    finally:
        for cls, name, original in saved:
            setattr(cls, name, original)


def _timed_async(original: Callable[..., Any], label: str) -> Callable[..., Any]:
    """``original`` (a coroutine function) recording its awaited calls as ``label`` while timing."""

    async def timed(*args: Any, **kwargs: Any) -> Any:
        if not _TIMING.is_set():
            return await original(*args, **kwargs)
        started = time.perf_counter()
        try:
            return await original(*args, **kwargs)
        finally:
            _EVENTS.append((started, time.perf_counter(), label))

    return timed


def _targets() -> list[tuple[type, str, str]]:
    from asyncconn_backends.file import FileBackend
    from asyncconn_backends.redis.reader import ChunkReader
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from asyncconn.transfer.loader import StreamLoader
    from asyncconn.vllm.kv.layout import CacheLayout
    from asyncconn.vllm.kv.worker import KVWorkerSide

    return [
        (GPUModelRunner, "_model_forward", "forward"),
        (KVWorkerSide, "issue_loads", "issue"),
        (FileBackend, "_read_many", "read"),
        (ChunkReader, "mget_into", "read"),  # a value within redis' chunk_size: one GET
        (ChunkReader, "hmget_into", "read"),  # a chunked one
        (ExampleConnector, "start_load_kv", "load"),
        (KVWorkerSide, "get_finished", "finished"),
        (CacheLayout, "scatter", "copy"),  # a staged value into its blocks, on vLLM's thread
        (Scheduler, "schedule", "schedule"),
        (GPUModelRunner, "_prepare_inputs", "inputs"),
        (StreamLoader, "wait", "wait"),  # vLLM's thread blocked in an idle step: each return a wake-up
    ]


def _first_end_after(events: list[tuple[float, float, str]], label: str, after: float) -> float | None:
    """When the first ``label`` call that ends after ``after`` ends."""
    return min((e[1] for e in events if e[2] == label and e[1] > after), default=None)


def _phases(events: list[tuple[float, float, str]], t0: float, t1: float) -> dict[str, float] | None:
    """One sample's phases (ms), or None when it did not load (no forward after a load)."""
    ms = 1e3
    forwards = [e for e in events if e[2] == "forward"]
    if not forwards:
        return None
    forward_at = forwards[0][0]
    out = {
        "forward_at": (forward_at - t0) * ms,
        "forward": (forwards[0][1] - forward_at) * ms,
        "ttft": (t1 - t0) * ms,
    }
    issues = [e for e in events if e[2] == "issue" and e[1] - e[0] > 1e-4 and e[0] < forward_at]
    reads = [e for e in events if e[2] == "read" and e[0] < forward_at]
    loads = [e for e in events if e[2] == "load" and e[1] - e[0] > 1e-4]
    if issues and reads:
        first_read, last_read = min(e[0] for e in reads), max(e[1] for e in reads)
        copies = [e for e in events if e[2] == "copy" and e[1] <= forward_at]
        out |= {
            "start": (issues[0][0] - t0) * ms,
            "issue": (issues[0][1] - issues[0][0]) * ms,
            "prep": (first_read - issues[0][1]) * ms,
            "read": (last_read - first_read) * ms,
            "after": (forward_at - last_read) * ms,
            # Staged values written into their blocks (in-place reads have none): in all, and after the reads
            "copy": sum(e[1] - e[0] for e in copies) * ms,
            "copy_after_reads": sum(e[1] - max(e[0], last_read) for e in copies if e[1] > last_read) * ms,
            # How often vLLM's thread, waiting in an idle step, woke before the forward (a count)
            "idle_waits": sum(1 for e in events if e[2] == "wait" and e[1] <= forward_at),
        }
        # The after-phase step by step: each mark is the first such call to end after the previous mark.
        marks, at = {}, last_read
        for key, label in (("reported", "finished"), ("rescheduled", "schedule"), ("inputs", "inputs")):
            end = _first_end_after(events, label, at)
            if end is None or end > forward_at:
                break
            marks[key], at = (end - at) * ms, end
        else:
            out |= marks | {"to_forward": (forward_at - at) * ms}
    elif loads:
        out |= {
            "start": (loads[0][0] - t0) * ms,
            "load": (loads[0][1] - loads[0][0]) * ms,
            "after": (forward_at - loads[0][1]) * ms,
        }
    else:
        return None
    return out


def _medians(
    rows: list[dict[str, float]], absent: float | None = None, at_least: float = 0.0
) -> dict[str, float]:
    """Per key, the median (rounded to 0.01) when it is at least ``at_least``: over the rows that have the
    key, or over all rows, ``absent`` standing in where a row lacks it (a thread that did not run: 0 ms)."""
    out = {}
    for key in dict.fromkeys(k for row in rows for k in row):
        values = [r[key] for r in rows if key in r] if absent is None else [r.get(key, absent) for r in rows]
        out[key] = round(statistics.median(values), 2)
    return {k: v for k, v in out.items() if v >= at_least}


def _sample(
    model: Path,
    configs: dict[str, Callable[[], Any]],
    texts: list[list[int]],
    engine_args: dict[str, Any],
    rounds: int,
    redis_pid: str | None,
) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[dict[str, float]]]]:
    """Fill each store, then time every config's fresh engines (see the module docstring): phases and CPU
    milliseconds by thread, per sample."""
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0)
    for make in configs.values():  # fill each store: an engine computes the prompts, one at a time
        llm = make_llm(model, kv=make(), **engine_args)
        for text in texts:
            llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
        Probe(llm).settle(timeout=300)
        close_llm(llm)

    samples: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    cpus: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    with _timed_calls(_targets()):
        for round_ in range(rounds):
            order = list(configs) if round_ % 2 == 0 else list(reversed(configs))
            for name in order:
                llm = make_llm(model, kv=configs[name](), **engine_args)
                probe = Probe(llm)
                for pass_ in range(2):
                    if pass_:
                        probe.settle(timeout=300)
                        llm.reset_prefix_cache()
                    for text in texts:
                        _EVENTS.clear()
                        cpu0 = _thread_cpu()
                        server0 = _thread_cpu(redis_pid) if redis_pid else {}
                        _TIMING.set()
                        t0 = time.perf_counter()
                        llm.generate([{"prompt_token_ids": text}], one, use_tqdm=False)
                        t1 = time.perf_counter()
                        _TIMING.clear()
                        cpu = _cpu_ms(cpu0, _thread_cpu())
                        if redis_pid:
                            server = _thread_cpu(redis_pid)
                            spent = sum(ns - server0.get(t, 0) for t, ns in server.items())
                            cpu["redis-server"] = spent / 1e6
                        phases = _phases(sorted(_EVENTS), t0, t1)
                        if phases is not None:
                            samples[name].append(phases)
                            cpus[name].append(cpu)
                probe.settle(timeout=300)
                close_llm(llm)
    return samples, cpus


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--redis", action="store_true", help="redis:// beside file:// (the others left out)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is for the figures
    engine_env()  # before vLLM is imported
    logging.getLogger("vllm").setLevel(logging.ERROR)

    from vllm.config import KVTransferConfig

    model = build_model("text-100m", progress=lambda m: print(m, file=sys.stderr))
    rng = random.Random(7)  # the prompts of ``bench engine --what ttft``
    texts = [[rng.randrange(5, 8000) for _ in range(args.tokens + 17)] for _ in range(args.prompts)]
    engine_args: dict[str, Any] = {
        "kv_cache_bytes": 2 << 30,
        "max_model_len": args.tokens + 64,
        "max_num_batched_tokens": args.tokens + 64,
        "max_num_seqs": 1,
    }
    work = Path(tempfile.mkdtemp(prefix="asyncconn-phases-"))
    with contextlib.ExitStack() as stack:
        redis_pid: str | None = None
        configs: dict[str, Callable[[], Any]] = {
            "asyncconn file://": lambda: kv_config(backend_url=f"file://{work / 'store'}"),
        }
        if args.redis:
            from asyncconn_tools.chaos.procs import RedisServer

            server = RedisServer(extra_args=("--maxmemory", "0")).start()
            stack.callback(server.stop)
            assert server.proc is not None  # started
            redis_pid, redis_url = str(server.proc.pid), server.url
            configs["asyncconn redis://"] = lambda: kv_config(backend_url=redis_url)
        else:
            configs["asyncconn file://, 4 blocks per value"] = lambda: kv_config(
                backend_url=f"file://{work / 'store-4'}", kv_blocks_per_value=4
            )
            configs["vLLM ExampleConnector"] = lambda: KVTransferConfig(
                kv_connector="ExampleConnector",
                kv_role="kv_both",
                kv_connector_extra_config={"shared_storage_path": str(work / "example")},
            )
        samples, cpus = _sample(model, configs, texts, engine_args, args.rounds, redis_pid)
    summary: dict[str, dict[str, Any]] = {
        name: {"samples": len(rows)}
        | _medians(rows)
        | {"cpu_ms": _medians(cpus[name], absent=0.0, at_least=0.05)}
        for name, rows in samples.items()
        if rows
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for name, row in summary.items():
            cpu = row.pop("cpu_ms")
            print(f"{name}: " + ", ".join(f"{k} {v}" for k, v in row.items()))
            print("  CPU ms per sample by thread: " + ", ".join(f"{k} {v}" for k, v in cpu.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
