"""``asyncconn chaos``: both connectors on vLLM's real scheduler, under injected faults, with invariants.

One E instance (``ec_producer``) and ``pd_engines`` PD instances (``ec_consumer`` plus ``kv_both``, several
simulated TP workers each, a small KV pool so requests are preempted, chunked prefill) share a real
``redis-server``; PD's KV lookups go through a real ``asyncconn lookup-server`` process, its EC lookups
straight to the store. A closed-loop client keeps ``concurrency`` requests alive: requests with images go
to E first and are forwarded to a PD with E's ``ec_transfer_params`` (the proxy of a disaggregated
deployment); images and prompt prefixes repeat, so PD loads embeddings and KV that E and the other PD saved.
Some requests are aborted at a random moment. Meanwhile
:class:`~asyncconn_tools.chaos.faults.FaultInjector` kills,
freezes, slows and restarts the servers and damages stored values.

Checked continuously: every embedding PD consumed equals what the encoder produces for that image; every
running request's KV (sampled each few steps, and every request the step its load completes) equals what
computing its tokens gives, on every rank; no engine step takes longer than ``step_bound``; no live request
goes ``stall_bound`` seconds without progress. At the end, once the stack is healed and the engines drained:
nothing held by any engine or connector, no thread, file descriptor or loop task more than at the start.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from asyncconn.backend import open_backend
from asyncconn.runtime import get_runtime
from asyncconn_tools.chaos.checks import (
    ProcessCensus,
    check_embeddings,
    check_kv,
    connector_leaks,
    percentile,
)
from asyncconn_tools.chaos.faults import DATA_FAULTS, SERVER_FAULTS, FaultInjector
from asyncconn_tools.chaos.procs import LookupServerProcess, RedisServer
from asyncconn_tools.demo.ec_sim import capture_params

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos"]

_MODULE = "asyncconn.vllm"
_EC_PREFIX = "chaos-ec:"
_KV_PREFIX = "chaos-kv:"
_PREFIX_TOKENS = 48  # three blocks shared by every request of one prefix group


@dataclass(frozen=True)
class ChaosConfig:
    """What a chaos run does; every bound is in seconds of wall time."""

    duration: float = 60.0
    max_requests: int = 5000
    seed: int = 0
    fault_interval: float = 2.0
    faults: tuple[str, ...] = SERVER_FAULTS + DATA_FAULTS
    concurrency: int = 12
    pd_engines: int = 2
    pd_workers: int = 2
    images: int = 16
    prefixes: int = 6
    abort_probability: float = 0.08
    kv_blocks: int = 36
    #: The longest wait vLLM's contract lets a connector make on a step is handle_preemptions (bounded
    #: by preempt_timeout); everything else returns at once.
    step_bound: float = 1.0
    stall_bound: float = 15.0
    drain_timeout: float = 90.0
    #: PD's KV lookups through a real ``asyncconn lookup-server`` process (False: straight to the store).
    use_lookup_server: bool = True
    #: Connector timeouts: short, so that faults resolve within a few seconds.
    lookup_timeout: float = 0.5
    store_timeout: float = 0.5
    preempt_timeout: float = 0.5
    load_timeout: float = 1.0
    arrival_timeout: float = 1.0


@dataclass
class ChaosReport:
    """The figures of a run. ``violations`` and ``leaks`` are empty when every invariant held."""

    seed: int = 0
    seconds: float = 0.0
    requests: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    aborted_at: Counter[str] = field(default_factory=Counter)
    faults_injected: Counter[str] = field(default_factory=Counter)
    faults_healed: Counter[str] = field(default_factory=Counter)
    values_damaged: int = 0
    steps: int = 0
    step_p50_ms: float = 0.0
    step_p99_ms: float = 0.0
    max_step_ms: float = 0.0
    slowest_step: str = ""
    max_no_progress_s: float = 0.0
    preemptions: int = 0
    kv_checks: int = 0
    kv_requests_loaded: int = 0
    embedding_rows_checked: int = 0
    pd_encoder_runs: int = 0
    kv_blocks_failed_recomputed: int = 0
    ec_stats: Counter[str] = field(default_factory=Counter)
    recoveries: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    leaks: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations and not self.leaks

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            out[name] = dict(value) if isinstance(value, Counter) else value
        out["ok"] = self.ok
        return out


@dataclass
class _Req:
    rid: str
    tokens: list[int]
    items: list[Any]
    max_tokens: int
    pd: int
    abort_after: float | None
    engine: str = ""  # "E", "PD0", ...; "" once done
    since: float = 0.0
    progress: tuple[int, int] = (-1, -1)
    progress_at: float = 0.0


class _Run:
    def __init__(self, config: ChaosConfig, workdir: Path) -> None:
        self.config = config
        self.workdir = workdir
        self.rng = random.Random(config.seed)
        self.report = ChaosReport(seed=config.seed)
        self.live: dict[str, _Req] = {}
        self.next_id = 0
        self.rows = {f"img-{i}": 16 + 8 * (i % 4) for i in range(config.images)}
        self.prefixes = [[(p * 7919 + j * 31 + 5) % 1000 for j in range(_PREFIX_TOKENS)] for p in range(16)]
        self.step_ms: list[float] = []
        self.params: dict[str, Any] = {}

    # -- the workload ---------------------------------------------------------------------------------------
    def new_request(self, now: float) -> _Req:
        rng, cfg = self.rng, self.config
        rid = f"c{self.next_id}"
        self.next_id += 1
        tokens = list(self.prefixes[rng.randrange(cfg.prefixes)])
        items = []
        suffix = rng.randint(8, 40)
        if rng.random() < 0.6:
            image = f"img-{rng.randrange(cfg.images)}"
            from asyncconn_tools.sim.engine import MMItem

            items.append(MMItem(image, offset=len(tokens) + 2, length=self.rows[image]))
            suffix += self.rows[image] + 2
        tokens += [rng.randrange(1000) for _ in range(suffix)]
        abort_after = rng.uniform(0.0, 0.6) if rng.random() < cfg.abort_probability else None
        return _Req(rid, tokens, items, rng.randint(2, 24), rng.randrange(cfg.pd_engines), abort_after)


def run_chaos(config: ChaosConfig, workdir: Path | None = None) -> ChaosReport:
    """Run the whole scenario and return its figures; never raises for a violated invariant (see report)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    own = workdir is None
    base = Path(tempfile.mkdtemp(prefix="asyncconn-chaos-")) if workdir is None else Path(workdir)
    run = _Run(config, base)
    runtime = get_runtime()
    redis_server = RedisServer().start()
    lookup = LookupServerProcess(redis_server.url, key_prefix=_KV_PREFIX)
    try:
        _warm_up(base, redis_server.url)
        census = ProcessCensus()
        tasks_before = runtime.run(_count_tasks(), 10)
        lookup.start()
        _drive(run, redis_server, lookup)
    finally:
        lookup.stop()
        redis_server.stop()
        if own:
            shutil.rmtree(base, ignore_errors=True)
    run.report.leaks += [f"process: {p}" for p in census.grown()]
    tasks_after = runtime.run(_count_tasks(), 10)
    if tasks_after > tasks_before:
        run.report.leaks.append(f"runtime loop: {tasks_before} tasks before, {tasks_after} after")
    return run.report


