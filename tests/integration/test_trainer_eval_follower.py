"""Held-out eval results published by the rollout reach the trainer's metrics (real Redis)."""

from __future__ import annotations

import time

from services.common.config import EventsConfig, RedisConfig
from services.common.events import EventPublisher
from services.common.metrics import render
from services.trainer.eval_follower import EvalFollower
from services.trainer.objective.stats import TrainerStats


def publish_and_flush(
    redis_config: RedisConfig, events: list[tuple[str, int, dict[str, object]]],
) -> None:
    publisher = EventPublisher(redis_config, "run", "rollout", EventsConfig())
    for kind, version, attrs in events:
        publisher.publish(kind, id=str(version), weight_version=version, attrs=attrs)
    publisher.close()


def test_eval_events_become_trainer_metrics_once_each(redis_config: RedisConfig) -> None:
    stats = TrainerStats()
    follower = EvalFollower(redis_config, "run", stats)
    publish_and_flush(redis_config, [
        ("rollout.load", 0, {"in_flight": 3}),
        ("rollout.eval", 0, {"mean_success": 0.2, "per_task": {"a": 0.2}}),
        ("rollout.eval", 5, {"mean_success": 0.4, "per_task": {"a": 0.4}}),
        ("rollout.eval", 7, {"per_task": {}}),  # malformed: no mean_success
    ])
    assert follower.poll_once() == 2
    assert follower.poll_once() == 0  # nothing new, nothing counted twice
    publish_and_flush(redis_config, [("rollout.eval", 5, {"mean_success": 0.9}),
                                  ("rollout.eval", 10, {"mean_success": 0.5})])
    assert follower.poll_once() == 1
    state = stats.snapshot()["eval_success_by_weight_version"]
    assert state == {"0": 0.2, "5": 0.4, "10": 0.5}
    text = render().decode()
    assert "riptide_trainer_eval_success 0.5" in text
    assert "riptide_trainer_eval_weight_version 10.0" in text
    follower.stop()


def test_the_follower_thread_keeps_up_and_outlives_a_missing_stream(
    redis_config: RedisConfig,
) -> None:
    stats = TrainerStats()
    follower = EvalFollower(redis_config, "run", stats, interval_s=0.05)
    follower.start()
    time.sleep(0.2)  # polls an empty stream
    publish_and_flush(redis_config, [("rollout.eval", 3, {"mean_success": 1.0})])
    deadline = time.monotonic() + 10
    while not stats.eval_success and time.monotonic() < deadline:
        time.sleep(0.05)
    follower.stop()
    assert stats.eval_success == {3: 1.0}
