"""Engines and their routing targets: one target per engine, or per dp rank when DP-aware.

A target is routable when its engine is registered (not leaving), healthy, holds the router's
current weight version, and the target's circuit breaker lets calls through. Health and
version belong to the engine; load, circuit and counters to the target.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(eq=False)
class Engine:
    """One SGLang-compatible server."""

    url: str
    dp_size: int = 1
    dp_aware: bool = False
    healthy: bool = True
    leaving: bool = False
    weight_version: str | None = None
    max_running: int = 0  # per dp rank, from /get_server_info max_running_requests; 0 unknown
    max_input_tokens: int | None = None  # longest prompt it takes (max_req_input_len); None unknown
    health_failures: int = 0
    health_successes: int = 0
    num_ejections: int = 0
    #: Consecutive load reads that failed while /health answered; None: none tried yet.
    load_failures: int | None = None
    targets: list[Target] = field(default_factory=list)

    def load_signal(self, missing_after: int) -> str:
        """"ok" (its load arrives), "missing" (the last `missing_after` reads while healthy
        got none: the router sees only its own in-flight calls) or "pending" (not read yet)."""
        if self.load_failures is None:
            return "pending"
        return "missing" if self.load_failures >= missing_after else "ok"

    def record_load(self, ok: bool, missing_after: int) -> str | None:
        """Count one load read; returns "lost" or "back" when the signal changes."""
        before = self.load_signal(missing_after)
        self.load_failures = 0 if ok else (self.load_failures or 0) + 1
        after = self.load_signal(missing_after)
        if after == before:
            return None
        if after == "missing":
            return "lost"
        return "back" if before == "missing" else None

    def record_health(self, ok: bool, eject_after: int, admit_after: int) -> str | None:
        """Count one health observation; returns "ejected" or "admitted" on a transition."""
        if ok:
            self.health_failures = 0
            self.health_successes += 1
            if not self.healthy and self.health_successes >= admit_after:
                self.healthy = True
                for target in self.targets:  # the failed calls were the outage just ended
                    target.close_circuit()
                return "admitted"
            return None
        self.health_successes = 0
        self.health_failures += 1
        if self.healthy and self.health_failures >= eject_after:
            self.healthy = False
            self.num_ejections += 1
            return "ejected"
        return None


@dataclass(eq=False)
class Target:
    """One place a call can go: (engine, dp rank)."""

    engine: Engine
    dp_rank: int
    in_flight: int = 0
    reported_tokens: int = 0
    reported_waiting: int = 0
    mean_call_s: float = 0.0  # moving average of the engine's own latency per call
    draining: bool = False
    num_assigned: int = 0
    call_failures: int = 0
    circuit_open_until: float = 0.0
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    @property
    def id(self) -> str:
        return f"{self.engine.url}@{self.dp_rank}"

    def version_ok(self, current: int | None) -> bool:
        return current is None or self.engine.weight_version == str(current)

    def circuit_allows(self, open_after: int, now: float | None = None) -> bool:
        """Closed, or half-open (open time over) with no trial call in flight."""
        if self.call_failures < open_after:
            return True
        now = time.monotonic() if now is None else now
        return now >= self.circuit_open_until and self.in_flight == 0

    def routable(self, current_version: int | None, open_after: int) -> bool:
        e = self.engine
        return (e.healthy and not e.leaving and self.version_ok(current_version)
                and self.circuit_allows(open_after))

    def record_call(self, ok: bool, open_after: int, open_s: float) -> bool:
        """Count a call outcome for the circuit breaker; True when this failure opens it."""
        if ok:
            self.call_failures = 0
            return False
        self.call_failures += 1
        if self.call_failures >= open_after:
            self.circuit_open_until = time.monotonic() + open_s
            return self.call_failures == open_after
        return False

    def close_circuit(self) -> None:
        self.call_failures = 0
        self.circuit_open_until = 0.0

    def observe_latency(self, seconds: float) -> None:
        previous = self.mean_call_s or seconds
        self.mean_call_s = 0.9 * previous + 0.1 * seconds

    def queue_delay_s(self, extra_calls: int = 1) -> float:
        """Expected wait before `extra_calls` more calls start running here.

        With a known `max_running` the router's own in-flight count says how many calls wait
        (one slot frees every mean_call_s / max_running); otherwise the engine's last
        reported waiting count. Continuous batching: no wait below the running cap.
        """
        cap = self.engine.max_running
        waiting = max(0, self.in_flight + extra_calls - cap) if cap else self.reported_waiting
        return waiting * self.mean_call_s / max(cap, 1)

    def view(self, current_version: int | None, open_after: int,
             missing_after: int) -> dict[str, object]:
        """What the admin API and GetStatus show for this target."""
        e = self.engine
        hit = self.num_cached_tokens / self.num_prompt_tokens if self.num_prompt_tokens else 0.0
        return {
            "id": self.id, "engine_url": e.url, "dp_rank": self.dp_rank,
            "routable": self.routable(current_version, open_after),
            "healthy": e.healthy, "draining": self.draining, "leaving": e.leaving,
            "weight_version": e.weight_version,
            "version_current": self.version_ok(current_version),
            "circuit_open": not self.circuit_allows(open_after),
            "in_flight": self.in_flight, "reported_tokens": self.reported_tokens,
            "reported_waiting": self.reported_waiting,
            "mean_call_s": round(self.mean_call_s, 4),
            "requests": self.num_requests, "prompt_tokens": self.num_prompt_tokens,
            "cached_tokens": self.num_cached_tokens, "hit_rate": round(hit, 4),
            "ejections": e.num_ejections, "load_signal": e.load_signal(missing_after),
        }