def _warm_up(base: Path, url: str) -> None:
    """Build and close one engine with both connectors, and talk to the store once, before counting.

    vLLM and the runtime keep a few things for the process's life on first use, which must not be counted
    as leaks of the run: libuv, for one, opens a spare ``/dev/null`` descriptor per loop on its first TCP
    stream (its reserve for accept() hitting EMFILE).
    """
    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, SimShape, make_model_dir

    get_runtime().run(_touch(url), 10)
    shape = SimShape()
    extra = {"backend_url": f"memory://chaos-warm-up-{os.getpid()}"}
    EngineSim(
        make_model_dir(base / "warm-up", shape),
        shape=shape,
        kv=ConnectorSpec("AsyncConnKVConnector", _MODULE, "kv_both", extra),
        ec=ConnectorSpec("AsyncConnECConnector", _MODULE, "ec_consumer", extra),
    ).close()


async def _touch(url: str) -> None:
    backend = await open_backend(url)
    try:
        await backend.exists(["chaos-warm-up"])
    finally:
        await backend.close()


async def _count_tasks() -> int:
    return len(asyncio.all_tasks()) - 1  # minus this one


def _drive(run: _Run, redis_server: RedisServer, lookup: LookupServerProcess) -> None:
    from asyncconn_tools.sim.engine import ConnectorSpec, EngineSim, SimShape, make_model_dir

    cfg, report = run.config, run.report
    shape = SimShape(num_blocks=cfg.kv_blocks, num_kv_heads=2 * cfg.pd_workers)
    model = make_model_dir(run.workdir / "model", shape)
    timeouts = {
        "lookup_timeout": cfg.lookup_timeout,
        "store_timeout": cfg.store_timeout,
        "preempt_timeout": cfg.preempt_timeout,
        "load_timeout": cfg.load_timeout,
        "arrival_timeout": cfg.arrival_timeout,
    }
    ec_extra = {"backend_url": redis_server.url, "key_prefix": _EC_PREFIX, **timeouts}
    kv_extra = {
        "backend_url": redis_server.url,
        "key_prefix": _KV_PREFIX,
        **({"lookup_server": lookup.endpoint} if cfg.use_lookup_server else {}),
        **timeouts,
    }
    engines: dict[str, Any] = {}
    runtime = get_runtime()
    backend = runtime.run(open_backend(redis_server.url), 10)
    control = redis.Redis(host="127.0.0.1", port=redis_server.port, socket_timeout=0.5)
    try:
        engines["E"] = EngineSim(
            model,
            shape=shape,
            ec=ConnectorSpec("AsyncConnECConnector", _MODULE, "ec_producer", ec_extra),
            max_num_seqs=8,
            max_num_batched_tokens=256,
        )
        run.params = capture_params(engines["E"])
        for i in range(cfg.pd_engines):
            engines[f"PD{i}"] = EngineSim(
                model,
                shape=shape,
                kv=ConnectorSpec("AsyncConnKVConnector", _MODULE, "kv_both", kv_extra),
                ec=ConnectorSpec("AsyncConnECConnector", _MODULE, "ec_consumer", ec_extra),
                num_workers=cfg.pd_workers,
                max_num_seqs=8,
                max_num_batched_tokens=64,  # chunked prefill: every prompt takes two or more steps
                max_model_len=256,
                kv_load_failure_policy="recompute",
            )
        injector = FaultInjector(
            rng=random.Random(cfg.seed + 1),
            runtime=runtime,
            backend=backend,
            redis_server=redis_server,
            lookup_server=lookup,
            keys=lambda: _stored_keys(control),
            interval=cfg.fault_interval,
            kinds=cfg.faults,
        )
        # vLLM's EngineCore freezes its start-up heap (core.py: freeze_gc_heap) so that full collections
        # do not walk it on every step; without that, gen-2 pauses of ~0.4 s here would be the slowest steps.
        from vllm.utils.gc_utils import freeze_gc_heap

        freeze_gc_heap()
        started = time.monotonic()
        _loop(run, engines, injector, started, traffic=True)
        injector.heal_all()
        drain_started = time.monotonic()
        _loop(run, engines, injector, drain_started, traffic=False)
        _deliver_pending_drops(run, engines)
        report.seconds = round(time.monotonic() - started, 3)
        report.faults_injected = injector.injected
        report.faults_healed = injector.healed
        report.values_damaged = injector.values_damaged
        _final_figures(run, engines)
        for name, sim in engines.items():
            report.leaks += [f"{name} {p}" for p in connector_leaks(sim)]
    finally:
        gc.unfreeze()
        for sim in engines.values():
            sim.close()
        control.close()
        runtime.run(backend.close(), 10)


