"""Which task the next group is of: the small interface the scheduler draws tasks from, and the
factory that picks an implementation by `rollout.scheduler.task_sampling`.

- `cycle` (task_cycle.py): shuffled passes over the task set; a task whose group came out with
  zero reward variance may sit out passes.
- `informative` (informative_tasks.py): each task drawn in proportion to the chance that its
  next group has reward variance, estimated from its recent groups.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from services.rollout.config import SchedulerConfig


class TaskSampler(Protocol):
    """Hands out task ids and learns from how each scored group came out."""

    def __len__(self) -> int: ...

    def next_task(self) -> str:
        """The task of the next group."""
        ...

    def record_group(self, task_id: str, rewards: Sequence[float]) -> None:
        """A group of `task_id` was scored with these rewards (ids outside the set: ignored)."""
        ...

    def state(self) -> dict[str, Any]:
        """What the admin state shows of the sampler."""
        ...


def task_sampler(config: SchedulerConfig, task_ids: Sequence[str], seed: int = 0) -> TaskSampler:
    """The sampler `config.task_sampling` names, over `task_ids`."""
    if config.task_sampling == "informative":
        from services.rollout.informative_tasks import InformativeTasks

        return InformativeTasks(task_ids, config.n_samples_per_prompt,
                                window_groups=config.task_sampling_window_groups,
                                floor=config.task_sampling_floor, seed=seed)
    from services.rollout.task_cycle import TaskCycle

    return TaskCycle(task_ids, cooldown_passes=config.zero_variance_cooldown_passes, seed=seed)
