"""``AsyncConnTier``: any asyncconn store as a secondary tier of vLLM's OffloadingConnector.

vLLM's ``TieringOffloadingManager`` (the scheduler side of ``OffloadingConnector`` with
``TieringOffloadingSpec``) keeps a CPU primary tier next to the GPU and cascades every chunk it stores
there to each secondary tier; a chunk found only in a secondary tier is promoted back into a primary slot
before the GPU loads it. This tier is that secondary tier for Redis, Redis Cluster, Mooncake, a shared
directory or memory -- whatever ``backend_url`` names.

All of it runs on vLLM's scheduler thread and returns at once: lookups follow vLLM's asynchronous
contract (:mod:`asyncconn.vllm.tier.lookups`), transfers are coroutines on asyncconn's loop thread
(:mod:`asyncconn.vllm.tier.io`) whose futures ``get_finished_jobs`` polls with ``done()``. Only
``drain_jobs`` and ``shutdown`` wait, as vLLM's contract demands, and every store call they wait for is
bounded by ``store_timeout``. A store that fails or hangs makes misses and failed transfers (vLLM then
recomputes), never a wrong byte in a primary slot.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from asyncconn.config import Settings
from asyncconn.exceptions import BackendTimeout
from asyncconn.runtime import Runtime, get_runtime
from asyncconn.store import TensorStore
from asyncconn.url import redact
from asyncconn.vllm.logs import follow_vllm_logging, warn_inline_password
from asyncconn.vllm.tier.io import Outcome, TierIO
from asyncconn.vllm.tier.lookups import TierLookups
from asyncconn.vllm.tier.names import TierNames, namespace
from asyncconn.vllm.tier.settings import TIER_FIELD, TierSettings

__all__ = ["AsyncConnTier"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Job:
    keys: list[OffloadKey]
    is_load: bool
    future: concurrent.futures.Future[Outcome]


class AsyncConnTier(SecondaryTierManager):  # type: ignore[misc]  # vLLM is not followed
    """A secondary tier over one asyncconn store (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE
    # Not DISK: the store may be memory on another host. vLLM reports such hits as external.
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        follow_vllm_logging()
        self.settings = settings = TierSettings.from_tier_config(config)
        warn_inline_password(Settings(backend_url=settings.backend_url), TIER_FIELD)
        self.locality = Locality(settings.locality) if settings.locality is not None else None
        row = self.block_size_bytes
        self._names = TierNames(namespace(offloading_spec.config, row), settings.key_prefix)
        # One flat byte view of the primary tier, released at shutdown (vLLM closes the mmap after).
        self._flat = primary_kv_view.cast("B")
        try:
            store = self._open()
        except BaseException:
            self._flat.release()
            raise
        self.io = TierIO(
            store,
            self._flat,
            row_bytes=row,
            max_inflight=settings.max_inflight_transfers,
            lookup_timeout=min(settings.lookup_timeout, settings.store_timeout),
        )
        self.lookups: TierLookups[OffloadKey] = TierLookups(self._ask, settings.lookup_max_pending)
        self._running: dict[JobId, _Job] = {}
        self._closed = False
        log.info(
            "asyncconn offloading tier %r started: store=%s, chunk=%d bytes, names=%s...",
            tier_type,
            redact(settings.backend_url),
            row,
            self._names.name(b"")[:-1],
        )

    def _open(self) -> TensorStore:
        settings = self.settings
        self._runtime: Runtime = get_runtime()
        try:
            return self._runtime.run(
                TensorStore.open(
                    settings.backend_url,
                    timeout=settings.store_timeout,
                    connect_timeout=settings.connect_timeout,
                ),
                timeout=settings.connect_timeout + 1.0,
            )
        except concurrent.futures.TimeoutError:
            raise BackendTimeout(
                f"{redact(settings.backend_url)}: not open after {settings.connect_timeout:g}s"
            ) from None

    # -- lookups ---------------------------------------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.lookups.lookup(key, req_context.req_id)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _ask(self, keys: list[OffloadKey]) -> concurrent.futures.Future[list[bool]]:
        return self._runtime.submit(self.io.exists(self._names.names(keys)))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.lookups.release(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.lookups.flush()

    # -- transfers -------------------------------------------------------------------------------------
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, is_load=True)

    def _submit(self, job: TransferJob, *, is_load: bool) -> None:
        keys = list(job.keys)
        row, size = self.block_size_bytes, self._flat.nbytes
        offsets = [int(chunk) * row for chunk in job.chunk_ids]
        future: concurrent.futures.Future[Outcome]
        if len(offsets) != len(keys) or any(not 0 <= o <= size - row for o in offsets):
            # Never reached with vLLM's own bookkeeping; a slice would clamp silently, so refuse the job.
            log.error("%s: job %d names chunks outside the primary tier; failed", self.tier_type, job.job_id)
            future = concurrent.futures.Future()
            future.set_result(Outcome([False] * len(keys), 0.0))
        else:
            chunks = list(zip(self._names.names(keys), offsets, strict=True))
            future = self._runtime.submit(self.io.read(chunks) if is_load else self.io.write(chunks))
        self._running[job.job_id] = _Job(keys, is_load, future)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        for job_id, job in list(self._running.items()):
            if job.future.done():
                del self._running[job_id]
                results.append(self._result(job_id, job))
        return results

    def _result(self, job_id: JobId, job: _Job) -> JobResult:
        try:
            outcome = job.future.result()
        except Exception as exc:  # the I/O answers store errors itself; this is a bug: fail the job, say so
            log.warning("%s: job %d failed: %r", self.tier_type, job_id, exc)
            outcome = Outcome([False] * len(job.keys), 0.0)
        moved = sum(outcome.ok)
        success = moved == len(job.keys)
        successful: Sequence[OffloadKey] | None = None
        if job.is_load and not success:
            self.lookups.mark_miss([k for k, ok in zip(job.keys, outcome.ok, strict=True) if not ok])
            successful = tuple(k for k, ok in zip(job.keys, outcome.ok, strict=True) if ok) or None
        return JobResult(
            job_id=job_id,
            success=success,
            successful_keys=successful,
            transfer_time=outcome.seconds,
            transfer_bytes=moved * self.block_size_bytes,
        )

    def has_pending_work(self) -> bool:
        return bool(self._running) or self.lookups.busy()

    def drain_jobs(self) -> None:
        """Wait for every submitted job; chunks that have not started fail at once instead of starting."""
        self.io.draining = True
        try:
            concurrent.futures.wait([job.future for job in self._running.values()])
        finally:
            self.io.draining = False

    def pending(self) -> dict[str, int]:
        """What the tier still holds: jobs, presence checks in flight, tracked chunks (0 when idle)."""
        return {
            "jobs": len(self._running),
            "checks": len(self.lookups.futures()),
            "tracked": self.lookups.tracked(),
        }

    def shutdown(self) -> None:
        """Finish the jobs (waiting chunks fail at once), close the store, let go of the primary memory.

        A job still running past its bound raises: vLLM then keeps the primary mmap, which that job may
        still write (its rule for a failed tier shutdown).
        """
        if self._closed:
            return
        self._closed = True
        self.io.draining = True
        bound = max(self.settings.store_timeout, self.settings.lookup_timeout) + 2.0
        jobs = [job.future for job in self._running.values()]
        waiting: list[concurrent.futures.Future[Any]] = [*jobs, *self.lookups.futures()]
        concurrent.futures.wait(waiting, timeout=bound)
        try:
            self._runtime.run(self.io.store.close(), timeout=self.settings.connect_timeout)
        except Exception as exc:
            log.warning("%s: closing the store failed: %r", self.tier_type, exc)
        late = sum(not future.done() for future in jobs)  # presence checks never touch the primary
        if late:
            raise BackendTimeout(f"{self.tier_type}: {late} transfers still running after {bound:g}s")
        self._flat.release()