def _loop(
    run: _Run, engines: dict[str, Any], injector: FaultInjector, started: float, *, traffic: bool
) -> None:
    cfg, report = run.config, run.report
    pds = [engines[f"PD{i}"] for i in range(cfg.pd_engines)]
    steps = 0
    while True:
        now = time.monotonic()
        if traffic:
            if now - started >= cfg.duration or report.requests >= cfg.max_requests:
                return
            injector.tick(now)
            while len(run.live) < cfg.concurrency and report.requests < cfg.max_requests:
                _admit(run, engines, run.new_request(now), now)
        elif not run.live and not any(_busy(sim) for sim in engines.values()):
            return
        elif now - started > cfg.drain_timeout:
            held = {name: sorted(sim.scheduler.requests) for name, sim in engines.items()}
            report.violations.append(f"not drained after {cfg.drain_timeout:g}s: {held}")
            return
        _aborts(run, engines, now)
        for name, sim in engines.items():
            if not _busy(sim):
                continue
            record = sim.step()
            steps += 1
            ms = (record.schedule_ns + record.runner_ns + record.update_ns) / 1e6
            run.step_ms.append(ms)
            if ms > report.max_step_ms:
                report.max_step_ms = round(ms, 3)
                report.slowest_step = (
                    f"{name} step {record.index}: schedule {record.schedule_ns / 1e6:.1f} ms, runner "
                    f"{record.runner_ns / 1e6:.1f} ms, update {record.update_ns / 1e6:.1f} ms, "
                    f"{sum(record.num_scheduled_tokens.values())} tokens, fault {injector.active}"
                )
            if ms > cfg.step_bound * 1000:
                report.violations.append(f"{name} step {record.index} took {ms:.0f} ms")
            report.preemptions += len(record.preempted)
            _after_step(run, engines, name, sim, record, time.monotonic())
        if steps % 20 == 0:
            for i, sim in enumerate(pds):
                checked, problems = check_kv(sim)
                report.kv_checks += checked
                report.violations += [f"PD{i} {p}" for p in problems]
        _watchdog(run, engines, time.monotonic())
        time.sleep(0.0005)  # leave the runtime's loop thread the GIL between ticks, as an engine's I/O does


