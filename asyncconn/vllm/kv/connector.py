"""``AsyncConnKVConnector``: vLLM's KV connector interface over asyncconn's lookup and transfer engines.

Loaded by vLLM with::

    KVTransferConfig(kv_connector="AsyncConnKVConnector", kv_connector_module_path="asyncconn.vllm",
                     kv_role="kv_both", kv_connector_extra_config={"backend_url": "redis://host:6379/0"})

A facade: the constructor builds exactly one :class:`~asyncconn.vllm.kv.scheduler.KVSchedulerSide` (scheduler
role) or :class:`~asyncconn.vllm.kv.worker.KVWorkerSide` (worker role) and every method delegates to it. The
roles: ``kv_producer`` saves and never loads (no lookups), ``kv_consumer`` loads and never saves,
``kv_both`` does both.

Hybrid allocator (``SupportsHMA``): full-attention, MLA, sliding-window and chunked-local groups of one block
size are accepted; each value carries every layer's blocks at its group's ids, and a windowed group is
skipped where vLLM gave it the null block (:mod:`asyncconn.vllm.kv.groups`). Mamba and other group kinds
are refused at start-up with a message saying what to do, rather than saving KV that could not be reused.
With more than one group a failed load is reported per request (``failed_recving``), as vLLM requires there,
and ``kv_sync_loads`` is refused at start-up (:mod:`asyncconn.vllm.kv.failures`).

Routers and metrics (:mod:`asyncconn.vllm.kv.events`): with vLLM's KV events on (``--kv-events-config``), a
producer publishes ``BlockStored`` for each value its workers confirmed in the store (and ``BlockRemoved``
for removals a source reports), with the store's tier as ``medium``, and, with a host tier, the tiers' own
residency (:mod:`asyncconn.vllm.kv.tierevents`); external hits are counted under the store's
``CacheHitSource`` (``vllm:prompt_tokens_cached_by_source``), the host tiers' under ``host``, the local
store's (``local_store_url``) under ``disk`` (:mod:`asyncconn.vllm.kv.localstore`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from asyncconn.config import Settings
from asyncconn.exceptions import BackendTimeout
from asyncconn.lookup import EXISTS, PREFIX, LookupClient, LookupConfig, open_lookup_client
from asyncconn.runtime import get_runtime
from asyncconn.store import TensorStore
from asyncconn.transfer import PinnedPool, SaveTracker, StreamLoader, engine_devices
from asyncconn.url import redact
from asyncconn.vllm.checks import check_extra_config
from asyncconn.vllm.kv.events import KVEvents, SaveReports, tier_of
from asyncconn.vllm.kv.groups import GroupLayout, check_groups, check_sync_loads
from asyncconn.vllm.kv.hostclaims import HostClaims, register_tier, unregister_tier
from asyncconn.vllm.kv.keys import KeySpace, KVIdentity
from asyncconn.vllm.kv.localevents import LocalMirror, LocalNews, LocalTierEvents
from asyncconn.vllm.kv.localstore import LocalStoreHits
from asyncconn.vllm.kv.metadata import AsyncConnKVMetadata, AsyncConnKVStats
from asyncconn.vllm.kv.parts import ValueParts
from asyncconn.vllm.kv.recheck import ResidencyRecheck, StoreResidency
from asyncconn.vllm.kv.scheduler import KVSchedulerSide
from asyncconn.vllm.kv.stages import StageSpaces
from asyncconn.vllm.kv.tierevents import TierEvents
from asyncconn.vllm.kv.tiernews import TierMirror, WorkerTierNews
from asyncconn.vllm.kv.worker import KVWorkerSide
from asyncconn.vllm.logs import follow_vllm_logging, log_start
from asyncconn.vllm.roles import RoleSides
from asyncconn.vllm.shutdown import worker_close_budget

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["AsyncConnKVConnector"]


_FIELD = "kv_connector_extra_config"
log = logging.getLogger(__name__)


def _lookups(settings: Settings, lookup: object) -> str:
    """Where the scheduler's lookups go, for the start-up line."""
    if lookup is None:
        return "none (producer)"
    return f"lookup server {settings.lookup_server}" if settings.lookup_server else "the store"


