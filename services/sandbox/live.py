"""The sandbox service's live sandboxes, published as `sandbox.live` snapshots.

`LiveSandboxes` follows each episode from its sandbox's creation to its deletion (state,
turns) beside the service's table of sandboxes alive (`SandboxStats.alive`), so a snapshot
also shows a sandbox whose episode is gone but whose delete is still running.
`publish_live` sends a snapshot every `interval_s` when something changed, and every
`heartbeat_s` regardless, so a reader can tell a quiet service from a gone one.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from services.common.events import EventPublisher
from services.sandbox.provider import SandboxHandle

State = Literal["creating", "running", "verifying", "deleting"]
#: Rows one snapshot carries (the oldest); a service with more says how many in `num_live`,
#: so thousands of concurrent episodes do not make each snapshot a megabyte.
MAX_ROWS = 500


@dataclass
class _Episode:
    sample_id: str
    group_id: str
    task_id: str
    started_at: float
    state: State = "creating"
    sandbox_id: str = ""
    turns: int = 0


class LiveSandboxes:
    """Episodes holding or making a sandbox, and what each is doing."""

    def __init__(self) -> None:
        self._episodes: dict[str, _Episode] = {}
        self.changes = 0  # bumped by every change, so a publisher skips unchanged snapshots

    def begin(self, sample_id: str, group_id: str, task_id: str) -> None:
        self._episodes[sample_id] = _Episode(sample_id, group_id, task_id, time.time())
        self.changes += 1

    def update(self, sample_id: str, *, state: State | None = None, sandbox_id: str = "",
               turns: int | None = None) -> None:
        episode = self._episodes.get(sample_id)
        if episode is None:
            return
        episode.state = state or episode.state
        episode.sandbox_id = sandbox_id or episode.sandbox_id
        episode.turns = episode.turns if turns is None else turns
        self.changes += 1

    def touch(self) -> None:
        """Something outside the episodes changed (a sandbox was deleted)."""
        self.changes += 1

    def episode_ids(self) -> set[str]:
        """The sample ids of the episodes holding or making a sandbox now."""
        return set(self._episodes)

    def end(self, sample_id: str) -> None:
        if self._episodes.pop(sample_id, None) is not None:
            self.changes += 1

    def snapshot(self, alive: Mapping[str, SandboxHandle], now: float) -> list[dict[str, Any]]:
        """One row per sandbox being made or alive, oldest first; `age_s` since its create
        began (creating) or finished."""
        rows = [_row(e, None, now) for e in self._episodes.values() if not e.sandbox_id]
        by_sandbox = {e.sandbox_id: e for e in self._episodes.values() if e.sandbox_id}
        rows += [_row(by_sandbox.get(sandbox_id), handle, now)
                 for sandbox_id, handle in alive.items()]
        return sorted(rows, key=lambda row: -row["age_s"])


def _row(episode: _Episode | None, handle: SandboxHandle | None, now: float) -> dict[str, Any]:
    since = handle.created_at if handle is not None else (
        episode.started_at if episode is not None else now)
    return {"sandbox": handle.sandbox_id if handle is not None else "",
            "task_id": handle.task_name if handle is not None else (
                episode.task_id if episode is not None else ""),
            "provider": handle.provider if handle is not None else "",
            "sample_id": episode.sample_id if episode is not None else "",
            "group_id": episode.group_id if episode is not None else "",
            "turns": episode.turns if episode is not None else 0,
            # a sandbox whose episode ended (cancelled, or done) waits for its delete
            "state": episode.state if episode is not None else "deleting",
            "age_s": round(max(0.0, now - since), 3)}


def instance_name() -> str:
    """Which sandbox service a snapshot comes from (a run may have several)."""
    return f"{socket.gethostname()}:{os.getpid()}"


def publish_snapshot(events: EventPublisher, live: LiveSandboxes,
                     alive: Mapping[str, SandboxHandle], heartbeat_s: float,
                     lifecycle: Callable[[], dict[str, Any]] | None = None) -> None:
    """Publish one `sandbox.live` snapshot now, with the `lifecycle` figures (leased,
    reaped, failed deletes) when given."""
    rows = live.snapshot(alive, time.time())
    events.publish("sandbox.live", id=instance_name(), attrs={
        "instance": instance_name(), "heartbeat_s": heartbeat_s, "num_live": len(rows),
        "sandboxes": rows[:MAX_ROWS], **(lifecycle() if lifecycle else {})})


async def publish_live(events: EventPublisher, live: LiveSandboxes,
                       alive: Mapping[str, SandboxHandle], interval_s: float,
                       heartbeat_s: float,
                       lifecycle: Callable[[], dict[str, Any]] | None = None) -> None:
    """Snapshots until cancelled: on a change (checked every `interval_s`) or each
    `heartbeat_s`."""
    published_changes, published_at = -1, 0.0
    while True:
        if live.changes != published_changes or time.monotonic() - published_at >= heartbeat_s:
            published_changes, published_at = live.changes, time.monotonic()
            publish_snapshot(events, live, alive, heartbeat_s, lifecycle)
        await asyncio.sleep(interval_s)