def _deliver_pending_drops(run: _Run, engines: dict[str, Any]) -> None:
    """Run one small text request through each PD that still has EC drop orders to send.

    Drop orders (free a prefetch nobody needs) reach the workers with the next step that runs the model;
    vLLM's V1 runner calls no EC hook on an empty step. An engine that went idle right after an abort
    therefore keeps that staging (bounded by the staging budget) until its next request -- documented
    behaviour, not a leak. The leak check runs after that next step, which this provides.
    """
    for name, sim in engines.items():
        if name == "E" or not sim.scheduler.ec_connector.scheduler_side.held().get("pending_drops"):
            continue
        sim.add_request(f"chaos-flush-{name}", list(range(20)), max_tokens=1)
        for _ in range(1000):
            if not _busy(sim):
                break
            sim.step()
            time.sleep(0.0005)
        else:
            run.report.violations.append(f"{name}: the flush request did not finish")


def _busy(sim: Any) -> bool:
    return bool(sim.scheduler.has_requests() or sim.scheduler.requests)


def _admit(run: _Run, engines: dict[str, Any], req: _Req, now: float) -> None:
    """A new request: to E first when it shows an image (the proxy forwards it later), else to its PD."""
    run.report.requests += 1
    run.live[req.rid] = req
    if req.items:
        engines["E"].add_request(req.rid, req.tokens, max_tokens=1, mm_items=req.items)
        _enter(req, "E", now)
    else:
        _forward(run, engines, req, now, None)


def _forward(run: _Run, engines: dict[str, Any], req: _Req, now: float, params: Any) -> None:
    sim = engines[f"PD{req.pd}"]
    sim.add_request(req.rid, req.tokens, max_tokens=req.max_tokens, mm_items=req.items)
    if params is not None:
        sim.scheduler.requests[req.rid].ec_transfer_params = params
    _enter(req, f"PD{req.pd}", now)


def _enter(req: _Req, engine: str, now: float) -> None:
    req.engine, req.since, req.progress, req.progress_at = engine, now, (-1, -1), now


def _aborts(run: _Run, engines: dict[str, Any], now: float) -> None:
    for req in list(run.live.values()):
        if req.abort_after is None or now - req.since < req.abort_after or not req.engine:
            continue
        sim = engines[req.engine]
        request = sim.scheduler.requests.get(req.rid)
        where = f"{req.engine}:{_stage(sim, request)}"
        req.abort_after = None
        if sim.abort(req.rid):
            run.report.aborted_at[where] += 1
            _done(run, engines, req, "abort")


def _stage(sim: Any, request: Any) -> str:
    """Where an aborted request was: waiting (lookup or arrival pending), loading KV, prefill or decode."""
    if request is None:
        return "finished"
    status = str(request.status.name).lower()
    if status == "running":
        return "decode" if request.num_output_tokens else "prefill"
    return status


