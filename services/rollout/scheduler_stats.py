"""Counters and distributions the scheduler keeps; /admin/state and /metrics read them."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS_S = (1, 5, 15, 30, 60, 120, 300, 600, 1200, 1800, 3600, 7200)


@dataclass
class Histogram:
    """Cumulative bucket counts of one quantity, for a Prometheus histogram."""

    buckets: tuple[float, ...] = LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.buckets)
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1


@dataclass
class SchedulerStats:
    """Everything counted since the scheduler started (times in the scheduler's clock)."""

    submitted_samples: int = 0
    finished_samples: int = 0
    no_verdict_samples: int = 0
    #: samples without verdict by cause (services/common/no_verdict.py names)
    no_verdict_by_cause: Counter[str] = field(default_factory=Counter)
    #: samples without verdict, by cause, in the groups dropped for reason no_verdict
    dropped_no_verdict_by_cause: Counter[str] = field(default_factory=Counter)
    runner_errors: int = 0
    cancelled_samples: int = 0
    mixed_version_samples: int = 0
    written_groups: int = 0
    written_samples: int = 0
    dropped_samples: int = 0
    dropped_groups: Counter[str] = field(default_factory=Counter)
    sink_errors: int = 0
    #: groups the sink refused because their id was already written (never silent)
    sink_rejected: int = 0
    sink_backpressure: int = 0
    #: staleness of written groups at their predicted consumption -> count
    staleness: Counter[int] = field(default_factory=Counter)
    group_latency_sum_s: float = 0.0
    group_latency_s: Histogram = field(default_factory=Histogram)
    group_latency_recent_s: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    in_flight_area: float = 0.0   # integral of in-flight samples over time
    in_flight_since: float | None = None
    in_flight_last: int = 0
    in_flight_last_t: float = 0.0
    in_flight_history: deque[tuple[float, int]] = field(
        default_factory=lambda: deque(maxlen=512))

    def record_in_flight(self, now: float, in_flight: int) -> None:
        """Integrate the in-flight count over time (called on every change)."""
        if self.in_flight_since is None:
            self.in_flight_since = now
        else:
            self.in_flight_area += self.in_flight_last * (now - self.in_flight_last_t)
        self.in_flight_last, self.in_flight_last_t = in_flight, now
        if not self.in_flight_history or now - self.in_flight_history[-1][0] >= 1.0:
            self.in_flight_history.append((now, in_flight))

    def mean_in_flight(self, now: float) -> float:
        if self.in_flight_since is None or now <= self.in_flight_since:
            return float(self.in_flight_last)
        area = self.in_flight_area + self.in_flight_last * (now - self.in_flight_last_t)
        return area / (now - self.in_flight_since)

    def record_group(self, latency_s: float, num_samples: int, staleness: int) -> None:
        self.written_groups += 1
        self.written_samples += num_samples
        self.group_latency_sum_s += latency_s
        self.group_latency_s.observe(latency_s)
        self.group_latency_recent_s.append(latency_s)
        self.staleness[staleness] += 1

    def mixed_version_share(self) -> float:
        return self.mixed_version_samples / self.finished_samples if self.finished_samples else 0.0

    def as_dict(self, now: float) -> dict[str, Any]:
        recent = sorted(self.group_latency_recent_s)
        return {
            "submitted_samples": self.submitted_samples,
            "finished_samples": self.finished_samples,
            "no_verdict_samples": self.no_verdict_samples,
            "no_verdict_by_cause": dict(self.no_verdict_by_cause),
            "dropped_no_verdict_by_cause": dict(self.dropped_no_verdict_by_cause),
            "runner_errors": self.runner_errors,
            "cancelled_samples": self.cancelled_samples,
            "written_groups": self.written_groups,
            "written_samples": self.written_samples,
            "dropped_samples": self.dropped_samples,
            "dropped_groups": dict(self.dropped_groups),
            "sink_errors": self.sink_errors,
            "sink_rejected": self.sink_rejected,
            "sink_backpressure": self.sink_backpressure,
            "mixed_version_share": round(self.mixed_version_share(), 4),
            "staleness_of_written_groups": {str(k): v for k, v in sorted(self.staleness.items())},
            "group_latency_s_mean": (self.group_latency_sum_s / self.written_groups
                                     if self.written_groups else None),
            "group_latency_s_p50": recent[len(recent) // 2] if recent else None,
            "mean_in_flight": round(self.mean_in_flight(now), 3),
            "in_flight_recent": [[round(t, 3), n] for t, n in list(self.in_flight_history)[-20:]],
        }
