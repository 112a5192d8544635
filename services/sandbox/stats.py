"""Live figures of the sandbox service, for /admin/state, GetStatus and the metrics page."""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from services.common import metrics
from services.sandbox.provider import SandboxHandle

EPISODES = metrics.counter("riptide_sandbox_episodes_total", "finished episodes by verdict",
                           ("status",))
ALIVE = metrics.gauge("riptide_sandbox_sandboxes_alive", "sandboxes created and not yet deleted")
RUNNING = metrics.gauge("riptide_sandbox_episodes_running", "episodes holding an episode slot")
CREATE_LATENCY = metrics.histogram("riptide_sandbox_create_seconds",
                                   "provider create time of one sandbox")
ACQUIRE_LATENCY = metrics.histogram("riptide_sandbox_acquire_seconds",
                                    "time from asking for a sandbox to holding it")
NO_VERDICT = metrics.counter("riptide_sandbox_no_verdict_total",
                             "episodes without verdict by cause", ("cause",))
FAILURES = metrics.counter("riptide_sandbox_failures_total", "failed creates and deletes",
                           ("operation",))


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank; 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[rank]


@dataclass
class SandboxStats:
    """Counters and recent latencies; every mutation happens on the event loop."""

    episodes_running: int = 0
    episodes_queued: int = 0
    episodes_by_status: Counter[str] = field(default_factory=Counter)
    finish_reasons: Counter[str] = field(default_factory=Counter)
    no_verdict_by_cause: Counter[str] = field(default_factory=Counter)
    create_failures: int = 0
    delete_failures: int = 0
    alive: dict[str, SandboxHandle] = field(default_factory=dict)
    create_s: deque[float] = field(default_factory=lambda: deque(maxlen=512))
    acquire_s: deque[float] = field(default_factory=lambda: deque(maxlen=512))

    def sandbox_created(self, handle: SandboxHandle, create_s: float, acquire_s: float) -> None:
        self.alive[handle.sandbox_id] = handle
        self.create_s.append(create_s)
        self.acquire_s.append(acquire_s)
        ALIVE.set(len(self.alive))
        CREATE_LATENCY.observe(create_s)
        ACQUIRE_LATENCY.observe(acquire_s)

    def create_failed(self) -> None:
        self.create_failures += 1
        FAILURES.labels("create").inc()

    def episode_started(self) -> None:
        self.episodes_running += 1
        RUNNING.set(self.episodes_running)

    def episode_finished(self, status: str, finish_reason: str,
                         no_verdict_cause: str | None = None) -> None:
        self.episodes_running -= 1
        RUNNING.set(self.episodes_running)
        if status:
            self.episodes_by_status[status] += 1
            self.finish_reasons[finish_reason] += 1
            EPISODES.labels(status).inc()
        if no_verdict_cause is not None:
            self.no_verdict_by_cause[no_verdict_cause] += 1
            NO_VERDICT.labels(no_verdict_cause).inc()

    def sandbox_deleted(self, handle: SandboxHandle, ok: bool) -> None:
        self.alive.pop(handle.sandbox_id, None)
        ALIVE.set(len(self.alive))
        if not ok:
            self.delete_failures += 1
            FAILURES.labels("delete").inc()

    def snapshot(self) -> dict[str, Any]:
        create_ms = [1000 * s for s in self.create_s]
        acquire_ms = [1000 * s for s in self.acquire_s]
        now = time.time()
        return {
            "episodes_running": self.episodes_running,
            "episodes_queued": self.episodes_queued,
            "episodes_finished": dict(self.episodes_by_status),
            "finish_reasons": dict(self.finish_reasons),
            "no_verdict_by_cause": dict(self.no_verdict_by_cause),
            "sandboxes_alive": len(self.alive),
            "oldest_sandbox_age_s": round(max((now - h.created_at for h in self.alive.values()
                                               if h.created_at), default=0.0), 3),
            "create_ms_p50": round(percentile(create_ms, 50), 3),
            "create_ms_p99": round(percentile(create_ms, 99), 3),
            "acquire_ms_p50": round(percentile(acquire_ms, 50), 3),
            "acquire_ms_p99": round(percentile(acquire_ms, 99), 3),
            "create_failures": self.create_failures,
            "delete_failures": self.delete_failures,
        }
