"""The events publisher against a real redis-server: everything arrives, caps hold, a run
exports to JSONL and loads back."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.common.config import EventsConfig, RedisConfig
from services.common.events import (
    EventPublisher,
    EventTail,
    episodes_key,
    events_key,
    export_events,
    load_episodes,
    load_events,
    read_episodes,
    read_events,
    stream_id_before,
)
from services.common.redis_connect import connect


def test_all_events_arrive_in_order_and_read_from_a_cursor(redis_config: RedisConfig) -> None:
    publisher = EventPublisher(redis_config, "run1", "trainer", EventsConfig())
    for step in range(3000):
        publisher.publish("trainer.step", id=str(step), start=100.0 + step, end=101.0 + step,
                          weight_version=step, attrs={"step": step})
    with publisher.span("trainer.checkpoint", id="3000") as attrs:
        attrs["step"] = 3000
    publisher.close(timeout_s=10.0)
    assert publisher.dropped == 0
    client = connect(redis_config)
    events = read_events(client, "run1")
    assert [e.id for _, e in events] == [str(s) for s in range(3001)]
    last = events[-1][1]
    assert last.kind == "trainer.checkpoint" and last.end >= last.start
    assert last.attrs == {"step": 3000} and last.service == "trainer"
    later = read_events(client, "run1", since_id=events[2999][0])
    assert [e.id for _, e in later] == ["3000"]


def test_max_len_is_honoured_on_both_streams(redis_config: RedisConfig) -> None:
    config = EventsConfig(max_len=100, episodes_max_len=10)
    publisher = EventPublisher(redis_config, "capped", "sandbox", config)
    for index in range(2000):
        publisher.publish("sandbox.create", id=str(index))
        if index % 10 == 0:
            publisher.publish_episode(lambda index=index: {"sample_id": str(index)})
    publisher.close(timeout_s=10.0)
    client = connect(redis_config)
    # MAXLEN ~ trims whole macro nodes (100 entries by default): at most one node over.
    assert 100 <= client.xlen(events_key("capped")) <= 200
    assert 10 <= client.xlen(episodes_key("capped")) <= 110
    newest = read_events(client, "capped", count=1000)[-1][1]
    assert newest.id == "1999"


def test_export_then_load_round_trip(redis_config: RedisConfig, workdir: Path) -> None:
    publisher = EventPublisher(redis_config, "done", "rollout", EventsConfig())
    publisher.publish("rollout.group_dropped", id="g1", attrs={"group_id": "g1",
                                                               "reason": "stale"})
    publisher.publish_episode(lambda: {"sample_id": "s1", "turns": [], "reward": 1.0})
    publisher.close(timeout_s=10.0)
    client = connect(redis_config)
    client.xadd(events_key("done"), {"event": b"{broken"})  # skipped, never fatal
    out = workdir / "run.jsonl"
    assert export_events(client, "done", out, chunk=1) == (1, 1)
    assert [e.attrs["reason"] for e in load_events(out)] == ["stale"]
    assert load_episodes(out) == [{"sample_id": "s1", "turns": [], "reward": 1.0}]
    assert [v["sample_id"] for _, v in read_episodes(client, "done")] == ["s1"]


def test_step_progress_prints_a_line_per_new_step_with_cache_hit_and_eta(
        redis_config: RedisConfig) -> None:
    import time

    from services.common.progress import StepProgress

    old = EventPublisher(redis_config, "live", "trainer", EventsConfig())
    old.publish("trainer.step", attrs={"step": 7})  # an earlier run's step: not shown
    old.close(timeout_s=10.0)
    time.sleep(0.01)
    progress = StepProgress(redis_config, "live", target_step=3)
    rollout = EventPublisher(redis_config, "live", "rollout", EventsConfig())
    rollout.publish("rollout.load", attrs={"in_flight": 3, "cap": 8, "engines": [
        {"engine": "e0", "dp_rank": 0, "prompt_tokens": 300, "cached_tokens": 240},
        {"engine": "e1", "dp_rank": 0, "prompt_tokens": 100, "cached_tokens": 0}]})
    rollout.close(timeout_s=10.0)
    trainer = EventPublisher(redis_config, "live", "trainer", EventsConfig())
    for step in (1, 2):
        trainer.publish("trainer.step", start=10.0, end=12.5, attrs={
            "step": step, "reward_mean": 0.25, "success_rate": 0.5, "groups": 2,
            "idle_fraction": 0.4, "staleness": [0, 1, 1, 2]})
    trainer.close(timeout_s=10.0)
    evaluation = EventPublisher(redis_config, "live", "rollout", EventsConfig())
    evaluation.publish("rollout.eval", id="2", start=20.0, end=50.0, weight_version=2, attrs={
        "weight_version": 2, "mean_success": 0.5, "per_task": {"b-task": 1.0, "a-task": 0.0}})
    evaluation.close(timeout_s=10.0)
    lines = progress.poll()
    progress.close()
    assert [line.split("]")[0] for line in lines] == ["[step 1", "[step 2", "[eval v2"]
    assert lines[2] == "[eval v2]  success 50%  tasks 2  solved b-task  took 30s"
    assert "reward 0.250" in lines[0] and "groups 2" in lines[0] and "idle 40%" in lines[0]
    assert "cache hit 60%" in lines[0] and "staleness 1.00 (max 2)" in lines[0]
    assert "ETA" not in lines[0] and "ETA " in lines[1]


def test_step_progress_feeds_the_live_metrics_exporter(redis_config: RedisConfig) -> None:
    from services.common.progress import StepProgress
    from services.common.tracking.exporter import MetricsExporter
    from services.common.tracking.scalars import Scalar

    class Collect:
        def __init__(self) -> None:
            self.scalars: list[Scalar] = []
            self.closed = False

        def write(self, scalars: list[Scalar]) -> None:
            self.scalars.extend(scalars)

        def close(self) -> None:
            self.closed = True

    sink = Collect()
    progress = StepProgress(redis_config, "tracked", exporter=MetricsExporter([sink]))
    publisher = EventPublisher(redis_config, "tracked", "trainer", EventsConfig())
    publisher.publish("trainer.step", start=1.0, end=3.0, attrs={"step": 5, "loss": 0.5})
    publisher.close(timeout_s=10.0)
    assert len(progress.poll()) == 1
    progress.close()
    assert {(s.tag, s.step, s.value) for s in sink.scalars} >= {("train/loss", 5, 0.5),
                                                                 ("train/step_time_s", 5, 2.0)}
    assert sink.closed


def test_step_progress_reads_a_step_added_in_its_first_millisecond(
    redis_config: RedisConfig, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.common import progress as progress_module

    # Redis numbers an entry by the millisecond it was added: a step written in the very
    # millisecond the progress started is <ms>-0, and was once skipped (about 1 run in 15).
    started_ms = 1_796_000_000_000
    publisher = EventPublisher(redis_config, "same-ms", "trainer", EventsConfig())
    publisher.publish("trainer.step", start=1.0, end=2.0, attrs={"step": 1})
    publisher.close(timeout_s=10.0)
    with connect(redis_config) as client:
        key = events_key("same-ms")
        [(_, fields)] = client.xrange(key)
        client.delete(key)
        for entry_id in (f"{started_ms - 1}-9", f"{started_ms}-0", f"{started_ms}-1",
                         f"{started_ms + 1}-0"):
            client.xadd(key, fields, id=entry_id)
    monkeypatch.setattr(progress_module.time, "time", lambda: started_ms / 1000 + 0.0004)
    progress = progress_module.StepProgress(redis_config, "same-ms")
    monkeypatch.undo()
    assert len(progress.poll()) == 3  # not the one from the millisecond before
    progress.close()
    assert stream_id_before(started_ms) == f"{started_ms - 1}-{2**64 - 1}"


def test_an_event_tail_reads_every_page_once(redis_config: RedisConfig) -> None:
    publisher = EventPublisher(redis_config, "paged", "rollout", EventsConfig())
    for i in range(25):
        publisher.publish("rollout.load", id=str(i), attrs={"in_flight": i})
    publisher.close()
    tail = EventTail(redis_config, "paged", page=10)
    assert [e.attrs["in_flight"] for e in tail.read()] == list(range(25))
    assert tail.read() == []
    tail.close()


def test_events_export_logs_in_with_the_password_from_the_environment(
    redis_config: RedisConfig, workdir: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from services.cli import main

    publisher = EventPublisher(redis_config, "exported", "trainer", EventsConfig())
    publisher.publish("trainer.step", attrs={"step": 1})
    publisher.close()
    out = workdir / "events.jsonl"
    argv = ["events", "export", "--redis", redis_config.url, "--run", "exported",
            "--out", str(out)]
    monkeypatch.delenv("RIPTIDE_REDIS_PASSWORD", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "refused user 'riptide'" in err and "RIPTIDE_REDIS_PASSWORD" in err
    monkeypatch.setenv("RIPTIDE_REDIS_PASSWORD", str(redis_config.password))
    assert main(argv) == 0
    assert [e.kind for e in load_events(out)] == ["trainer.step"]
