"""The reaper's decision for each kind of sandbox it may list (no provider needed)."""

from __future__ import annotations

import time

import pytest

from services.sandbox.leases import LEASE_UNTIL, Leases, Owner
from services.sandbox.provider import ListedSandbox, SandboxHandle
from services.sandbox.reaper import Reaper
from services.testing.fake_provider import FakeProvider

NOW = 1_000_000.0
ME = Owner("run", "host:8053", "me")


def _listed(incarnation: str, instance: str = "host:8053", run: str = "run",
            lease: float | None = NOW + 60, episode: str = "e",
            sandbox_id: str = "s") -> ListedSandbox:
    labels = {"riptide.run": run, "riptide.instance": instance,
              "riptide.incarnation": incarnation, "riptide.episode": episode}
    if lease is not None:
        labels[LEASE_UNTIL] = str(int(lease))
    return ListedSandbox(sandbox_id, labels)


@pytest.mark.parametrize(("sandbox", "final", "reason"), [
    (_listed("old"), False, "incarnation_gone"),            # my instance's predecessor
    (_listed("old", lease=NOW + 9999), False, "incarnation_gone"),
    (_listed("x", instance="other:8053"), False, None),     # another instance, lease holds
    (_listed("x", instance="other:8053", lease=NOW - 1), False, "lease_lapsed"),
    (_listed("x", instance="other:8053", lease=None), False, "lease_lapsed"),
    (_listed("x", instance="other:8053"), True, None),      # a stop spares other instances
    (_listed("old", run="other-run", lease=NOW - 1), False, None),  # never another run's
    (_listed("old", run="other-run"), True, None),
    (_listed("me", episode="running"), False, None),        # my episode in flight
    (_listed("me", episode="running", lease=NOW - 1), False, None),
    (_listed("me", sandbox_id="tracked", lease=NOW - 1), False, None),
    (_listed("me", episode="gone", lease=NOW - 1), False, "lease_lapsed"),  # my own leak
    (_listed("me", episode="gone"), False, None),
    (_listed("me", episode="running"), True, "run_end"),
    (_listed("old"), True, "run_end"),
])
def test_reaper_decision(sandbox: ListedSandbox, final: bool, reason: str | None) -> None:
    leases = Leases(FakeProvider(), ME)
    leases.track(SandboxHandle("tracked", "task", "fake"), {})
    reaper = Reaper(FakeProvider(), leases, lambda: {"running"})
    assert reaper.reason(sandbox, NOW, final) == reason


def test_new_labels_carry_owner_episode_and_a_lease_covering_the_create() -> None:
    leases = Leases(FakeProvider(), ME, lease_s=600, create_grace_s=1800)
    labels = leases.labels("task-1", "sample-1")
    assert {k: v for k, v in labels.items() if k != LEASE_UNTIL} == {
        "riptide.run": "run", "riptide.instance": "host:8053", "riptide.incarnation": "me",
        "riptide.episode": "sample-1", "riptide.task": "task-1"}
    assert float(labels[LEASE_UNTIL]) == pytest.approx(time.time() + 2400, abs=2)
