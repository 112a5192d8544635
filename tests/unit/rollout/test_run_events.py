"""The rollout's events: what the scheduler and the load loop publish, captured in memory."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from services.common.config import EventsConfig, RedisConfig
from services.common.events import Event, EventPublisher
from services.rollout.run_events import RolloutEvents
from services.testing.virtual_clock import run_virtual
from tests.unit.rollout.test_scheduler import ScriptedRunner, make


class CapturePublisher(EventPublisher):
    """Keeps what would be written, as validated events."""

    def __init__(self) -> None:
        super().__init__(RedisConfig(), "t", "rollout", EventsConfig())
        self.events: list[Event] = []

    def _put(self, item: tuple[str, str, Any]) -> None:
        self.events.append(Event.model_validate(item[2]))

    def kinds(self, kind: str) -> list[Event]:
        return [e for e in self.events if e.kind == kind]


def test_scheduler_publishes_each_episode_and_each_dropped_group_with_its_reason() -> None:
    runner = ScriptedRunner(
        fail=lambda r: r.group_id.endswith("1") and r.sample_index == 2,
        reward=lambda r: 1.0 if r.group_id.endswith("2") else float(r.sample_index % 2),
    )
    publisher = CapturePublisher()

    async def main() -> None:
        sched, _ = make(runner, max_concurrent_samples=4, drop_zero_variance_groups=True)
        sched.events = RolloutEvents(publisher)
        await sched.start()
        await asyncio.sleep(3.5)
        await sched.stop()

    run_virtual(main())
    episodes = publisher.kinds("rollout.episode")
    assert len(episodes) == 12
    verdicts = sorted(e.attrs["verdict"] for e in episodes)
    assert verdicts.count("no_verdict") == 1 and verdicts.count("scored") == 11
    first = next(e for e in episodes if e.attrs["verdict"] == "scored")
    assert first.attrs["response_tokens"] == 3 and first.attrs["weight_versions"] == [0]
    assert first.attrs["eval"] is False and first.end >= first.start
    dropped = {e.attrs["group_id"]: e.attrs["reason"]
               for e in publisher.kinds("rollout.group_dropped")}
    assert dropped == {"t-g000001": "no_verdict", "t-g000002": "zero_variance"}


@dataclass
class _Member:
    url: str
    ranks: int
    state: str
    weight_version: int | None
    load: list[dict[str, int]] | None


def test_load_joins_fleet_ranks_with_router_targets_and_pauses_become_spans() -> None:
    publisher = CapturePublisher()
    events = RolloutEvents(publisher)
    members = [_Member("http://e0", 2, "ready", 3, [
        {"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2},
        {"dp_rank": 1, "num_reqs": 1, "num_waiting_reqs": 0}]),
        _Member("http://e1", 1, "unreachable", 2, None)]
    targets = [{"engine_url": "http://e0/", "dp_rank": 1, "prompt_tokens": 100,
                "cached_tokens": 80, "healthy": True, "circuit_open": True}]
    events.load(6, 8, members, targets)
    (load,) = publisher.kinds("rollout.load")
    assert load.attrs["in_flight"] == 6 and load.attrs["cap"] == 8
    rows = {(r["engine"], r["dp_rank"]): r for r in load.attrs["engines"]}
    assert rows["http://e0", 0]["running"] == 3 and rows["http://e0", 0]["waiting"] == 2
    assert rows["http://e0", 1]["cached_tokens"] == 80 and rows["http://e0", 1]["circuit"] == "open"
    assert rows["http://e1", 0]["healthy"] is False and rows["http://e1", 0]["prompt_tokens"] == 0

    events.engines_paused(["http://e0", "http://e1"])
    events.engines_resumed("weight_update", 4, "committed")
    pauses = publisher.kinds("rollout.engine_pause")
    assert sorted(p.attrs["engine"] for p in pauses) == ["http://e0", "http://e1"]
    assert all(p.weight_version == 4 and p.end >= p.start for p in pauses)
    events.engines_resumed("weight_update", 5, "committed")  # nothing open: nothing new
    assert len(publisher.kinds("rollout.engine_pause")) == 2


def test_eval_is_published_once_all_its_episodes_are_in() -> None:
    publisher = CapturePublisher()
    events = RolloutEvents(publisher)
    events.eval_started(2)
    partial = {"2": {"mean_success": 0.0, "done": 1, "expected": 2, "tasks": {"a": 0.0}}}
    events.eval_done(2, partial)
    assert publisher.kinds("rollout.eval") == []
    full = {"2": {"mean_success": 0.5, "done": 2, "expected": 2, "tasks": {"a": 0.5}}}
    events.eval_done(2, full)
    (evaluation,) = publisher.kinds("rollout.eval")
    assert evaluation.attrs == {"weight_version": 2, "mean_success": 0.5, "per_task": {"a": 0.5}}


def test_an_episode_carries_where_its_time_went() -> None:
    from services._proto.riptide.v1 import common_pb2, sandbox_pb2

    publisher = CapturePublisher()
    trajectory = common_pb2.Trajectory(status=common_pb2.VERDICT_STATUS_SCORED, reward=1.0)
    trajectory.timings.CopyFrom(common_pb2.EpisodeTimings(
        queued_s=0.25, sandbox_create_s=0.0061, generate_s=2.7, exec_s=1.5, verify_s=0.12,
        total_s=4.6))
    RolloutEvents(publisher).episode(sandbox_pb2.RunEpisodeRequest(sample_id="s"), trajectory,
                                     started=0.0, weight_version=1)
    (episode,) = publisher.kinds("rollout.episode")
    assert episode.attrs["seconds"] == {"queued": 0.25, "create": 0.006, "generate": 2.7,
                                        "commands": 1.5, "verify": 0.12, "total": 4.6}
