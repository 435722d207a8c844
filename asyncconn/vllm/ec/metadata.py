"""What the EC connector's scheduler side and worker side tell each other, as plain dataclasses.

vLLM carries :class:`ECStepMetadata` from ``build_connector_meta`` (scheduler) to ``bind_connector_metadata``
(every worker) and :class:`ECWorkerReport` back from ``build_connector_worker_meta`` through
``ECConnectorOutput``. With several workers vLLM merges their reports by calling ``aggregate`` pairwise, so
each field merges as a union or a sum: readiness is kept *per worker id*, because "every worker has the
item staged" is what admission needs and a plain union of hashes would say it after the first worker.

Nothing here imports vLLM: the scheduler and worker classes that use these are testable without an engine.
The messages hold only strings and ints (vLLM may pickle them between processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ECStepMetadata", "ECWorkerReport", "ItemRef", "SAVING_PARAM"]

#: Key of E's ``ec_transfer_params``: the mm hashes E encoded for the request and is saving (or has saved).
#: A proxy copies E's params into PD's ``sampling_params.extra_args["ec_transfer_params"]``.
SAVING_PARAM = "asyncconn_saving"


@dataclass(frozen=True, slots=True)
class ItemRef:
    """One multimodal item: its hash (the store key suffix) and how many embedding rows it has."""

    mm_hash: str
    num_embeds: int


@dataclass(slots=True)
class ECStepMetadata:
    """Scheduler -> workers, once per step that runs the model.

    ``drop`` is applied first (prefetches nobody needs any more: free them), then ``prefetch`` (start loading
    into staging, report readiness), then ``install`` (put the staged item into ``encoder_cache`` now; the
    scheduler orders an install only for an item every worker reported staged). ``step_tokens`` is the
    step's scheduled token count: a worker that sees 0 learns that its runner calls the EC hooks on empty
    steps (vLLM's V2 model runner does, the V1 runner does not) and says so in its report.
    """

    prefetch: list[ItemRef] = field(default_factory=list)
    install: list[ItemRef] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    step_tokens: int = -1  # -1: unknown (a metadata object built by hand)

    def is_empty(self) -> bool:
        return not (self.prefetch or self.install or self.drop)


@dataclass(slots=True)
class ECWorkerReport:
    """Workers -> scheduler, every step: who reported, what became ready where, what failed, event counts.

    ``workers`` is always set (a heartbeat), so the scheduler learns how many workers must report an item
    ready before a request that needs it is admitted. ``empty_step_hooks`` is True once the worker's EC
    hooks ran on a step with no scheduled tokens: prefetches then progress on an otherwise idle engine.
    """

    workers: frozenset[str] = frozenset()
    ready: dict[str, frozenset[str]] = field(default_factory=dict)  # mm hash -> worker ids that staged it
    failed: dict[str, str] = field(default_factory=dict)  # mm hash -> failure reason (miss, corrupt, ...)
    stats: dict[str, int] = field(default_factory=dict)  # worker events counted since the previous report
    empty_step_hooks: bool = False

    def aggregate(self, other: ECWorkerReport) -> ECWorkerReport:
        """vLLM's merge of two workers' reports (``ECOutputAggregator``): unions and sums, never in place."""
        ready = dict(self.ready)
        for mm_hash, ids in other.ready.items():
            ready[mm_hash] = ready.get(mm_hash, frozenset()) | ids
        stats = dict(self.stats)
        for name, value in other.stats.items():
            stats[name] = stats.get(name, 0) + value
        return ECWorkerReport(
            workers=self.workers | other.workers,
            ready=ready,
            failed={**self.failed, **other.failed},
            stats=stats,
            empty_step_hooks=self.empty_step_hooks or other.empty_step_hooks,
        )
