"""The rollout service's Prometheus metrics, read from the live runtime at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from services.rollout.scheduler_stats import Histogram

_registered: list[Any] = []


class RolloutCollector:
    """Turns the scheduler's, fleet's and coordinator's state into metric families."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        sched = snap.get("scheduler") or {}
        gauges = {
            "riptide_rollout_in_flight_samples": ("episodes in flight",
                                                  sched.get("in_flight_samples")),
            "riptide_rollout_queued_groups": ("complete groups waiting for the buffer",
                                              sched.get("queued_groups")),
            "riptide_rollout_weight_version": ("weight version the engines hold",
                                               sched.get("weight_version")),
            "riptide_rollout_buffer_depth_groups": ("groups in the sample buffer",
                                                    snap.get("buffer_depth")),
            "riptide_rollout_mixed_version_share": ("share of samples with tokens of several "
                                                    "weight versions",
                                                    sched.get("mixed_version_share")),
            "riptide_rollout_group_latency_seconds_mean": ("mean first-start-to-complete time "
                                                           "of written groups",
                                                           sched.get("group_latency_s_mean")),
            "riptide_rollout_weight_update_seconds_last": ("duration of the last weight update",
                                                           snap.get("last_update_s")),
        }
        for name, (doc, value) in gauges.items():
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=float(value))
        counters = {
            "riptide_rollout_submitted_samples": "episodes submitted",
            "riptide_rollout_finished_samples": "episodes finished",
            "riptide_rollout_dropped_samples": "samples of dropped groups",
            "riptide_rollout_written_groups": "groups written to the buffer",
        }
        for key, doc in counters.items():
            if key.removeprefix("riptide_rollout_") in sched:
                yield CounterMetricFamily(key, doc,
                                          value=sched[key.removeprefix("riptide_rollout_")])
        dropped = CounterMetricFamily("riptide_rollout_dropped_groups", "dropped groups by reason",
                                      labels=["reason"])
        for reason, count in (sched.get("dropped_groups") or {}).items():
            dropped.add_metric([reason], count)
        yield dropped
        causes = CounterMetricFamily("riptide_rollout_no_verdict_samples",
                                     "episodes without verdict by cause", labels=["cause"])
        for cause, count in (sched.get("no_verdict_by_cause") or {}).items():
            causes.add_metric([cause], count)
        yield causes
        staleness = GaugeMetricFamily("riptide_rollout_written_groups_by_staleness",
                                      "written groups by predicted staleness at consumption",
                                      labels=["staleness"])
        for lag, count in (sched.get("staleness_of_written_groups") or {}).items():
            staleness.add_metric([lag], count)
        yield staleness
        engines = GaugeMetricFamily("riptide_rollout_engine_running_requests",
                                    "running requests per engine", labels=["engine"])
        for engine in snap.get("engines") or []:
            load = engine.get("load") or []
            engines.add_metric([engine["url"]], sum(r.get("num_reqs", 0) for r in load))
        yield engines
        for name, doc, hist in (
                ("riptide_rollout_group_latency_seconds",
                 "first sample start to group complete, written groups", snap.get("_latency")),
                ("riptide_rollout_weight_update_seconds", "duration of committed weight updates",
                 snap.get("_update_durations"))):
            if isinstance(hist, Histogram):
                yield _histogram(name, doc, hist)


def _histogram(name: str, doc: str, hist: Histogram) -> HistogramMetricFamily:
    counts = hist.counts or [0] * len(hist.buckets)
    buckets = [(str(float(b)), c) for b, c in zip(hist.buckets, counts, strict=True)]
    return HistogramMetricFamily(name, doc, buckets=[*buckets, ("+Inf", hist.count)],
                                 sum_value=hist.total)


def install(snapshot: Callable[[], dict[str, Any]]) -> None:
    """Serve the rollout metrics from the process registry (once per process)."""
    if _registered:
        _registered[0]._snapshot = snapshot
        return
    collector = RolloutCollector(snapshot)
    REGISTRY.register(collector)  # type: ignore[arg-type]
    _registered.append(collector)
