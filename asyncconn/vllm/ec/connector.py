"""``AsyncConnECConnector``: vLLM's EC connector interface, as a facade over :mod:`ec_scheduler` /
:mod:`ec_worker`.

Loaded by vLLM with::

    ECTransferConfig(ec_connector="AsyncConnECConnector", ec_connector_module_path="asyncconn.vllm",
                     ec_role="ec_producer" | "ec_consumer" | "ec_both",
                     ec_connector_extra_config={"backend_url": "redis://...", ...})

vLLM builds one instance per role: the scheduler process gets a scheduler-side one, each worker a
worker-side one. Each builds exactly one of :class:`~asyncconn.vllm.ec.scheduler.ECSchedulerSide` or
:class:`~asyncconn.vllm.ec.worker.ECWorkerSide` and delegates; this module only adapts types and roles.
Settings come from ``ec_connector_extra_config`` (:class:`~asyncconn.config.Settings`): a bad key fails at
engine start-up, naming it. Event counts (lookups, deferrals, prefetches, installs, loads, saves,
failures) are exported through vLLM's EC connector stats (``get_ec_connector_stats`` /
``build_ec_connector_stats``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
    ECConnectorWorkerMetadata,
)
from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorStats

from asyncconn.config import Settings
from asyncconn.lookup import EXISTS, LookupConfig, open_lookup_client
from asyncconn.vllm.checks import check_extra_config
from asyncconn.vllm.ec.metadata import ECStepMetadata, ECWorkerReport
from asyncconn.vllm.ec.scheduler import ECSchedulerSide
from asyncconn.vllm.ec.worker import ECWorkerSide
from asyncconn.vllm.logs import follow_vllm_logging, log_start
from asyncconn.vllm.roles import RoleSides
from asyncconn.vllm.shutdown import worker_close_budget
from asyncconn.vllm.totals import store_totals

__all__ = ["AsyncConnECConnector", "AsyncConnECStats"]


@dataclass
class AsyncConnECStats(ECConnectorStats):  # type: ignore[misc]
    """Counters since the last interval, summed across workers and the scheduler (plain ints: picklable)."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: ECConnectorStats) -> ECConnectorStats:
        merged = collections.Counter(self.data)
        merged.update(other.data)
        return AsyncConnECStats(data=dict(merged))

    def reduce(self) -> dict[str, int | float]:
        return dict(sorted(self.data.items()))

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _expected_workers(vllm_config: Any) -> int:
    """Workers that each report an item staged before it counts as ready (as vLLM's own CPU EC connector
    counts them); the scheduler also learns the real number from the workers' heartbeats."""
    pc = vllm_config.parallel_config
    if getattr(pc, "distributed_executor_backend", None) != "mp":
        return 1
    return int(pc.tensor_parallel_size) * int(getattr(pc, "prefill_context_parallel_size", 1) or 1)


class AsyncConnECConnector(
    ECConnectorBase,  # type: ignore[misc]  # vLLM is not followed
    RoleSides[ECSchedulerSide, ECWorkerSide],
):
    """Non-blocking EC connector over any asyncconn store (see the package docstring for the lifecycle)."""

    connector_kind = "EC"

    def __init__(self, vllm_config: Any, role: ECConnectorRole) -> None:
        super().__init__(vllm_config, role)
        ec_config = vllm_config.ec_transfer_config
        # No EC class method sees this before the engine starts (vLLM 0.32); the worker-side connector is
        # built before the model loads, in the worker's init_device, so a bad key still fails early there.
        follow_vllm_logging()
        extra = ec_config.ec_connector_extra_config
        self.settings: Settings = check_extra_config(extra, "ec_connector_extra_config")
        self._scheduler: ECSchedulerSide | None = None
        self._worker: ECWorkerSide | None = None
        if role == ECConnectorRole.SCHEDULER:
            lookup = open_lookup_client(LookupConfig.from_settings(self.settings), EXISTS)
            self._scheduler = ECSchedulerSide(
                self.settings,
                lookup,
                producer=self.is_producer,
                consumer=self.is_consumer,
                expected_workers=_expected_workers(vllm_config),
            )
            server = self.settings.lookup_server
            where = f"lookup server {server}" if server else "the store"
            log_start("EC", f"scheduler ({ec_config.ec_role})", self.settings, lookups=where)
        else:
            self._worker = ECWorkerSide(self.settings, producer=self.is_producer, consumer=self.is_consumer)
            log_start("EC", f"worker ({ec_config.ec_role})", self.settings)
        self._reported: dict[str, int] = {}

    # -- the one object this facade delegates to -------------------------------------------------------
    # -- scheduler side ---------------------------------------------------------------------------------
    def has_cache_item(self, identifier: str) -> bool:
        return self.scheduler_side.has_cache_item(identifier)

    def ensure_cache_available(self, request: Any, num_computed_tokens: int) -> bool:
        return self.scheduler_side.ensure_cache_available(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, index: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, index)

    def build_connector_meta(self, scheduler_output: Any) -> ECConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        report = getattr(connector_output, "ec_connector_worker_meta", None)
        if isinstance(report, ECWorkerReport):
            self.scheduler_side.update_connector_output(report)

    def request_finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)

    def take_unavailable_requests(self) -> set[str]:
        return self.scheduler_side.take_unavailable_requests()

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def get_ec_connector_stats(self) -> ECConnectorStats | None:
        """Event counts since the previous call: the scheduler side's ``totals()`` (the workers' included)
        and the lookup client's (timeouts, errors)."""
        if self._scheduler is None:
            return None
        # Called by vLLM on every step: compare a few ints, build nothing unless something changed.
        reported, delta = self._reported, {}
        client = self._scheduler.lookup
        lookup = client.metrics
        current = self._scheduler.totals()  # the workers' reports included (a copy: ours to add to)
        current.update(
            lookup_timeouts=lookup.timeouts, lookup_errors=lookup.errors, lookup_rejected=lookup.rejected
        )
        current.update(store_totals(getattr(client, "store_reachability", None)))  # + the workers' gauge
        for name, value in current.items():
            before = reported.get(name, 0)
            if value != before:
                delta[name] = value - before
                reported[name] = value
        return AsyncConnECStats(data=delta) if delta else None

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECConnectorStats | None:
        return AsyncConnECStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Our counters on vLLM's ``/metrics`` (``asyncconn:ec_*``; asyncconn.vllm.prom)."""
        from asyncconn.vllm.prom import ec_prom_metrics

        return ec_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- worker side ------------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        if not self.is_consumer:
            return
        meta = self._connector_metadata
        if isinstance(meta, ECStepMetadata):
            self.worker_side.start_load_caches(encoder_cache, meta)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if self.is_producer:  # vLLM calls this for every encoder output, whatever the role
            self.worker_side.save_caches(encoder_cache, mm_hash)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self.worker_side.end_step()
        return None, None

    def build_connector_worker_meta(self) -> ECConnectorWorkerMetadata | None:
        return self.worker_side.report()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()
        if self._worker is not None:
            self._worker.close(worker_close_budget())