def _tensor_parallel(vllm_config: Any) -> tuple[int, int]:
    """(tp_size, rank): vLLM's TP group when it is initialized (a real worker), else the config and 0."""
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return (
                parallel_state.get_tensor_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_rank(),
            )
    except (ImportError, AssertionError):
        pass
    return int(vllm_config.parallel_config.tensor_parallel_size), 0


def _pipeline_size(vllm_config: Any) -> int:
    return int(getattr(vllm_config.parallel_config, "pipeline_parallel_size", 1) or 1)


def _pipeline_stage() -> int:
    """This worker's pipeline stage: vLLM's PP group when it is initialized (a real worker), else 0."""
    try:
        from vllm.distributed import parallel_state

        if parallel_state.model_parallel_is_initialized():
            return int(parallel_state.get_pp_group().rank_in_group)
    except (ImportError, AssertionError):
        pass
    return 0


#: How the scheduler follows the workers' host tiers (see ``AsyncConnKVConnector.__init__``).
TierMode = Literal["none", "claims", "reports"]


def _tier_mode(followed: bool, events: bool, consumer: bool, workers: int, in_process: bool) -> TierMode:
    """``reports`` with KV events (the tiers' events), several workers (TP ranks times pipeline stages),
    or a worker in a process of its own; ``claims`` for one worker in the scheduler's process without
    events; ``none`` without a tier followed, or when nothing needs the tiers."""
    if not followed:
        return "none"
    if events:
        return "reports"
    if not consumer:
        return "none"
    return "claims" if workers == 1 and in_process else "reports"


def _worker_in_scheduler_process(vllm_config: Any) -> bool:
    """Whether vLLM runs the worker in the scheduler's process: its uniprocess executor (and the external
    launcher's, one of them). Why it matters: vLLM's CPU platform turns ``uni`` into ``mp`` whenever
    engine multiprocessing is on (``vllm serve``'s default), so one rank alone does not say it."""
    backend = getattr(vllm_config.parallel_config, "distributed_executor_backend", None)
    if isinstance(backend, type):
        try:
            from vllm.v1.executor.uniproc_executor import UniProcExecutor
        except ImportError:
            return False
        return issubclass(backend, UniProcExecutor)
    return backend in ("uni", "external_launcher")


def _kv_events_on(vllm_config: Any) -> bool:
    """vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


def _hit_source(name: str) -> Any:
    """vLLM's ``CacheHitSource`` member ``name`` (None where this vLLM has no such enum)."""
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:
        return None
    return CacheHitSource(name)


