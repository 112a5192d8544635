"""Where the dashboard reads a run from: the live events streams in Redis, or a saved export.

A live source reads the events stream incrementally (XRANGE after the last id it saw) into a
RunRecord; one sample's episode is fetched only when asked for, newest entries first, and
the ids it passed on the way are remembered so the next lookup is one XRANGE.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Protocol

from services.common.config import RedisConfig
from services.common.errors import InvalidRequest, Unavailable
from services.common.events import episodes_key, events_key
from services.rollout.dashboard.record import RunRecord, load_jsonl

log = logging.getLogger(__name__)
READ_CHUNK = 5000
SCAN_CHUNK = 100
#: A run is live while its newest event is at most this old: a running rollout service
#: publishes a load reading about every second and a sandbox service a snapshot every 10 s,
#: so half a minute of silence means the run has ended (or every publisher is stuck).
LIVE_WITHIN_S = 30.0


class EventSource(Protocol):
    """What the dashboard's routes read."""

    @property
    def live(self) -> bool:
        """The run is running now (its events are recent)."""
        ...

    @property
    def follows(self) -> bool:
        """The source may still change, so the page keeps polling (a Redis stream does)."""
        ...

    async def refresh(self) -> RunRecord:
        """The record, brought up to date."""
        ...

    async def episode(self, sample_id: str) -> dict[str, Any] | None:
        """One sample's detail, or None when it is not (or no longer) kept."""
        ...

    async def aclose(self) -> None: ...


class FileSource:
    """A finished run saved as a JSONL export (read once)."""

    live = False
    follows = False

    def __init__(self, path: Path, max_events: int = 200_000) -> None:
        self.record = load_jsonl(path, max_events)

    async def refresh(self) -> RunRecord:
        return self.record

    async def episode(self, sample_id: str) -> dict[str, Any] | None:
        return self.record.episodes.get(sample_id)

    async def aclose(self) -> None:
        pass


class RedisSource:
    """The run's events streams in Redis, live or after the run."""

    follows = True

    def __init__(self, redis: RedisConfig, run: str, max_events: int = 200_000) -> None:
        from services.common.redis_connect import connect_async

        self.client: Any = connect_async(redis, socket_connect_timeout=5.0)
        self.run = run
        self.record = RunRecord(max_events=max_events)
        self._last_id = "-"
        self._episode_ids: dict[str, bytes] = {}  # sample id -> episodes entry id
        self._indexed: set[bytes] = set()
        self._oldest_indexed: bytes | None = None

    @property
    def live(self) -> bool:
        """Whether the run's newest event is recent (a finished run's stream is not live)."""
        return self.record.now > 0 and time.time() - self.record.now <= LIVE_WITHIN_S

    async def refresh(self) -> RunRecord:
        import redis

        try:
            while True:
                start = "-" if self._last_id == "-" else f"({self._last_id}"
                entries = await self.client.xrange(events_key(self.run), start, "+",
                                                   count=READ_CHUNK)
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode()
                    self._add(fields.get(b"event"))
                if len(entries) < READ_CHUNK:
                    return self.record
        except redis.RedisError as exc:
            raise Unavailable(f"cannot read the events stream: {exc}") from None

    def _add(self, raw: bytes | None) -> None:
        try:
            self.record.add_event(json.loads(raw or b"null"))
        except (ValueError, InvalidRequest) as exc:
            self.record.num_bad += 1
            if self.record.num_bad == 1:
                log.warning("skipping a malformed event (counted in the dashboard): %s", exc)

    async def episode(self, sample_id: str) -> dict[str, Any] | None:
        import redis

        try:
            entry_id = self._episode_ids.get(sample_id)
            if entry_id is not None:
                entries = await self.client.xrange(episodes_key(self.run), entry_id, entry_id)
                return _decode_episode(entries[0][1]) if entries else None
            return await self._scan_for(sample_id)
        except redis.RedisError as exc:
            raise Unavailable(f"cannot read the episodes stream: {exc}") from None

    async def _scan_for(self, sample_id: str) -> dict[str, Any] | None:
        """Newest first; past the entries earlier scans indexed, on below the oldest of them."""
        upper: Any = "+"
        while True:
            entries = await self.client.xrevrange(episodes_key(self.run), upper, "-",
                                                  count=SCAN_CHUNK)
            for entry_id, fields in entries:
                if entry_id in self._indexed:
                    assert self._oldest_indexed is not None
                    upper = b"(" + self._oldest_indexed
                    break
                self._indexed.add(entry_id)
                if self._oldest_indexed is None or _order(entry_id) < _order(
                        self._oldest_indexed):
                    self._oldest_indexed = entry_id
                episode = _decode_episode(fields)
                if episode is not None:
                    self._episode_ids[str(episode.get("sample_id"))] = entry_id
                    if str(episode.get("sample_id")) == sample_id:
                        return episode
            else:
                if len(entries) < SCAN_CHUNK:
                    return None
                upper = b"(" + entries[-1][0]

    async def aclose(self) -> None:
        await self.client.aclose()


def _order(entry_id: bytes) -> tuple[int, int]:
    millis, _, seq = entry_id.partition(b"-")
    return int(millis), int(seq or 0)


def _decode_episode(fields: dict[bytes, bytes]) -> dict[str, Any] | None:
    try:
        episode = json.loads(fields.get(b"episode") or b"null")
    except ValueError:
        return None
    return episode if isinstance(episode, dict) else None
