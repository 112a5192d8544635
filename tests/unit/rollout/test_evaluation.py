"""Evaluation during training: held-out episodes at due weight versions take the next free
slots, never reach the stream, and their results are kept by version."""

from __future__ import annotations

import asyncio

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.rollout.config import EvalConfig, SchedulerConfig
from services.rollout.evaluation import EvalQueue
from services.rollout.scheduler import Scheduler
from services.rollout.task_cycle import TaskCycle
from services.testing.memory_sink import MemorySink
from services.testing.virtual_clock import run_virtual


class Runner:
    """Training episodes take 1 s; held-out `h1` succeeds from version 2 on, `h2` never."""

    def __init__(self) -> None:
        self.version = 0
        self.started: list[tuple[float, str, float]] = []

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
        loop = asyncio.get_running_loop()
        self.started.append((loop.time(), request.sample_id,
                             request.sampling_params.temperature))
        await asyncio.sleep(1.0)
        reward = float(request.sample_index % 2)
        if request.task_id == "h1":
            reward = float(self.version >= 2)
        elif request.task_id == "h2":
            reward = 0.0
        return common_pb2.Trajectory(response_ids=[1], loss_mask=[1],
                                     weight_versions=[self.version], reward=reward,
                                     status=common_pb2.VERDICT_STATUS_SCORED)


def test_due_versions_are_evaluated_in_the_next_free_slots_and_kept_by_version() -> None:
    runner = Runner()
    evaluation = EvalQueue(EvalConfig(interval_steps=2, task_ids=["h1", "h2"], num_samples=2),
                           max_new_tokens=16, top_p=1.0)
    config = SchedulerConfig(max_concurrent_samples=4, n_samples_per_prompt=2,
                             num_groups_per_batch=1, max_staleness=None, temperature=0.8)
    sink = MemorySink()

    async def main() -> None:
        sched = Scheduler(config, TaskCycle(["a"]), runner, sink, id_prefix="t",
                          evaluation=evaluation)
        await sched.start()
        await asyncio.sleep(0.5)
        assert [s for _, s, _ in runner.started] == [
            "eval-v0-h1-s0", "eval-v0-h1-s1", "eval-v0-h2-s0", "eval-v0-h2-s1"]
        assert all(t == 0.0 for _, _, t in runner.started), "greedy by default"
        await asyncio.sleep(1.0)  # the evaluation finished; training took the slots
        for version in (1, 2, 3):
            runner.version = version
            sched.set_weight_version(version)
            await asyncio.sleep(1.2)
        state = sched.state()
        await sched.stop()
        assert state["in_flight_samples"] <= 4
        assert set(state["eval"]) == {"0", "2"}, "versions 1 and 3 are not due"
        assert state["eval"]["0"]["mean_success"] == 0.0
        assert state["eval"]["2"] == {"mean_success": 0.5, "done": 4, "expected": 4,
                                      "tasks": {"h1": 1.0, "h2": 0.0}}
        v2 = [t for t, s, _ in runner.started if s.startswith("eval-v2")]
        assert len(v2) == 4 and max(v2) - min(v2) <= 1.0, "eval takes the next free slots"

    run_virtual(main())
    assert sink.groups and all(not g.group_id.startswith("eval") for g in sink.groups)


def test_evaluation_is_off_by_default() -> None:
    queue = EvalQueue(EvalConfig(), max_new_tokens=8, top_p=1.0)
    queue.on_version(0)
    assert not queue.enabled and queue.next_request() is None and queue.summary() == {}
