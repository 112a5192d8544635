"""Every panel of the page in one JSON document, series thinned to what a chart can show."""

from __future__ import annotations

import time
from typing import Any

from services.rollout.dashboard import load, samples, timeline, training
from services.rollout.dashboard.advisories import advise
from services.rollout.dashboard.config import DashboardConfig
from services.rollout.dashboard.record import RunRecord

MAX_POINTS = 600


def thin(series: list[list[float]], max_points: int = MAX_POINTS) -> list[list[float]]:
    """Every k-th point (and the last), so a chart gets at most about `max_points`."""
    if len(series) <= max_points:
        return series
    stride = -(-len(series) // max_points)
    kept = series[::stride]
    return kept if kept[-1] is series[-1] else [*kept, series[-1]]


def _thin_all(series: dict[str, list[list[float]]]) -> dict[str, list[list[float]]]:
    return {name: thin(points) for name, points in series.items()}


def summary(record: RunRecord, config: DashboardConfig, live: bool) -> dict[str, Any]:
    """The page's data: run clock, advisories and every panel."""
    phases = timeline.phase_timeline(record)
    phases["in_flight"] = thin(phases["in_flight"])
    flight = load.concurrency(record)
    cache = load.cache_hit_rates(record, config.advisories.window_s)
    for panel in cache["engines"].values():
        panel["cumulative"], panel["windowed"] = thin(panel["cumulative"]), thin(
            panel["windowed"])
    return {
        "live": live, "generated_at": time.time(), "now": record.now,
        "num_events": len(record.events), "num_bad_events": record.num_bad,
        "poll_interval_ms": config.poll_interval_ms,
        "advisories": advise(record, config.advisories),
        "timeline": phases,
        "concurrency": {"in_flight": thin(flight["in_flight"]), "cap": thin(flight["cap"]),
                        "per_engine": _thin_all(flight["per_engine"]),
                        "per_rank": _thin_all(flight["per_rank"])},
        "cache": cache,
        "steps": training.steps(record),
        "staleness": training.staleness_histogram(record),
        "dropped": training.dropped_groups(record),
        "no_verdict_causes": training.no_verdicts_by_cause(record),
        "evals": training.evals(record),
        "engines": load.engines_table(record),
        "sandboxes": load.live_sandboxes(record),
        "sandbox_lifecycle": load.sandbox_lifecycle(record),
        "samples": samples.recent_episodes(record, config.num_recent_samples),
    }
