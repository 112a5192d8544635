"""What the scheduler talks to: where episodes run, where finished groups go, which task next.

The scheduler (scheduler.py) depends only on these small interfaces. The service wires the
real ones (sandbox_runner.py over Sandbox gRPC, the Redis SampleBuffer); the overlap bench and
unit tests wire simulated ones.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import ConfigError


class EpisodeRunner(Protocol):
    """Runs one episode to its end and returns its trajectory.

    An exception means the episode produced nothing usable; the scheduler records the sample
    as no_verdict (and drops its group). Cancellation must stop the episode.
    """

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory: ...


class GroupSink(Protocol):
    """Where complete groups go (the Redis sample buffer). `put` is idempotent by group id
    and may wait while the sink is full; an exception makes the scheduler retry."""

    async def put(self, group: common_pb2.Group) -> object: ...


class TaskCycle:
    """The task ids in a shuffled order, reshuffled every pass (one task is one prompt).

    A task whose last group came out with zero reward variance may sit out passes: the
    policy always or never solves it, so its groups teach nothing until the policy has
    moved. A pass is never empty: when every task is cooling, all of them are in it.
    """

    def __init__(self, task_ids: Sequence[str], seed: int = 0) -> None:
        if not task_ids:
            raise ConfigError("the task set is empty: give rollout.task_ids or bundle tasks")
        self._task_ids = list(task_ids)
        self._rng = random.Random(seed)
        self._order: list[str] = []
        self._cooling: dict[str, int] = {}  # task id -> passes left to sit out

    def __len__(self) -> int:
        return len(self._task_ids)

    @property
    def cooling(self) -> list[str]:
        """The tasks sitting out passes now."""
        return sorted(self._cooling)

    def next_task(self) -> str:
        """The next task id."""
        if not self._order:
            self._order = self._next_pass()
        return self._order.pop()

    def record_group(self, task_id: str, zero_variance: bool, cooldown_passes: int) -> None:
        """Note how a scored group of `task_id` came out; a zero-variance one sits the task
        out for the next `cooldown_passes` passes (0: not at all)."""
        if task_id not in self._task_ids:
            return
        if zero_variance and cooldown_passes:
            self._cooling[task_id] = cooldown_passes
        else:
            self._cooling.pop(task_id, None)

    def _next_pass(self) -> list[str]:
        order = [t for t in self._task_ids if t not in self._cooling] or list(self._task_ids)
        self._cooling = {t: left - 1 for t, left in self._cooling.items() if left > 1}
        self._rng.shuffle(order)
        return order


def no_verdict_trajectory(request: sandbox_pb2.RunEpisodeRequest,
                          message: str) -> common_pb2.Trajectory:
    """The trajectory that stands for an episode that failed before it was scored."""
    return common_pb2.Trajectory(
        sample_id=request.sample_id, group_id=request.group_id, task_id=request.task_id,
        sample_index=request.sample_index, status=common_pb2.VERDICT_STATUS_NO_VERDICT,
        status_message=message,
    )


def generated_versions(trajectory: common_pb2.Trajectory) -> set[int]:
    """The distinct weight versions of the model-generated tokens of a trajectory."""
    return {int(v) for v in trajectory.weight_versions if v >= 0}
