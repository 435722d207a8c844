"""An offline vLLM engine: the real V1 ``Scheduler`` driving a simulated model runner.

Why: the EC and KV connectors must be tested against the scheduler that will really call them -- its
admission rules, chunked prefill, preemption, delayed block frees -- but there is no GPU and no model
weights here. :class:`EngineSim` builds vLLM's own config objects and ``Scheduler`` for a weightless OPT
config, and replaces only the model runner with :class:`~asyncconn_tools.sim.runner.SimWorker`, which calls
the worker-side connector methods in vLLM's order and writes predictable embeddings and KV.

Typical use::

    sim = EngineSim(make_model_dir(tmp), ec=ConnectorSpec("ECExampleConnector", None, "ec_consumer",
                                                          {"shared_storage_path": str(tmp / "ec")}))
    sim.add_request("r1", list(range(40)), max_tokens=3, mm_items=[MMItem("img-a", offset=4, length=16)])
    sim.run_until_idle()
    assert not sim.leak_check()

Importing this module does not import vLLM; constructing an :class:`EngineSim` does (~8 s the first time).
Set ``HF_HUB_OFFLINE=1`` and ``VLLM_TARGET_DEVICE=cpu`` before that.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncconn_tools.sim.config import (
    ConnectorSpec,
    SimShape,
    build_kv_cache_config,
    build_scheduler,
    build_vllm_config,
    make_model_dir,
)
from asyncconn_tools.sim.errors import SimulationError
from asyncconn_tools.sim.runner import (
    EncoderItem,
    GatheredRows,
    ScheduledRows,
    SimWorker,
    StepPlan,
    copy_output,
    embedding_for,
    kv_values,
)

__all__ = [
    "ConnectorSpec",
    "EngineSim",
    "MMItem",
    "SimShape",
    "StepRecord",
    "embedding_for",
    "kv_values",
    "make_model_dir",
]


@dataclass(frozen=True)
class MMItem:
    """One multimodal item of a prompt: its hash (the cache key everywhere) and its placeholder span."""

    identifier: str
    offset: int
    length: int
    modality: str = "image"


@dataclass
class StepRecord:
    """What one :meth:`EngineSim.step` did, for tests and benchmarks."""

    index: int
    schedule_ns: int
    runner_ns: int
    update_ns: int
    num_scheduled_tokens: dict[str, int]
    waiting: tuple[str, ...]
    running: tuple[str, ...]
    encoded: list[tuple[str, str]]
    preempted: set[str]
    finished: dict[str, str]
    kv_connector_output: Any = None
    ec_connector_output: Any = None
    scheduler_output: Any = field(default=None, repr=False)


class EngineSim:
    """vLLM's scheduler plus ``num_workers`` simulated workers, stepped by hand.

    Each worker holds worker-role connectors and its own slice of the KV heads; their outputs are merged
    with vLLM's own ``KVOutputAggregator`` / ``ECOutputAggregator`` when there is more than one, as the
    multiprocess executor does. ``encoder_only`` (default: the EC role is ``ec_producer``) makes this an
    E instance: requests stop once their prompt is encoded. ``kv_load_failure_policy`` is vLLM's: with
    ``"fail"`` (its default) a block reported by ``get_block_ids_with_load_errors`` fails the request.
    ``kv_events``: vLLM's KV cache events on (publisher ``null``; replace ``scheduler.kv_event_publisher``).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        shape: SimShape | None = None,
        kv: ConnectorSpec | None = None,
        ec: ConnectorSpec | None = None,
        num_workers: int = 1,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 256,
        max_model_len: int = 1024,
        enable_prefix_caching: bool = True,
        encoder_cache_size: int = 4096,
        encoder_budget: int | None = None,
        encoder_only: bool | None = None,
        sample_token: int = 7,
        kv_load_failure_policy: str = "fail",
        kv_events: bool = False,
    ) -> None:
        if num_workers < 1:
            raise SimulationError(f"num_workers must be >= 1, got {num_workers}")
        self.shape = shape or SimShape()
        if self.shape.num_kv_heads % num_workers and not self.shape.mla:
            raise SimulationError(
                f"num_kv_heads={self.shape.num_kv_heads} does not split over {num_workers} workers"
            )
        if not 0 <= sample_token < self.shape.vocab_size:
            raise SimulationError(f"sample_token {sample_token} is outside the vocabulary")
        self.encoder_only = (
            (ec is not None and ec.role == "ec_producer") if encoder_only is None else encoder_only
        )
        self.vllm_config = build_vllm_config(
            Path(model_dir),
            self.shape,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching and not self.encoder_only,
            kv=kv,
            ec=ec,
            kv_load_failure_policy=kv_load_failure_policy,
            kv_events=kv_events,
        )
        self.max_model_len = max_model_len
        budget = encoder_budget if encoder_budget is not None else max_num_batched_tokens
        self._encoder_limit = min(budget, encoder_cache_size)
        self.kv_cache_config = build_kv_cache_config(self.shape)
        self.scheduler = build_scheduler(
            self.vllm_config,
            self.kv_cache_config,
            self.shape,
            encoder_cache_size=encoder_cache_size,
            encoder_budget=budget,
            encoder_only=self.encoder_only,
        )
        self.workers: list[SimWorker] = []
        try:  # a connector that fails to build must not leave the ones already built running
            for rank in range(num_workers):
                self.workers.append(
                    SimWorker(
                        rank, num_workers, self.shape, self.vllm_config, self.kv_cache_config, sample_token
                    )
                )
        except BaseException:
            for worker in self.workers:
                worker.shutdown()
            self.scheduler.shutdown()
            raise
        self._kv_aggregator: Any = None
        self._ec_aggregator: Any = None
        if num_workers > 1:
            from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator
            from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator

            if self.workers[0].kv_connector is not None:
                self._kv_aggregator = KVOutputAggregator.from_connector(
                    self.workers[0].kv_connector, num_workers
                )
            self._ec_aggregator = ECOutputAggregator()
            self._tell_tensor_parallel(num_workers)
        self._block_hasher = _block_hasher(self.shape.block_size)
        self._known: set[str] = set()
        self.steps: list[StepRecord] = []
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, str] = {}
        self.tokens_computed: dict[str, int] = {}
        self._embeddings: dict[str, dict[str, torch.Tensor]] = {}
        self._closed = False

    def _tell_tensor_parallel(self, size: int) -> None:
        """In-process workers have no vLLM TP group to read their rank from: tell connectors that can be told
        (``configure_tensor_parallel``, as asyncconn's KV connector offers), or every rank would act as 0."""
        targets: list[tuple[Any, int | None]] = [(getattr(self.scheduler, "connector", None), None)]
        targets += [(worker.kv_connector, worker.rank) for worker in self.workers]
        for connector, rank in targets:
            configure = getattr(connector, "configure_tensor_parallel", None)
            if configure is None:
                continue
            if rank is None:
                configure(size)
            else:
                configure(size, rank)

    # -- requests -------------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 4,
        mm_items: Iterable[MMItem] = (),
        priority: int = 0,
    ) -> None:
        """Queue a request; bad input raises :class:`SimulationError` before vLLM sees it."""
        from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        tokens = [int(t) for t in prompt_token_ids]
        items = list(mm_items)
        self._validate(request_id, tokens, max_tokens, items)
        features = [
            MultiModalFeatureSpec(
                data=None,
                modality=item.modality,
                identifier=item.identifier,
                mm_position=PlaceholderRange(offset=item.offset, length=item.length),
            )
            for item in items
        ]
        request = Request(
            request_id,
            tokens,
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            pooling_params=None,
            mm_features=features,
            priority=priority,
            block_hasher=self._block_hasher,
        )
        self._known.add(request_id)
        self.outputs[request_id] = []
        self.tokens_computed[request_id] = 0
        self._embeddings[request_id] = {
            item.identifier: torch.full((item.length, self.shape.hidden_size), float("nan")) for item in items
        }
        self.scheduler.add_request(request)

    def _validate(self, request_id: str, tokens: list[int], max_tokens: int, items: list[MMItem]) -> None:
        if request_id in self._known:
            raise SimulationError(f"request id {request_id!r} was already used")
        if not tokens:
            raise SimulationError(f"request {request_id!r} has an empty prompt")
        if max_tokens < 1:
            raise SimulationError(f"request {request_id!r}: max_tokens must be >= 1, got {max_tokens}")
        if min(tokens) < 0 or max(tokens) >= self.shape.vocab_size:
            raise SimulationError(
                f"request {request_id!r} has token ids outside [0, {self.shape.vocab_size})"
            )
        if len(tokens) + max_tokens > self.max_model_len:
            raise SimulationError(
                f"request {request_id!r}: prompt + max_tokens exceeds max_model_len {self.max_model_len}"
            )
        end = 0
        for item in sorted(items, key=lambda i: i.offset):
            if item.length < 1 or item.offset < end or item.offset + item.length > len(tokens):
                raise SimulationError(
                    f"request {request_id!r}: item {item.identifier!r} at {item.offset}+"
                    f"{item.length} overlaps another item or leaves the prompt"
                )
            end = item.offset + item.length
            if item.length > self._encoder_limit:
                raise SimulationError(
                    f"request {request_id!r}: item {item.identifier!r} ({item.length} embeddings) "
                    f"exceeds the encoder budget/cache ({self._encoder_limit}); it could never run"
                )

    def abort(self, request_id: str) -> bool:
        """Abort a request as the API server would; False if it had already finished."""
        from vllm.v1.request import RequestStatus

        if request_id not in self._known:
            raise SimulationError(f"abort of unknown request id {request_id!r}")
        aborted = self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        if aborted:  # vLLM reports aborts outside update_from_output, so record the reason here
            self.finish_reasons[request_id] = "abort"
        return bool(aborted)

    # -- stepping -------------------------------------------------------------------------------------

    def step(self) -> StepRecord:
        """``schedule()``, every worker's ``execute``, merge, ``update_from_output``: one engine step."""
        if self._closed:
            raise SimulationError("step() on a closed EngineSim")
        started = time.perf_counter_ns()
        so = self.scheduler.schedule()
        scheduled = time.perf_counter_ns()
        waiting = tuple(
            r.request_id
            for queue in (self.scheduler.kv_holding_waiting, self.scheduler.waiting)
            for r in queue
        )
        running = tuple(r.request_id for r in self.scheduler.running)
        plan = self._plan(so)
        results = [worker.execute(plan) for worker in self.workers]
        output = self._merge([r.output for r in results])
        ran = time.perf_counter_ns()
        engine_outputs = self.scheduler.update_from_output(so, output)
        updated = time.perf_counter_ns()

        for rows, tensor in results[0].gathered:
            self._embeddings[rows.req_id][rows.mm_hash][rows.start : rows.end] = tensor
        for req_id, count in so.num_scheduled_tokens.items():
            self.tokens_computed[req_id] += count
        finished: dict[str, str] = {}
        for outputs in engine_outputs.values():
            for out in outputs.outputs:
                self.outputs[out.request_id].extend(out.new_token_ids)
                if out.finish_reason is not None:
                    finished[out.request_id] = str(out.finish_reason)
        self.finish_reasons.update(finished)
        record = StepRecord(
            index=len(self.steps),
            schedule_ns=scheduled - started,
            runner_ns=ran - scheduled,
            update_ns=updated - ran,
            num_scheduled_tokens=dict(so.num_scheduled_tokens),
            waiting=waiting,
            running=running,
            encoded=results[0].encoded,
            preempted=set(so.preempted_req_ids or ()),
            finished=finished,
            kv_connector_output=output.kv_connector_output,
            ec_connector_output=output.ec_connector_output,
            scheduler_output=so,
        )
        self.steps.append(record)
        return record

    def run_until_idle(self, max_steps: int = 1000) -> list[StepRecord]:
        """Step until the scheduler holds nothing (live requests, unreported finishes, delayed frees)."""
        records: list[StepRecord] = []
        while self.scheduler.has_requests() or self.scheduler.requests:
            if len(records) >= max_steps:
                raise SimulationError(
                    f"not idle after {max_steps} steps; still held: {sorted(self.scheduler.requests)}"
                )
            records.append(self.step())
        return records

    def _plan(self, so: Any) -> StepPlan:
        """Turn a ``SchedulerOutput`` into per-request token/slot rows, as the runner's input prep does."""
        starts = {new.req_id: new.num_computed_tokens for new in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        block_size = self.shape.block_size
        rows: list[ScheduledRows] = []
        for req_id, count in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = starts[req_id]
            positions = torch.arange(start, start + count)
            table = torch.tensor(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0], dtype=torch.int64)
            slots = table[positions // block_size] * block_size + positions % block_size
            gathers = []
            for feature in request.mm_features:
                offset, length = feature.mm_position.offset, feature.mm_position.length
                lo, hi = max(start, offset), min(start + count, offset + length)
                if lo < hi:
                    gathers.append(GatheredRows(req_id, feature.identifier, lo - offset, hi - offset))
            rows.append(
                ScheduledRows(
                    req_id=req_id,
                    token_ids=torch.tensor(request.all_token_ids[start : start + count]),
                    positions=positions,
                    slot_mapping=slots,
                    sample=not self.encoder_only and start + count >= request.num_tokens,
                    gathers=tuple(gathers),
                )
            )
        encoder_items = tuple(
            EncoderItem(req_id, feature.identifier, feature.mm_position.get_num_embeds())
            for req_id, indices in so.scheduled_encoder_inputs.items()
            for feature in (self.scheduler.requests[req_id].mm_features[i] for i in indices)
        )
        return StepPlan(scheduler_output=so, rows=tuple(rows), encoder_items=encoder_items)

    def _merge(self, outputs: list[Any]) -> Any:
        """One worker: its output as is (the uniprocess executor). Several: vLLM's aggregators."""
        if len(outputs) == 1:
            return outputs[0]
        merged = [copy_output(o) for o in outputs]
        if self._kv_aggregator is not None:
            merged[0] = self._kv_aggregator.aggregate(merged, 0)
        if self._ec_aggregator is not None:
            merged[0] = self._ec_aggregator.aggregate(merged, 0)
        return merged[0]

    # -- observability --------------------------------------------------------------------------------

    def embeddings_used(self, request_id: str) -> dict[str, torch.Tensor]:
        """Per mm hash, the embedding rows the model consumed for the request (NaN rows never consumed)."""
        return {h: t.clone() for h, t in self._embeddings[request_id].items()}

    def encoder_runs(self) -> list[tuple[str, str]]:
        """Every (request id, mm hash) the encoder of worker 0 ran on, in order."""
        return [item for record in self.steps for item in record.encoded]

    def read_kv(self, request_id: str, rank: int = 0) -> dict[str, torch.Tensor]:
        """Worker ``rank``'s KV for the request's computed tokens, per layer; the request must be live."""
        request = self.scheduler.requests.get(request_id)
        if request is None:
            raise SimulationError(f"request {request_id!r} holds no KV blocks (unknown or finished)")
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        return self.workers[rank].read_kv(block_ids, request.num_computed_tokens)

    def expected_kv(self, token_ids: Sequence[int], rank: int = 0) -> dict[str, torch.Tensor]:
        """The KV :meth:`read_kv` must return for a sequence whose every token was computed or loaded."""
        worker = self.workers[rank]
        ids = torch.tensor(list(token_ids), dtype=torch.int64)
        positions = torch.arange(len(ids))
        return {
            name: kv_values(ids, positions, index, worker.heads, 2 * self.shape.head_size)
            for index, name in enumerate(worker.layer_names)
        }

    def leak_check(self) -> list[str]:
        """What the engine still holds that it should not once every request is done."""
        sched = self.scheduler
        problems: list[str] = []
        if sched.requests:
            problems.append(f"scheduler still holds requests {sorted(sched.requests)}")
        for name in ("waiting", "kv_holding_waiting", "running"):
            queue = getattr(sched, name)
            if len(queue):
                problems.append(f"{name} queue not empty: {[r.request_id for r in queue]}")
        if sched.deferred_waiting:
            problems.append(f"deferred_waiting not empty: {[r.request_id for r in sched.deferred_waiting]}")
        manager = sched.encoder_cache_manager
        referenced = {h: sorted(ids) for h, ids in manager.cached.items() if ids}
        if referenced:
            problems.append(f"encoder cache entries still referenced: {referenced}")
        if manager.num_freeable_slots != manager.cache_size:
            problems.append(
                f"encoder cache: {manager.cache_size - manager.num_freeable_slots} slots not freeable"
            )
        free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
        if free != self.shape.num_blocks - 1:  # block 0 is the null block, never free
            problems.append(f"{self.shape.num_blocks - 1 - free} KV blocks not free")
        for worker in self.workers:
            stale = sorted(set(worker.encoder_cache) - set(manager.cached))
            if stale:
                problems.append(f"worker {worker.rank} keeps encoder outputs the scheduler evicted: {stale}")
        return problems

    def close(self) -> None:
        """Shut down the scheduler's and every worker's connectors; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()

    def __enter__(self) -> EngineSim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _block_hasher(block_size: int) -> Any:
    """vLLM's request block hasher (prefix caching keys), with the process-wide none-hash initialised."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(block_size, sha256)
