"""The events publisher without Redis: it never blocks or raises, and counts what it drops."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from services.common.config import EventsConfig, RedisConfig
from services.common.errors import InvalidRequest
from services.common.events import (
    KINDS,
    WRITE_BATCH,
    Event,
    EventPublisher,
    load_episodes,
    load_events,
)
from services.testing.redis_server import free_port


def test_publish_with_redis_down_returns_fast_and_counts_every_drop() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    publisher = EventPublisher(RedisConfig(url=url), "t", "rollout", EventsConfig(queue_size=1000),
                               connect_timeout_s=0.2, retry_after_s=0.05)
    started = time.perf_counter()
    for index in range(10_000):
        publisher.publish("rollout.episode", id=str(index), attrs={"reward": 1.0})
    elapsed = time.perf_counter() - started
    assert elapsed < 1.0, f"10k publishes took {elapsed:.2f} s"
    # The queue holds 1000; the writer may hold one more batch, taken but not yet failed.
    assert publisher.dropped >= 10_000 - 1000 - WRITE_BATCH
    publisher.close(timeout_s=5.0)
    assert publisher.dropped == 10_000


def test_disabled_publisher_queues_nothing_and_starts_no_thread() -> None:
    publisher = EventPublisher(RedisConfig(url="redis://127.0.0.1:1/0"), "t", "trainer",
                               EventsConfig(enabled=False))
    publisher.publish("trainer.step")
    publisher.publish_episode(lambda: {"sample_id": "s"})
    with publisher.span("trainer.checkpoint"):
        pass
    assert publisher._thread is None and publisher.dropped == 0


def test_unserializable_or_failing_episode_builder_is_dropped_not_raised() -> None:
    nowhere = RedisConfig(url=f"redis://127.0.0.1:{free_port()}/0")
    publisher = EventPublisher(nowhere, "t", "sandbox", EventsConfig(), connect_timeout_s=0.2)

    def broken() -> dict[str, object]:
        raise RuntimeError("decoder failed")

    publisher.publish_episode(broken)
    publisher.close(timeout_s=5.0)
    assert publisher.dropped == 1


def test_every_kind_is_documented_with_a_service_prefix() -> None:
    for kind, doc in KINDS.items():
        assert kind.split(".")[0] in ("trainer", "rollout", "sandbox", "router"), kind
        assert len(doc) > 10


def test_load_events_reports_the_bad_line(workdir: Path) -> None:
    good = Event(kind="trainer.step", service="trainer", start=1.0, end=2.0,
                 attrs={"step": 1}).model_dump()
    path = workdir / "events.jsonl"
    path.write_text(json.dumps({"entry_id": "1-0", "event": good}) + "\n"
                    + json.dumps({"entry_id": "1-0", "episode": {"sample_id": "s"}}) + "\n")
    assert [e.attrs for e in load_events(path)] == [{"step": 1}]
    assert load_episodes(path) == [{"sample_id": "s"}]
    path.write_text(json.dumps({"entry_id": "2-0", "event": {"kind": "x"}}) + "\n")
    with pytest.raises(InvalidRequest, match="events.jsonl:1: not an event"):
        load_events(path)
    path.write_text("{not json\n")
    with pytest.raises(InvalidRequest, match="events.jsonl:1: not a JSON line"):
        load_events(path)
