"""The sandbox service's `sandbox.live` snapshots: what each row says, and when one is sent."""

from __future__ import annotations

import asyncio
from typing import Any

from services.sandbox.live import LiveSandboxes, publish_live
from services.sandbox.provider import SandboxHandle


def _handle(sandbox_id: str, created_at: float, task: str = "csv-revenue") -> SandboxHandle:
    return SandboxHandle(sandbox_id, task, "local", created_at=created_at)


def test_a_snapshot_lists_each_sandbox_with_its_episode_state_and_age() -> None:
    live = LiveSandboxes()
    alive: dict[str, SandboxHandle] = {}
    live.begin("s-creating", "g1", "config-edit")
    live.begin("s-running", "g1", "csv-revenue")
    alive["sbx-1"] = _handle("sbx-1", created_at=100.0)
    live.update("s-running", state="running", sandbox_id="sbx-1", turns=3)
    alive["sbx-orphan"] = _handle("sbx-orphan", created_at=90.0)  # its episode was cancelled
    rows = live.snapshot(alive, now=110.0)
    by_sample = {row["sample_id"]: row for row in rows}
    assert by_sample["s-running"] == {
        "sandbox": "sbx-1", "task_id": "csv-revenue", "provider": "local",
        "sample_id": "s-running", "group_id": "g1", "turns": 3, "state": "running",
        "age_s": 10.0}
    creating = by_sample["s-creating"]
    assert (creating["sandbox"], creating["state"], creating["task_id"]) == (
        "", "creating", "config-edit")
    assert by_sample[""]["sandbox"] == "sbx-orphan" and by_sample[""]["state"] == "deleting"
    assert rows[0]["sandbox"] == "sbx-orphan"  # oldest first
    live.update("s-running", state="verifying")
    verifying = next(r for r in live.snapshot(alive, now=111.0) if r["sample_id"] == "s-running")
    assert (verifying["state"], verifying["turns"]) == ("verifying", 3)  # turns kept
    live.end("s-running")
    live.end("s-creating")
    del alive["sbx-1"], alive["sbx-orphan"]
    assert live.snapshot(alive, now=120.0) == []


class Recorder:
    """Stands in for EventPublisher.publish: keeps what was published."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def publish(self, kind: str, **fields: Any) -> None:
        self.events.append({"kind": kind, **fields})


def test_snapshots_go_out_on_a_change_and_on_the_heartbeat() -> None:
    live, alive, events = LiveSandboxes(), {}, Recorder()

    async def scenario() -> None:
        task = asyncio.create_task(publish_live(events, live, alive,  # type: ignore[arg-type]
                                                interval_s=0.02, heartbeat_s=0.3))
        await asyncio.sleep(0.1)  # the first one, then nothing changes
        assert len(events.events) == 1
        live.begin("s1", "g1", "csv-revenue")
        await asyncio.sleep(0.05)
        assert len(events.events) == 2
        assert [r["sample_id"] for r in events.events[-1]["attrs"]["sandboxes"]] == ["s1"]
        await asyncio.sleep(0.35)  # unchanged: only the heartbeat
        assert len(events.events) == 3
        task.cancel()

    asyncio.run(scenario())
    first = events.events[0]
    assert first["kind"] == "sandbox.live" and first["attrs"]["sandboxes"] == []
    assert first["attrs"]["instance"] == first["id"] and first["attrs"]["heartbeat_s"] == 0.3
    assert events.events[-1]["attrs"]["num_live"] == 1


def test_a_snapshot_carries_the_oldest_rows_and_counts_them_all() -> None:
    from services.sandbox import live as live_module

    live, events = LiveSandboxes(), Recorder()
    for index in range(live_module.MAX_ROWS + 5):
        live.begin(f"s{index}", "g", "csv-revenue")
    live_module.publish_snapshot(events, live, {}, 10.0)  # type: ignore[arg-type]
    attrs = events.events[0]["attrs"]
    assert attrs["num_live"] == live_module.MAX_ROWS + 5
    assert len(attrs["sandboxes"]) == live_module.MAX_ROWS


def test_the_heartbeat_may_not_be_shorter_than_the_interval() -> None:
    import pytest

    from services.sandbox.config import SandboxConfig

    with pytest.raises(ValueError, match="make the heartbeat at least the interval"):
        SandboxConfig(live_snapshot_interval_s=5.0, live_snapshot_heartbeat_s=2.0)
    with pytest.raises(ValueError, match="greater than or equal to 0.1"):
        SandboxConfig(live_snapshot_interval_s=0.01)
