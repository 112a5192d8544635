"""What the dashboard knows of a run: its events and its per-sample episodes, parsed.

Events come from the stream `riptide:<run>:events` (field `event`, a JSON span: kind,
service, start, end, id, weight_version, attrs); episodes from `riptide:<run>:episodes`
(field `episode`); the schema is services/common/events.py. A saved run is the JSONL file
its `export_events` writes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.errors import InvalidRequest, quote


@dataclass(frozen=True)
class Event:
    """One span (start == end for a point reading such as `rollout.load`)."""

    kind: str
    service: str
    start: float
    end: float | None  # None: the phase is still open
    id: str
    weight_version: int | None
    attrs: dict[str, Any]

    @classmethod
    def parse(cls, data: Any) -> Event:
        """An event from its decoded JSON; InvalidRequest names what is wrong."""
        if not isinstance(data, dict):
            raise InvalidRequest(f"event: expected an object, got {quote(data, 60)}")
        try:
            kind, start = data["kind"], data["start"]
        except KeyError as exc:
            raise InvalidRequest(f"event: no {exc.args[0]!r} in {quote(data, 80)}") from None
        end, attrs = data.get("end"), data.get("attrs") or {}
        if not isinstance(kind, str) or not _is_number(start) or not (
                end is None or _is_number(end)) or not isinstance(attrs, dict):
            raise InvalidRequest(f"event: bad kind/start/end/attrs in {quote(data, 80)}")
        version = data.get("weight_version")
        return cls(kind=kind, service=str(data.get("service", "")), start=float(start),
                   end=None if end is None else float(end), id=str(data.get("id", "")),
                   weight_version=version if isinstance(version, int) else None, attrs=attrs)

    @property
    def duration_s(self) -> float | None:
        return None if self.end is None else self.end - self.start


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class RunRecord:
    """A run's events (the newest `max_events`, indexed by kind) and the episodes seen so
    far, by sample id."""

    max_events: int = 200_000
    events: deque[Event] = field(default_factory=deque)
    by_kind: dict[str, deque[Event]] = field(default_factory=dict)
    episodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    now: float = 0.0  # the latest time any event mentions (a finished run's clock stops)
    num_bad: int = 0  # entries that were not events or episodes (skipped by live sources)

    def add_event(self, data: Any) -> None:
        event = Event.parse(data)
        self.events.append(event)
        self.by_kind.setdefault(event.kind, deque()).append(event)
        self.now = max(self.now, event.start, event.end or event.start)
        while len(self.events) > self.max_events:  # the oldest of all is the oldest of its kind
            self.by_kind[self.events.popleft().kind].popleft()

    def add_episode(self, data: Any) -> None:
        if not isinstance(data, dict) or "sample_id" not in data:
            raise InvalidRequest(f"episode: expected an object with sample_id, "
                                 f"got {quote(data, 60)}")
        self.episodes[str(data["sample_id"])] = data

    def of_kind(self, *kinds: str) -> list[Event]:
        """Events of these kinds, each kind in the order written."""
        return [e for kind in kinds for e in self.by_kind.get(kind, ())]


def load_jsonl(path: Path, max_events: int = 200_000) -> RunRecord:
    """A saved run from its export (`services.common.events.export_events`); a bad line is
    an error naming its number."""
    from services.common.events import load_episodes, load_events

    if not path.is_file():
        raise InvalidRequest(f"cannot read the events export {path}: no such file")
    record = RunRecord(max_events=max_events)
    for event in load_events(path):
        record.add_event(event.model_dump())
    for episode in load_episodes(path):
        record.add_episode(episode)
    return record