class AsyncConnKVConnector(
    KVConnectorBase_V1,  # type: ignore[misc]  # vLLM is not followed
    SupportsHMA,  # type: ignore[misc]
    RoleSides[KVSchedulerSide, KVWorkerSide],
):
    """The facade vLLM loads; see the module docstring."""

    connector_kind = "KV"

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        config = self._kv_transfer_config
        follow_vllm_logging()
        self.settings: Settings = check_extra_config(config.kv_connector_extra_config, _FIELD)
        groups = check_groups(kv_cache_config)
        check_sync_loads(groups, self.settings.kv_sync_loads)
        tp_size, rank = _tensor_parallel(vllm_config)
        self._identity = KVIdentity.from_vllm(
            vllm_config, kv_cache_config, tp_size=tp_size, blocks_per_value=self.settings.kv_blocks_per_value
        )
        self._groups = groups
        parts = ValueParts.of(KeySpace(self._identity, self.settings.key_prefix), groups)
        keys = parts.keys[0]  # what events name values by: their first part's keys
        self._scheduler: KVSchedulerSide | None = None
        self._worker: KVWorkerSide | None = None
        self.tier = tier_of(self.settings.backend_url)
        source = _hit_source(self.tier.hit_source)
        if source is not None:  # what vLLM's get_external_cache_hit_sources counts our hits under
            self._cache_hit_source = source
        # How the scheduler follows the workers' host tiers is chosen here, once (``_tier_mode``): not at
        # all (no tier; pipeline parallelism with values stored in parts); one rank in the scheduler's
        # process without KV events, the scheduler claims in its worker's tier, registered under
        # ``_tier_name``; several ranks (of one stage or several), a worker process of its own, or KV
        # events on, the workers report their tiers and the scheduler mirrors them (hits counted as
        # ``host``, the tiers' own events). A later pipeline stage's keys are learnt from its workers'
        # reports (``StageSpaces``, one for every follower).
        self._tier_name = f"{config.engine_id}/{keys.namespace.hex()}"
        # Which residencies vLLM's KV events carry (``kv_events``): the store's, the host tiers', or both.
        scope = self.settings.kv_events if _kv_events_on(vllm_config) and config.is_kv_producer else "none"
        events = scope in ("all", "store")
        self._stages = stages = _pipeline_size(vllm_config)
        followable = stages == 1 or len(parts.keys) == 1  # a later stage's parts are its own groups'
        self._tier_followed = self.settings.host_cache_bytes > 0 and followable
        self._tier_events = self._tier_followed and scope in ("all", "host")
        # The local store's residency, also this host's: published with the host tiers'.
        self._local_events = (
            self.settings.local_store_url is not None and followable and scope in ("all", "host")
        )
        self._in_process = _worker_in_scheduler_process(vllm_config)
        self._tier_mode = _tier_mode(
            self._tier_followed, self._tier_events, config.is_kv_consumer, tp_size * stages, self._in_process
        )
        if role == KVConnectorRole.SCHEDULER:
            lookup = None
            if config.is_kv_consumer:
                lookup = open_lookup_client(LookupConfig.from_settings(self.settings), PREFIX)
            spaces = StageSpaces(keys, stages)
            kv_events = (
                KVEvents(keys, self.tier, store=events, stages=stages, spaces=spaces)
                if events or self._tier_events or self._local_events
                else None
            )
            self._scheduler = KVSchedulerSide(
                keys,
                lookup=lookup,
                save=config.is_kv_producer,
                sync_lookup=self.settings.sync_lookup,
                sync_loads=self.settings.kv_sync_loads,
                events=kv_events,
                parts=parts,
                local_store=self._local_store_hits(parts) if lookup is not None else None,
                spaces=spaces,
                recheck=self._recheck(kv_events, parts, lookup) if events else None,
            )
            if events and lookup is not None:  # what its own lookup store removes (a file:// sweep)
                self._scheduler.own_removals.hear_shared(lookup)
            self._follow_local_store(self._scheduler, parts, tp_size)
            self._follow_tiers(self._scheduler, parts)
            where = _lookups(self.settings, lookup)
            log_start("KV", f"scheduler ({config.kv_role})", self.settings, lookups=where)
        else:
            self._worker = self._build_worker(parts, groups, rank, kv_cache_config, events=events)
            log_start("KV", f"worker rank {rank} of {tp_size} ({config.kv_role})", self.settings)

    def _recheck(
        self, events: KVEvents | None, parts: ValueParts, lookup: LookupClient[int] | None
    ) -> ResidencyRecheck | None:
        """With the store's KV events on and ``kv_events_recheck`` set: the announced values asked about again
        on a timer (:mod:`asyncconn.vllm.kv.recheck`), in the key space a lookup asks first (a split hybrid
        model's whole parts), through a lookup client of their own that shares the prefix lookups' store
        (a second store client would be a second Mooncake segment in this process)."""
        interval = self.settings.kv_events_recheck
        space = parts.keys[parts.whole] if parts.whole is not None else None
        if events is None or interval <= 0 or space is None:
            return None
        shared = lookup.store if lookup is not None else None
        client = open_lookup_client(LookupConfig.from_settings(self.settings), EXISTS, store=shared)
        return ResidencyRecheck(StoreResidency(events, space), client, interval=interval)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """No (asyncconn has no layer-wise work a CUDA graph could skip); used to check ``extra_config``.

        Why here: it is the one class method vLLM calls with the connector's extra config while it builds
        its configuration -- in the front-end process, before any engine process starts or the model loads
        (``VllmConfig.__post_init__``, whenever CUDA graphs include full graphs: vLLM's default on CUDA; not
        on CPU or with ``--enforce-eager``, where the constructor's own check is the first). A bad key,
        value, URL or password source fails the engine's start there, in one message.
        """
        follow_vllm_logging()
        check_extra_config(extra_config, _FIELD)
        return False

    def _build_worker(
        self,
        parts: ValueParts,
        groups: GroupLayout,
        rank: int,
        kv_cache_config: Any,
        *,
        events: bool,
    ) -> KVWorkerSide:
        settings = self.settings
        runtime = get_runtime()
        load_device, save_device = engine_devices()  # a side stream each: loads never queue behind saves
        try:
            store = runtime.run(
                TensorStore.open(
                    settings.backend_url,
                    timeout=settings.store_timeout,
                    connect_timeout=settings.connect_timeout,
                    host_cache_bytes=settings.host_cache_bytes,
                    local_url=settings.local_store_url,
                    # On CUDA the tier's memory is page-locked, like staging (not run on a GPU yet).
                    host_memory=load_device.alloc_host if load_device.pinned else None,
                ),
                timeout=settings.connect_timeout + 1.0,
            )
        except concurrent.futures.TimeoutError:
            raise BackendTimeout(
                f"{redact(settings.backend_url)}: not open after {settings.connect_timeout:g}s"
            ) from None
        pool = PinnedPool(settings.pinned_pool_bytes, device=load_device)
        loader = StreamLoader(  # rows: a poll's values scattered together from one tensor (CUDA)
            store,
            runtime=runtime,
            device=load_device,
            pool=pool,
            max_inflight=settings.max_inflight_loads,
            rows=True,
        )
        saver = SaveTracker(
            store, runtime=runtime, device=save_device, pool=pool, skip_existing=settings.save_skip_existing
        )
        return KVWorkerSide(
            parts.keys[0],
            store=store,
            loader=loader,
            saver=saver,
            runtime=runtime,
            layers=groups.layers,
            group_of_layer=groups.group_of_layer,
            num_blocks=int(kv_cache_config.num_blocks),
            rank=rank,
            load_timeout=settings.load_timeout,
            preempt_timeout=settings.preempt_timeout,
            windowed=groups.windowed,
            events=SaveReports() if events else None,
            parts=parts,
            num_groups=groups.num_groups,
            tier_news=self._worker_tier(store),
            local_news=LocalNews() if self._local_events else None,
            stage=_pipeline_stage(),
        )

    def _follow_tiers(self, scheduler: KVSchedulerSide, parts: ValueParts) -> None:
        """The scheduler's way to follow the workers' host tiers (see __init__): which planned tokens they
        serve (``host``) and, with KV events, their events."""
        if scheduler.host is not None:
            scheduler.host.close()
        if scheduler.tier_events is not None:
            scheduler.tier_events.close()
        scheduler.host = scheduler.tier_events = None
        block_size = self._identity.block_size
        if self._tier_mode == "claims":
            scheduler.host = HostClaims(self._tier_name, parts, block_size)
        elif self._tier_mode == "reports":
            mirror = TierMirror(parts, self._identity.tp_size, block_size, scheduler.spaces)
            scheduler.host = mirror
            if self._tier_events and scheduler.events is not None:
                scheduler.tier_events = TierEvents(scheduler.events, mirror)

    def _follow_local_store(self, scheduler: KVSchedulerSide, parts: ValueParts, tp_size: int) -> None:
        """The local store's own KV events (see __init__), where they are published, and with
        ``kv_events_recheck`` the directory asked again about the values they follow, through a lookup
        client sharing the ``disk`` hits' store where there is one (:mod:`asyncconn.vllm.kv.recheck`); what
        this process's store of the directory removes is heard (:mod:`asyncconn.vllm.kv.ownremovals`)."""
        if scheduler.local_recheck is not None:
            scheduler.local_recheck.close()
        if scheduler.local_events is not None:
            scheduler.local_events.close()
        scheduler.local_events = scheduler.local_recheck = None
        if self._local_events and scheduler.events is not None:
            mirror = LocalMirror(parts, tp_size, scheduler.spaces)
            scheduler.local_events = events = LocalTierEvents(scheduler.events, mirror)
            hits = scheduler.local_store
            asks = hits.lookup if hits is not None else None  # the client whose store of it is heard
            if self.settings.kv_events_recheck > 0:
                shared = asks.store if asks is not None else None
                client = open_lookup_client(self._local_lookup_config(), EXISTS, store=shared)
                interval = self.settings.kv_events_recheck
                scheduler.local_recheck = ResidencyRecheck(events, client, interval=interval)
                asks = client  # its store: the one it shares, or its own
            scheduler.own_removals.hear_local(asks)  # what is removed from the directory

    def _local_lookup_config(self) -> LookupConfig:
        """Lookups of the local store (``local_store_url``): asked directly, never of a lookup server."""
        assert self.settings.local_store_url is not None
        shared = LookupConfig.from_settings(self.settings)
        return dataclasses.replace(
            shared, backend_url=self.settings.local_store_url, lookup_server=None, lookup_server_key=None
        )

    def _local_store_hits(self, parts: ValueParts) -> LocalStoreHits | None:
        """The scheduler's questions to the local store (``local_store_url``), to count its hits as
        ``disk``: none without one, nor for values stored in parts (:mod:`asyncconn.vllm.kv.localstore`)."""
        if self.settings.local_store_url is None or len(parts.keys) != 1:
            return None
        # Every stage's keys of a value (asyncconn.vllm.kv.stages): each stage reads its own from the disk.
        per_value = parts.keys[0].keys_per_value * self._stages
        return LocalStoreHits(open_lookup_client(self._local_lookup_config(), EXISTS), per_value)

    def _worker_tier(self, store: TensorStore) -> WorkerTierNews | None:
        """Claims: the tier registered for the scheduler in this process; reports: reporting to it."""
        tier = store.host_tier
        if tier is None or self._tier_mode == "none":
            return None
        if self._tier_mode == "claims":
            register_tier(self._tier_name, tier)
            return None
        return WorkerTierNews(tier.lru)

    # -- the one object this facade delegates to -------------------------------------------------------
    def configure_tensor_parallel(self, tp_size: int, rank: int = 0) -> None:
        """Override the TP size (and a worker's rank) where vLLM's TP group is not set up (simulators)."""
        self._identity = dataclasses.replace(self._identity, tp_size=tp_size)
        consumer = self._kv_transfer_config.is_kv_consumer
        self._tier_mode = _tier_mode(
            self._tier_followed, self._tier_events, consumer, tp_size * self._stages, self._in_process
        )
        parts = ValueParts.of(KeySpace(self._identity, self.settings.key_prefix), self._groups)
        keys = parts.keys[0]
        if self._scheduler is not None:
            self._scheduler.keys, self._scheduler.parts = keys, parts
            self._scheduler.spaces.reset(keys)  # (the events' too: one object)
            self._follow_tiers(self._scheduler, parts)
            self._follow_local_store(self._scheduler, parts, tp_size)
            if self._scheduler.recheck is not None:  # it asks in the new key space
                self._scheduler.recheck.close()
                self._scheduler.recheck = self._recheck(self._scheduler.events, parts, self._scheduler.lookup)
        if self._worker is not None:
            self._worker.keys, self._worker.parts = keys, parts
            self._worker.set_rank(rank)
            tier = self._worker.store.host_tier
            if tier is not None and self._worker.tier_news is None:
                unregister_tier(self._tier_name, tier)
                self._worker.tier_news = self._worker_tier(self._worker.store)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never a correctness problem."""
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No. vLLM 0.33 frees the KV cache at sleep and maps fresh memory at wake-up, while the worker's
        loads and deferred saves hold the tensors registered at start-up (``unregister_kv_caches`` /
        ``restore_kv_caches`` are not implemented). Saying so makes vLLM refuse ``enable_sleep_mode`` with
        this connector at start-up (a ``ValueError`` from ``VllmConfig``) instead of writing into freed
        memory later. vLLM 0.32 has no sleep hook for connectors and never asks."""
        return False

    # -- worker side -----------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def _meta(self) -> AsyncConnKVMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, AsyncConnKVMetadata)
        return meta

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, AsyncConnKVMetadata):
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind, and on a CPU engine issue the step's loads now (``KVWorkerSide.loads_before_forward``)."""
        super().bind_connector_metadata(connector_metadata)
        worker, meta = self._worker, connector_metadata
        if worker is not None and isinstance(meta, AsyncConnKVMetadata) and worker.loads_before_forward:
            worker.issue_loads(meta)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No layer waits: an asynchronous load's request runs only after its blocks are in, and
        ``start_load_kv`` returns only once a sync load's values are (a value holds every layer)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Values hold every layer, so saves are gathered once per step in ``wait_for_save``."""

    def wait_for_save(self) -> None:
        self.worker_side.save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        meta = self._connector_metadata
        if not isinstance(meta, AsyncConnKVMetadata):
            return self.worker_side.get_finished(finished_req_ids)
        return self.worker_side.get_finished(finished_req_ids, meta.finished_via_recv, meta.step_tokens)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s reports, and the requests among ``finished_recving`` whose load failed on a
        model with several KV cache groups (``failed_recving``; :mod:`asyncconn.vllm.kv.failures`)."""
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker_side.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """Values this worker's store confirmed, for the scheduler's KV events (None: events off)."""
        return self.worker_side.events_report()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        side = self._worker if self._worker is not None else self._scheduler
        return side.stats() if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return AsyncConnKVStats(data)

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """Our counters on vLLM's ``/metrics`` (``asyncconn:kv_*``; asyncconn.vllm.prom)."""
        from asyncconn.vllm.prom import kv_prom_metrics

        return kv_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (a weight update's cache-clearing cascade):
        False, not applied. The store is shared and outlives this engine: wiping it is not this engine's to
        do, and saying it was would let KV computed by the old weights be loaded by the new ones. New weights
        take a new ``key_prefix`` (docs/deployment.md, Upgrading). The host tier only holds store values."""
        log.warning(
            "asyncconn KV: reset_connector asked, not applied: the shared store keeps its values; "
            "serve new weights under a new key_prefix"
        )
        return False

    def shutdown(self) -> None:
        if self._worker is not None:
            tier = self._worker.store.host_tier
            if tier is not None:
                unregister_tier(self._tier_name, tier)
            self._worker.close(worker_close_budget())
        if self._scheduler is not None:
            self._scheduler.close()

    # -- scheduler side --------------------------------------------------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[Any, int]:
        """The load just planned for ``request``, by source: the tokens the host tier was made to keep for
        it as ``host`` (:mod:`asyncconn.vllm.kv.hostclaims`), the others the local store holds as ``disk``
        (:mod:`asyncconn.vllm.kv.localstore`), the rest under the store's own source."""
        side = self.scheduler_side
        external = max(num_external_tokens, 0)
        host = min(side.host_tokens(request.request_id), external)
        # The tier holds what this host read or wrote last, which the local store holds too.
        disk = max(min(side.local_store_tokens(request.request_id), external) - host, 0)
        sources: dict[Any, int] = {}
        if host:
            sources[_hit_source("host")] = host
        if disk:
            sources[_hit_source("disk")] = disk
        if external > host + disk:  # (a file:// shared store's source is ``disk`` too: added up)
            rest = self._cache_hit_source
            sources[rest] = sources.get(rest, 0) + external - host - disk
        return sources

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """``BlockStored`` / ``BlockRemoved`` for vLLM's KV event publisher (none when events are off)."""
        return self.scheduler_side.take_events()

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request)
