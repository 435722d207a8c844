"""The connectors' figures as Prometheus counters on vLLM's own ``/metrics`` endpoint.

vLLM hands each connector class its metric types (multiprocess-safe when the API server runs several
processes) and later the interval stats its connectors reported (``KVConnectorStats.to_dict()`` /
``ECConnectorStats.data``). Each declared name becomes ``asyncconn:<kind>_<name>`` (exposed by the
Prometheus client with a ``_total`` suffix), labelled per engine like vLLM's own series; a gauge (carried in
the stats as changes) keeps its name, ``asyncconn:<kind>_<name>``. docs/operations.md lists every series and
the alert to set on it. The KV latency histograms (``kv.metadata.HISTOGRAMS``: lookups, loads, saves)
become Prometheus histograms, ``asyncconn:kv_<name>_seconds``, over the connector's own bucket bounds
(:data:`asyncconn.lookup.metrics.LATENCY_BOUNDS_S`: Prometheus adds ``+Inf``), so a p99 can be alerted on.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

from asyncconn.lookup.metrics import LATENCY_BOUNDS_S
from asyncconn.vllm.totals import HOST_COUNTERS, LOCAL_COUNTERS

__all__ = ["EC_COUNTERS", "EC_GAUGES", "ec_prom_metrics", "kv_prom_metrics"]

#: Why an EC load or save failed (``load_failed_<cause>``, ``save_failed_<cause>``).
_EC_CAUSES = ("miss", "corrupt", "timeout", "store_error", "too_large", "device_error")

#: The EC figures exported (stats keys; per-reason failures are also summed into ``load_failed``). ``saves``
#: are items the store confirmed written, ``saves_submitted`` those handed to the save tracker.
EC_COUNTERS = (
    "lookups",
    "lookup_hits",
    "lookup_misses",
    "lookup_timeouts",
    "lookup_errors",
    "admit_prefetched",
    "encode_stalled",
    "encode_budget",
    "prefetches",
    "loaded",
    "loaded_bytes",
    "load_failed",
    *(f"load_failed_{cause}" for cause in _EC_CAUSES),
    "saves",
    "saves_submitted",
    "saved_bytes",
    "save_failed",
    *(f"save_failed_{cause}" for cause in _EC_CAUSES),
    "saves_done",
    "saves_confirmed",
    "saves_unconfirmed",
    "store_outages",
    *HOST_COUNTERS,
    *LOCAL_COUNTERS,
)
#: EC gauges: processes (scheduler, workers) whose store is unreachable now.
EC_GAUGES = ("store_unreachable",)


#: The value a sample of each bucket is observed at: the bucket's upper bound (``le``: it lands in that
#: bucket); the slowest bucket's at twice the last bound.
_OBSERVED_AT = (*LATENCY_BOUNDS_S, 2 * LATENCY_BOUNDS_S[-1])

#: The metric this module last made under each name, in this process (the scheduler's thread builds them).
_made: dict[str, Any] = {}


def _replacing(name: str, make: Callable[[], Any]) -> Any:
    """``make()`` the metric ``name``, first unregistering the one an earlier engine in this process made.

    Why: a second in-process engine registers the same series again, which the default registry refuses.
    We keep our own record of what we registered and hand it to the public ``unregister``, rather than
    searching the registry's private name tables (as vLLM does for its own series). A metric that was not
    registered there (vLLM's Ray wrappers, or one someone else already unregistered) is simply replaced.
    """
    from prometheus_client import REGISTRY

    earlier = _made.pop(name, None)
    if earlier is not None:
        with contextlib.suppress(KeyError):  # not (or no longer) in the default registry
            REGISTRY.unregister(earlier)
    metric = make()
    _made[name] = metric
    return metric


def _per_engine(
    metric_cls: Any,
    name: str,
    documentation: str,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
    **kwargs: Any,
) -> dict[int, Any]:
    """The metric ``name`` (made anew: :func:`_replacing`), one labelled child per engine."""
    from vllm.v1.metrics.utils import create_metric_per_engine

    make = functools.partial(
        metric_cls, name=name, documentation=documentation, labelnames=labelnames, **kwargs
    )
    children: dict[int, Any] = create_metric_per_engine(_replacing(name, make), per_engine_labelvalues)
    return children


class _Family:
    """One per-engine child per name of one metric type, ``asyncconn:<kind>_<name><suffix>``."""

    suffix = ""  # after the name
    unit = ""  # after the help text
    options: ClassVar[dict[str, Any]] = {}  # for the metric type

    def __init__(
        self,
        metric_cls: Any,
        kind: str,
        names: Iterable[str],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        self.children: dict[str, dict[int, Any]] = {
            name: _per_engine(
                metric_cls,
                f"asyncconn:{kind}_{name}{self.suffix}",
                f"asyncconn {kind.upper()} connector: {name.replace('_', ' ')}{self.unit}",
                labelnames,
                per_engine_labelvalues,
                **self.options,
            )
            for name in names
        }


class _Counters(_Family):
    """Counters; ``observe`` adds an interval's values."""

    def observe(self, data: Mapping[str, Any], engine_idx: int) -> None:
        for name, per_engine in self.children.items():
            value = data.get(name)
            child = per_engine.get(engine_idx)
            if child is not None and isinstance(value, int) and not isinstance(value, bool) and value > 0:
                child.inc(value)


class _Gauges(_Family):
    """Gauges; the stats carry each gauge's change, added by ``observe``.

    Why changes: each process reports only when something changed, and vLLM sums the reports of all
    workers; a change sums correctly where a level would not.
    """

    unit = " (processes)"
    options: ClassVar[dict[str, Any]] = {"multiprocess_mode": "mostrecent"}

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._levels: dict[tuple[str, int], int] = {}

    def observe(self, data: Mapping[str, Any], engine_idx: int) -> None:
        for name, per_engine in self.children.items():
            value = data.get(name)
            child = per_engine.get(engine_idx)
            if child is not None and isinstance(value, int) and not isinstance(value, bool) and value:
                # Set, not inc: vLLM's gauges are "mostrecent" across its API server processes.
                level = self._levels[name, engine_idx] = self._levels.get((name, engine_idx), 0) + value
                child.set(level)


class _Histograms(_Family):
    """Latency histograms; ``observe`` adds an interval's bucket counts.

    The stats carry the counts of the connector's buckets, not the samples: each count is observed at its
    bucket's upper bound, so Prometheus' buckets (the same bounds) hold exactly the connector's counts, and
    ``_sum`` counts each sample at its bucket's bound (an upper estimate; the slowest bucket at twice the
    last bound). One ``observe`` per sample, through vLLM's metric type only, as vLLM's own connectors feed
    theirs; a sample is a lookup or one request's load or save on one worker, not a value.
    """

    suffix = "_seconds"
    unit = " (seconds)"
    options: ClassVar[dict[str, Any]] = {"buckets": list(LATENCY_BOUNDS_S)}

    def observe(self, data: Mapping[str, Any], engine_idx: int) -> None:
        for name, per_engine in self.children.items():
            counts = data.get(name)
            child = per_engine.get(engine_idx)
            if child is None or not isinstance(counts, list):
                continue
            for seconds, n in zip(_OBSERVED_AT, counts, strict=False):
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    for _ in range(n):
                        child.observe(seconds)


def _prom_metrics(
    base: type[Any],
    kind: str,
    names: Iterable[str],
    vllm_config: Any,
    metric_types: Any,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
    derive: Callable[[dict[str, Any]], None] | None = None,
    gauges: Iterable[str] = (),
    histograms: Iterable[str] = (),
) -> Any:
    """An instance of vLLM's ``base`` prom-metrics class (KV or EC: same constructor) feeding our counters,
    ``gauges`` and latency ``histograms``; ``derive`` adds computed names to a copy of each interval's stats
    before they are counted."""
    from prometheus_client import Counter, Gauge, Histogram

    class AsyncConnPromMetrics(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = _Counters(metric_types[Counter], kind, names, labelnames, per_engine_labelvalues)
            self._gauges = _Gauges(metric_types[Gauge], kind, gauges, labelnames, per_engine_labelvalues)
            self._histograms = _Histograms(
                metric_types[Histogram], kind, histograms, labelnames, per_engine_labelvalues
            )

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            data = transfer_stats_data
            if derive is not None:
                data = dict(data)
                derive(data)
            self._counters.observe(data, engine_idx)
            self._gauges.observe(data, engine_idx)
            self._histograms.observe(data, engine_idx)

    return AsyncConnPromMetrics()


def _sum_load_failures(data: dict[str, Any]) -> None:
    data["load_failed"] = sum(
        v for k, v in data.items() if k.startswith("load_failed_") and isinstance(v, int)
    )


def kv_prom_metrics(
    vllm_config: Any,
    metric_types: Any,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Any:
    """``AsyncConnKVConnector.build_prom_metrics``: every counter of ``kv.metadata.COUNTERS``, gauge of
    ``kv.metadata.GAUGES`` and latency histogram of ``kv.metadata.HISTOGRAMS``."""
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

    from asyncconn.vllm.kv.metadata import COUNTERS, GAUGES, HISTOGRAMS

    args = (vllm_config, metric_types, labelnames, per_engine_labelvalues)
    return _prom_metrics(KVConnectorPromMetrics, "kv", COUNTERS, *args, gauges=GAUGES, histograms=HISTOGRAMS)


def ec_prom_metrics(
    vllm_config: Any,
    metric_types: Any,
    labelnames: list[str],
    per_engine_labelvalues: dict[int, list[object]],
) -> Any:
    """``AsyncConnECConnector.build_prom_metrics``: the counters of :data:`EC_COUNTERS`."""
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorPromMetrics

    args = (vllm_config, metric_types, labelnames, per_engine_labelvalues)
    return _prom_metrics(
        ECConnectorPromMetrics, "ec", EC_COUNTERS, *args, derive=_sum_load_failures, gauges=EC_GAUGES
    )
