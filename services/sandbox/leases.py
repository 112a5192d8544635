"""Sandbox leases: the labels saying whose a sandbox is, and until when it is wanted.

Every sandbox carries `riptide.run`, `riptide.instance` (which sandbox service: stable across
its restarts, `host:admin_port` by default), `riptide.incarnation` (a random id per
sandbox-service process), `riptide.episode`, `riptide.task` and `riptide.lease_until` (unix
seconds). While its episode lives the service renews the lease every `renew_interval_s`
(`Leases.renew_all`, through the provider's `set_labels`); a service that dies renews
nothing, so its sandboxes' leases lapse within `lease_s`. The reaper (reaper.py) reads these
labels. Built by server.py; the episode runner labels and tracks each sandbox it creates.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

from services.common import metrics
from services.sandbox.provider import SandboxError, SandboxHandle, SandboxProvider

log = logging.getLogger(__name__)

RUN, INSTANCE, INCARNATION = "riptide.run", "riptide.instance", "riptide.incarnation"
EPISODE, TASK, LEASE_UNTIL = "riptide.episode", "riptide.task", "riptide.lease_until"

LEASED = metrics.gauge("riptide_sandbox_sandboxes_leased",
                       "live sandboxes whose lease this service holds unexpired")
RENEW_FAILURES = metrics.counter("riptide_sandbox_lease_renew_failures_total",
                                 "lease renewals the provider refused")
_MAX_CONCURRENT_RENEWALS = 16


def new_incarnation() -> str:
    """A random id for this sandbox-service process."""
    return secrets.token_hex(6)


def lease_until(labels: Mapping[str, str]) -> float | None:
    """The lease's end in unix seconds; None when missing or unreadable (no valid lease)."""
    try:
        return float(labels[LEASE_UNTIL])
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class Owner:
    """Who makes sandboxes: the run, the service instance and this process's incarnation."""

    run: str
    instance: str
    incarnation: str


class Leases:
    """The labels of new sandboxes and the renewal of the live ones' leases."""

    def __init__(self, provider: SandboxProvider, owner: Owner, lease_s: float = 600.0,
                 create_grace_s: float = 1800.0) -> None:
        self.provider = provider
        self.owner = owner
        self.lease_s = lease_s
        self.create_grace_s = create_grace_s
        #: live sandboxes of this process: id -> (handle, labels as last set)
        self.tracked: dict[str, tuple[SandboxHandle, dict[str, str]]] = {}
        self.renew_failures = 0

    def labels(self, task_name: str, episode: str) -> dict[str, str]:
        """The labels of a sandbox about to be created; its first lease also covers the
        create itself (image builds can take long)."""
        until = time.time() + self.lease_s + self.create_grace_s
        return {RUN: self.owner.run, INSTANCE: self.owner.instance,
                INCARNATION: self.owner.incarnation, EPISODE: episode, TASK: task_name,
                LEASE_UNTIL: str(int(until))}

    def track(self, handle: SandboxHandle, labels: Mapping[str, str]) -> None:
        """A sandbox was created with `labels`: renew its lease from now on."""
        self.tracked[handle.sandbox_id] = (handle, dict(labels))

    def forget(self, sandbox_id: str) -> None:
        """The sandbox is deleted (or being deleted): no more renewals."""
        self.tracked.pop(sandbox_id, None)

    def num_leased(self, now: float | None = None) -> int:
        """Tracked sandboxes whose lease has not lapsed."""
        now = time.time() if now is None else now
        count = sum(1 for _, labels in self.tracked.values()
                    if (lease_until(labels) or 0.0) > now)
        LEASED.set(count)
        return count

    async def renew_all(self) -> None:
        """Extend every tracked sandbox's lease to `lease_s` from now."""
        slots = asyncio.Semaphore(_MAX_CONCURRENT_RENEWALS)
        until = str(int(time.time() + self.lease_s))

        async def renew(sandbox_id: str, handle: SandboxHandle, labels: dict[str, str]) -> None:
            renewed = {**labels, LEASE_UNTIL: until}
            async with slots:
                try:
                    await self.provider.set_labels(handle, renewed)
                except SandboxError as exc:  # counted; the next round tries again
                    self.renew_failures += 1
                    RENEW_FAILURES.inc()
                    log.warning("renewing the lease of sandbox %s failed: %s", sandbox_id, exc)
                    return
            if sandbox_id in self.tracked:  # not deleted meanwhile
                self.tracked[sandbox_id] = (handle, renewed)

        await asyncio.gather(*(renew(sid, handle, labels)
                               for sid, (handle, labels) in list(self.tracked.items())))
        self.num_leased()

    async def keep_renewing(self, interval_s: float) -> None:
        """Renew every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            await self.renew_all()
