"""The simulated model runner: one object per (simulated) tensor-parallel worker.

It does no arithmetic worth the name, but it calls the worker-side EC and KV connector methods in exactly
the order vLLM 0.32's GPU model runner does (``gpu_model_runner.py`` ``execute_model``, the two
``*_connector_model_runner_mixin.py`` context managers, and the per-layer wrapper in
``model_executor/layers/attention/kv_transfer_utils.py``), and it writes values a test can predict:

* an encoder output is :func:`embedding_for` its mm hash -- the same bytes on every instance;
* the KV "computed" for a token is :func:`kv_values` of (token id, position, layer, head) -- so KV that a
  connector loaded can be compared byte for byte with KV that was computed.

The KV tensors use vLLM 0.32's per-layer logical layout ``[num_blocks, num_kv_heads, block_size, C]``
(``kv_cache_interface.create_kv_cache_views``) with C = K channels then V channels, in float32 elements
rather than bytes: vLLM's own ``ExampleConnector`` indexes it as ``layer[block_ids, :, offsets]``.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncconn_tools.sim.config import SimShape, layer_names
from asyncconn_tools.sim.errors import SimulationError

__all__ = [
    "EncoderItem",
    "GatheredRows",
    "ScheduledRows",
    "SimAttentionMetadata",
    "SimForwardContext",
    "SimWorker",
    "StepPlan",
    "WorkerStepResult",
    "embedding_for",
    "kv_values",
]

_KV_MODULUS = 65521  # a prime: values stay exact in float32 and differ for neighbouring tokens


def embedding_for(mm_hash: str, length: int, hidden_size: int) -> torch.Tensor:
    """The encoder output for one multimodal item: a float32 ``[length, hidden_size]`` tensor seeded by the
    hash, so an E instance and a PD instance agree on it without sharing anything but the hash."""
    seed = int.from_bytes(hashlib.sha256(mm_hash.encode()).digest()[:8], "little") & (2**63 - 1)
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(length, hidden_size, generator=generator, dtype=torch.float32)


def kv_values(
    token_ids: torch.Tensor, positions: torch.Tensor, layer: int, heads: torch.Tensor, width: int
) -> torch.Tensor:
    """The KV a token "computes": float32 ``[len(token_ids), len(heads), width]``, a pure function of its
    arguments, so loaded KV can be checked against recomputed KV exactly."""
    base = token_ids.to(torch.int64) * 1_000_003 + positions.to(torch.int64) * 8_191 + layer * 131
    grid = (
        base[:, None, None] + heads.to(torch.int64)[None, :, None] * 31 + torch.arange(width)[None, None, :]
    )
    return (grid % _KV_MODULUS).to(torch.float32) / _KV_MODULUS


@dataclass(frozen=True)
class SimAttentionMetadata:
    """Stands in for a backend's attention metadata: what a connector may read from it."""

    slot_mapping: torch.Tensor
    num_actual_tokens: int


@dataclass
class _SimAttentionLayer:
    """Stands in for an ``Attention`` module in ``forward_context.no_compile_layers``."""

    kv_cache: torch.Tensor


@dataclass
class SimForwardContext:
    """The subset of vLLM's ``ForwardContext`` connectors read: ``no_compile_layers[name].kv_cache``,
    ``attn_metadata`` (a dict per layer; ``None`` on a step with nothing to compute, as in
    ``kv_connector_no_forward``) and ``slot_mapping`` (a dict per layer)."""

    no_compile_layers: dict[str, _SimAttentionLayer]
    attn_metadata: dict[str, SimAttentionMetadata] | None
    slot_mapping: dict[str, torch.Tensor]


@dataclass(frozen=True)
class GatheredRows:
    """Rows ``[start, end)`` of item ``mm_hash``'s embedding that request ``req_id`` consumes this step."""

    req_id: str
    mm_hash: str
    start: int
    end: int


@dataclass(frozen=True)
class ScheduledRows:
    """One request's share of a step, as the worker sees it."""

    req_id: str
    token_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    sample: bool
    gathers: tuple[GatheredRows, ...]


