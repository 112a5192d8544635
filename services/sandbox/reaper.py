"""The reaper: finds this run's orphaned sandboxes at the provider and deletes them.

At start-up, every `interval_s` and once more when the service stops, it lists the sandboxes
labelled with this run (leases.py) and deletes:
- those of an earlier incarnation of this same service instance (`incarnation_gone`: this
  process holds the instance's admin port, so its predecessor is dead);
- those of any other incarnation or instance whose lease lapsed (`lease_lapsed`: nobody
  renews them, e.g. a service of the run that died and did not come back);
- at the stop (`run_end`), everything of this incarnation and of its predecessors.
A sandbox of this process whose episode is running, or that it tracks, is never touched;
nor is any sandbox without this run's label. Called by the sandbox service (service.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable

from services.common import metrics
from services.common.events import EventPublisher
from services.sandbox.leases import EPISODE, INCARNATION, INSTANCE, RUN, Leases, lease_until
from services.sandbox.provider import ListedSandbox, SandboxProvider

log = logging.getLogger(__name__)

REAPED = metrics.counter("riptide_sandbox_reaped_total", "orphaned sandboxes the reaper "
                         "deleted, by reason", ("reason",))
REAP_FAILURES = metrics.counter("riptide_sandbox_reap_failures_total",
                                "reaper deletes and listings that failed", ("operation",))
_MAX_CONCURRENT_DELETES = 16


class Reaper:
    """Deletes this run's sandboxes that nobody owns any more."""

    def __init__(self, provider: SandboxProvider, leases: Leases,
                 episodes_in_flight: Callable[[], set[str]], delete_timeout_s: float = 60.0,
                 events: EventPublisher | None = None) -> None:
        self.provider = provider
        self.leases = leases
        self.episodes_in_flight = episodes_in_flight
        self.delete_timeout_s = delete_timeout_s
        self.events = events or EventPublisher.disabled("sandbox")
        self.reaped: Counter[str] = Counter()
        self.delete_failures = 0
        self.sweeps = 0
        self.last_sweep_s = 0.0

    def reason(self, sandbox: ListedSandbox, now: float, final: bool = False) -> str | None:
        """Why `sandbox` is to be deleted, or None to leave it."""
        owner, labels = self.leases.owner, sandbox.labels
        if labels.get(RUN) != owner.run:
            return None  # never another run's (the listing filters by run already)
        mine = labels.get(INCARNATION) == owner.incarnation
        predecessor = not mine and labels.get(INSTANCE) == owner.instance
        if final and (mine or predecessor):
            return "run_end"
        if mine:
            if sandbox.sandbox_id in self.leases.tracked \
                    or labels.get(EPISODE, "") in self.episodes_in_flight():
                return None
        elif predecessor:
            return "incarnation_gone"
        lease = lease_until(labels)
        return "lease_lapsed" if lease is None or lease < now else None

    async def sweep(self, final: bool = False) -> int:
        """One pass: list, decide, delete. The number of sandboxes deleted."""
        started = time.monotonic()
        try:
            listed = await self.provider.list_sandboxes({RUN: self.leases.owner.run})
        except Exception:  # noqa: BLE001 - counted and logged; the next sweep tries again
            REAP_FAILURES.labels("list").inc()
            log.exception("listing the run's sandboxes failed")
            return 0
        now = time.time()
        doomed = [(s, r) for s in listed if (r := self.reason(s, now, final)) is not None]
        slots = asyncio.Semaphore(_MAX_CONCURRENT_DELETES)
        results = await asyncio.gather(*(self._delete(s, r, slots) for s, r in doomed))
        self.sweeps += 1
        self.last_sweep_s = time.monotonic() - started
        return sum(results)

    async def _delete(self, sandbox: ListedSandbox, reason: str,
                      slots: asyncio.Semaphore) -> bool:
        ok = False
        async with slots:
            with self.events.span("sandbox.reap", id=sandbox.sandbox_id, attrs={
                    "sandbox": sandbox.sandbox_id, "reason": reason,
                    "incarnation": sandbox.labels.get(INCARNATION, ""),
                    "task_id": sandbox.labels.get("riptide.task", "")}) as attrs:
                try:
                    await asyncio.wait_for(self.provider.delete_listed(sandbox),
                                           self.delete_timeout_s)
                    ok = True
                except Exception:  # noqa: BLE001 - counted and logged; retried next sweep
                    log.exception("reaping sandbox %s failed", sandbox.sandbox_id)
                finally:
                    attrs["ok"] = ok
        if ok:
            self.reaped[reason] += 1
            REAPED.labels(reason).inc()
            log.info("reaped sandbox %s (%s)", sandbox.sandbox_id, reason)
        else:
            self.delete_failures += 1
            REAP_FAILURES.labels("delete").inc()
        return ok

    async def keep_reaping(self, interval_s: float) -> None:
        """Sweep now (start-up) and every `interval_s` until cancelled."""
        while True:
            await self.sweep()
            await asyncio.sleep(interval_s)

    def stats(self) -> dict[str, object]:
        return {"reaped": dict(self.reaped), "reap_delete_failures": self.delete_failures,
                "reaper_sweeps": self.sweeps,
                "reaper_last_sweep_ms": round(1000 * self.last_sweep_s, 3)}