def _after_step(run: _Run, engines: dict[str, Any], name: str, sim: Any, record: Any, now: float) -> None:
    report = run.report
    if name != "E":
        report.pd_encoder_runs += len(record.encoded)
        out = record.kv_connector_output
        loaded = sorted(out.finished_recving or ()) if out is not None else []
        if out is not None:
            report.kv_blocks_failed_recomputed += len(out.invalid_block_ids or ())
        if loaded:
            checked, problems = check_kv(sim, loaded)
            report.kv_checks += checked
            report.kv_requests_loaded += checked
            report.violations += [f"{name} {p}" for p in problems]
    if len(sim.steps) > 2000:  # the simulator keeps every StepRecord; a long run needs only recent ones
        del sim.steps[:-100]
    for rid, reason in record.finished.items():
        req = run.live.get(rid)
        if req is None or req.engine != name:
            continue
        if name == "E":
            if reason == "abort":
                _done(run, engines, req, "abort")
            else:  # E answered: the proxy forwards the request to PD with E's transfer params
                _forward(run, engines, req, now, run.params.pop(rid, None))
        else:
            _done(run, engines, req, reason)


def _done(run: _Run, engines: dict[str, Any], req: _Req, reason: str) -> None:
    """A request left the system: check the embeddings its PD consumed, count how it ended."""
    run.live.pop(req.rid, None)
    run.params.pop(req.rid, None)
    run.report.finished[reason] += 1
    if req.engine.startswith("PD") and req.items:
        rows, problems = check_embeddings(
            engines[req.engine], req.rid, {i.identifier: i.length for i in req.items}, _hidden(engines)
        )
        run.report.embedding_rows_checked += rows
        run.report.violations += problems
    req.engine = ""


def _hidden(engines: dict[str, Any]) -> int:
    return int(engines["E"].shape.hidden_size)


def _watchdog(run: _Run, engines: dict[str, Any], now: float) -> None:
    """A live request that has not moved (tokens computed or produced) for ``stall_bound`` is stuck."""
    bound = run.config.stall_bound
    for req in run.live.values():
        if not req.engine:
            continue
        request = engines[req.engine].scheduler.requests.get(req.rid)
        state = (-1, -1) if request is None else (request.num_computed_tokens, request.num_output_tokens)
        if state != req.progress:
            req.progress, req.progress_at = state, now
            continue
        idle = now - req.progress_at
        run.report.max_no_progress_s = max(run.report.max_no_progress_s, round(idle, 3))
        if idle > bound:
            run.report.violations.append(
                f"request {req.rid} stuck on {req.engine} for {idle:.1f}s (status "
                f"{None if request is None else request.status.name})"
            )
            req.progress_at = now  # report it again only after another full bound


def _final_figures(run: _Run, engines: dict[str, Any]) -> None:
    report = run.report
    report.steps = len(run.step_ms)
    report.step_p50_ms = round(percentile(run.step_ms, 0.5), 3)
    report.step_p99_ms = round(percentile(run.step_ms, 0.99), 3)
    for name, sim in engines.items():
        if name != "E":
            report.ec_stats.update(
                {k: int(v) for k, v in sim.scheduler.ec_connector.scheduler_side.totals().items()}
            )
    ec = report.ec_stats
    report.recoveries = {
        "faults healed, service resumed": sum(report.faults_healed.values()),
        "KV blocks that failed to load, recomputed": report.kv_blocks_failed_recomputed,
        "EC items whose load failed, encoded instead": sum(
            v for k, v in ec.items() if k.startswith("load_failed")
        ),
        "EC items announced by E that never arrived, encoded": ec.get("arrival_timeouts", 0),
    }


def _stored_keys(control: redis.Redis) -> Sequence[str]:
    """Keys holding values now: the redis layout keeps a value's manifest or inline bytes under
    ``{key}`` (the braces are the cluster hash tag) and chunks under ``{key}:version:i``."""
    keys: list[str] = []
    try:
        for prefix in (_EC_PREFIX, _KV_PREFIX):
            for raw in control.scan_iter(match=f"{{{prefix}*", count=500):
                name = raw.decode() if isinstance(raw, bytes) else str(raw)
                if name.endswith("}"):
                    keys.append(name[1:-1])
                if len(keys) >= 5000:
                    break
    except redis.RedisError:
        return []
    return keys