@dataclass(frozen=True)
class EncoderItem:
    """One multimodal item the scheduler asked the encoder to run on this step."""

    req_id: str
    mm_hash: str
    length: int


@dataclass(frozen=True)
class StepPlan:
    """Everything a worker needs for one step; built once by the engine and shared by all workers."""

    scheduler_output: Any
    rows: tuple[ScheduledRows, ...]
    encoder_items: tuple[EncoderItem, ...]


@dataclass
class WorkerStepResult:
    """A worker's ``ModelRunnerOutput`` plus what it did, for the engine's step record."""

    output: Any
    encoded: list[tuple[str, str]] = field(default_factory=list)
    gathered: list[tuple[GatheredRows, torch.Tensor]] = field(default_factory=list)


class SimWorker:
    """One worker: its encoder cache, its slice of the KV heads, and its worker-role connectors.

    The connectors are built the way ``ensure_ec_transfer_initialized`` (``ec_transfer_state.py``) and
    ``ensure_kv_transfer_initialized`` (``kv_transfer_state.py``) build them -- the same factory and class
    as the scheduler side, with the WORKER role -- but held here rather than in vLLM's process globals, so
    several workers (and several engines) can live in one process.
    """

    def __init__(
        self,
        rank: int,
        num_workers: int,
        shape: SimShape,
        vllm_config: Any,
        kv_cache_config: Any,
        sample_token: int,
    ) -> None:
        if shape.num_kv_heads % num_workers and not shape.mla:
            raise SimulationError(
                f"num_kv_heads={shape.num_kv_heads} does not split over {num_workers} workers"
            )
        self.rank = rank
        self.shape = shape
        self.sample_token = sample_token
        # MLA: every rank holds the same (whole) KV; otherwise a slice of the heads each
        local_heads = shape.num_kv_heads if shape.mla else shape.num_kv_heads // num_workers
        first = 0 if shape.mla else rank * local_heads
        self.heads = torch.arange(first, first + local_heads)
        self.layer_names = layer_names(shape)
        self.kv_caches: dict[str, torch.Tensor] = {
            name: torch.zeros(shape.num_blocks, local_heads, shape.block_size, 2 * shape.head_size)
            for name in self.layer_names
        }
        self.encoder_cache: dict[str, torch.Tensor] = {}
        self.ec_connector: Any = None
        self.kv_connector: Any = None
        ec_config = vllm_config.ec_transfer_config
        if ec_config is not None and ec_config.is_ec_transfer_instance:
            from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
            from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

            self.ec_connector = ECConnectorFactory.create_connector(
                config=vllm_config, role=ECConnectorRole.WORKER
            )
        kv_config = vllm_config.kv_transfer_config
        if kv_config is not None and kv_config.is_kv_transfer_instance:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

            self.kv_connector = KVConnectorFactory.create_connector(
                config=vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config
            )
            # gpu_model_runner.initialize_kv_cache: register after the tensors exist. vLLM then also calls
            # set_host_xfer_buffer_ops(copy_kv_blocks), a CUDA helper the simulator does not provide.
            self.kv_connector.register_kv_caches(self.kv_caches)

    # -- one step ---------------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> WorkerStepResult:
        """``GPUModelRunner.execute_model`` in miniature, connector calls in vLLM's order."""
        from vllm.v1.outputs import (
            EMPTY_MODEL_RUNNER_OUTPUT,
            ModelRunnerOutput,
            make_empty_encoder_model_runner_output,
        )

        so = plan.scheduler_output
        result = WorkerStepResult(output=EMPTY_MODEL_RUNNER_OUTPUT)
        if self.kv_connector is not None:
            self.kv_connector.handle_preemptions(so.kv_connector_metadata)
        for mm_hash in so.free_encoder_mm_hashes:  # _process_encoder_cache_scheduler_output
            self.encoder_cache.pop(mm_hash, None)
        if so.new_block_ids_to_zero:  # zeroed before any KV load of this step is started
            zero = torch.tensor(so.new_block_ids_to_zero, dtype=torch.int64)
            for kv in self.kv_caches.values():
                kv[zero] = 0

        if self.ec_connector is not None and not self.ec_connector.is_consumer:
            # The encoder-only (E) path. Like vLLM 0.32 it returns the stub from inside the context
            # manager, so this step's ECConnectorOutput never reaches the scheduler.
            with self._ec_lifecycle(so):
                self._run_encoder(plan, result)
            result.output = make_empty_encoder_model_runner_output(so)
            return result

        if not so.total_num_scheduled_tokens:
            if self.kv_connector is not None:  # kv_connector_no_forward
                with self._kv_lifecycle(so, self._forward_context(plan, with_metadata=False)) as kv_out:
                    pass
                result.output = ModelRunnerOutput.with_kv_conn_output_only(kv_out)
            return result

        ec_out = None
        if self.ec_connector is not None:
            with self._ec_lifecycle(so) as ec_out:
                self._run_encoder(plan, result)
                self._gather(plan, result)
        else:
            self._run_encoder(plan, result)
            self._gather(plan, result)

        kv_out = None
        if self.kv_connector is not None:
            with self._kv_lifecycle(so, self._forward_context(plan, with_metadata=True)) as kv_out:
                self._forward(plan)
        else:
            self._forward(plan)

        req_ids = list(so.num_scheduled_tokens)
        by_id = {row.req_id: row for row in plan.rows}
        output = ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
            sampled_token_ids=[[self.sample_token] if by_id[r].sample else [] for r in req_ids],
            kv_connector_output=kv_out,
        )
        result.output = ModelRunnerOutput.with_ec_conn_output(output, ec_out)
        return result

    # -- connector lifecycles (the two mixins) -------------------------------------------------------

    @contextmanager
    def _ec_lifecycle(self, so: Any) -> Iterator[Any]:
        """``ECConnectorModelRunnerMixin._get_ec_connector_output``."""
        from vllm.v1.outputs import ECConnectorOutput

        output = ECConnectorOutput()
        connector = self.ec_connector
        connector.bind_connector_metadata(so.ec_connector_metadata)
        if connector.is_producer:
            connector.start_save_caches(encoder_cache=self.encoder_cache)
        if connector.is_consumer:
            connector.start_load_caches(self.encoder_cache)
        try:
            yield output
        finally:
            output.finished_sending, output.finished_recving = connector.get_finished(so.finished_req_ids)
            output.ec_connector_worker_meta = connector.build_connector_worker_meta()
            connector.clear_connector_metadata()

    @contextmanager
    def _kv_lifecycle(self, so: Any, forward_context: SimForwardContext) -> Iterator[Any]:
        """``KVConnectorModelRunnerMixin._get_kv_connector_output`` (no speculative decoding, so never
        ``defer_finalize``)."""
        from vllm.v1.outputs import KVConnectorOutput

        output = KVConnectorOutput()
        connector = self.kv_connector
        connector.bind_connector_metadata(so.kv_connector_metadata)
        start_after_forward = not so.has_sync_kv_loads
        if not start_after_forward:
            connector.start_load_kv(forward_context)
        try:
            yield output
        finally:
            if start_after_forward:
                connector.start_load_kv(forward_context)
            connector.wait_for_save()
            results = connector.get_transfer_results(so.finished_req_ids)
            output.finished_sending = results.finished_sending
            output.finished_recving = results.finished_recving
            output.failed_recving = results.failed_recving
            output.invalid_block_ids = connector.get_block_ids_with_load_errors()
            output.kv_connector_stats = connector.get_kv_connector_stats()
            output.kv_cache_events = connector.get_kv_connector_kv_cache_events()
            output.kv_connector_worker_meta = connector.build_connector_worker_meta()
            connector.clear_connector_metadata()

    # -- the "model" ---------------------------------------------------------------------------------

    def _run_encoder(self, plan: StepPlan, result: WorkerStepResult) -> None:
        """Encode the scheduled items not already in the cache (a connector may just have loaded them),
        then offer each output to the connector, as ``_cache_encoder_output`` does."""
        for item in plan.encoder_items:
            if item.mm_hash in self.encoder_cache:
                continue
            self.encoder_cache[item.mm_hash] = embedding_for(
                item.mm_hash, item.length, self.shape.hidden_size
            )
            result.encoded.append((item.req_id, item.mm_hash))
            if self.ec_connector is not None:
                self.ec_connector.save_caches(encoder_cache=self.encoder_cache, mm_hash=item.mm_hash)

    def _gather(self, plan: StepPlan, result: WorkerStepResult) -> None:
        """``_gather_mm_embeddings``: every row a scheduled token needs must be in the encoder cache.

        A miss fails the step as it does in vLLM (both GPU model runners raise ``RuntimeError("Encoder cache
        miss for <hash>.")``, which takes the engine down): a connector that lets vLLM plan no encoder run
        for an item it then fails to install is caught here, never papered over."""
        for row in plan.rows:
            for rows in row.gathers:
                cached = self.encoder_cache.get(rows.mm_hash)
                if cached is None or cached.shape[0] < rows.end:
                    raise SimulationError(
                        f"Encoder cache miss for {rows.mm_hash}. Request {rows.req_id} needs rows "
                        f"{rows.start}:{rows.end}, neither encoded nor loaded (vLLM's runner raises the "
                        "same on an encoder cache miss, and its engine dies)"
                    )
                result.gathered.append((rows, cached[rows.start : rows.end]))

    def _forward_context(self, plan: StepPlan, *, with_metadata: bool) -> SimForwardContext:
        slots = (
            torch.cat([row.slot_mapping for row in plan.rows])
            if plan.rows
            else torch.empty(0, dtype=torch.int64)
        )
        metadata = SimAttentionMetadata(slot_mapping=slots, num_actual_tokens=int(slots.numel()))
        return SimForwardContext(
            no_compile_layers={name: _SimAttentionLayer(kv) for name, kv in self.kv_caches.items()},
            attn_metadata={name: metadata for name in self.layer_names} if with_metadata else None,
            slot_mapping={name: slots for name in self.layer_names},
        )

    def _forward(self, plan: StepPlan) -> None:
        """Per layer, the ``maybe_transfer_kv_layer`` wrapper: wait for the layer's load, "attend" (write
        this step's KV into its slots), offer the layer to the connector for saving."""
        if not plan.rows:
            return
        token_ids = torch.cat([row.token_ids for row in plan.rows])
        positions = torch.cat([row.positions for row in plan.rows])
        slots = torch.cat([row.slot_mapping for row in plan.rows])
        blocks, offsets = slots // self.shape.block_size, slots % self.shape.block_size
        width = 2 * self.shape.head_size
        connector = self.kv_connector
        hooked = connector is not None and connector.has_connector_metadata()
        metadata = SimAttentionMetadata(slot_mapping=slots, num_actual_tokens=int(slots.numel()))
        for index, name in enumerate(self.layer_names):
            kv = self.kv_caches[name]
            if hooked:
                connector.wait_for_layer_load(name)
            kv[blocks, :, offsets] = kv_values(token_ids, positions, index, self.heads, width)
            if hooked:
                connector.save_kv_layer(name, kv, metadata)

    def read_kv(self, block_ids: list[int], num_tokens: int) -> dict[str, torch.Tensor]:
        """This worker's KV for the first ``num_tokens`` positions of a block table, per layer,
        ``[num_tokens, local_heads, 2 * head_size]`` (copies: the caller may keep them)."""
        positions = torch.arange(num_tokens)
        table = torch.tensor(block_ids, dtype=torch.int64)
        blocks = table[positions // self.shape.block_size]
        offsets = positions % self.shape.block_size
        return {name: kv[blocks, :, offsets].clone() for name, kv in self.kv_caches.items()}

    def shutdown(self) -> None:
        """Shut both connectors down; safe to call twice."""
        for connector in (self.ec_connector, self.kv_connector):
            if connector is not None:
                connector.shutdown()
        self.ec_connector = self.kv_connector = None
        self.encoder_cache.clear()


def copy_output(output: Any) -> Any:
    """A shallow copy, so aggregation never writes into vLLM's shared ``EMPTY_MODEL_RUNNER_OUTPUT``."""
    return copy.copy(output)
