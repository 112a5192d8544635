"""The `cycle` task sampler: shuffled passes over the task set, with a zero-variance cooldown."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from services.common.errors import ConfigError


class TaskCycle:
    """The task ids in a shuffled order, reshuffled every pass (one task is one prompt).

    A task whose last group came out with zero reward variance may sit out the next
    `cooldown_passes` passes (0: never): the policy always or never solves it, so its groups
    teach nothing until the policy has moved. A pass is never empty: when every task is
    cooling, all of them are in it.
    """

    def __init__(self, task_ids: Sequence[str], cooldown_passes: int = 0, seed: int = 0) -> None:
        if not task_ids:
            raise ConfigError("the task set is empty: give rollout.task_ids or bundle tasks")
        self._task_ids = list(task_ids)
        self._cooldown_passes = cooldown_passes
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
        if not self._order:
            self._order = self._next_pass()
        return self._order.pop()

    def record_group(self, task_id: str, rewards: Sequence[float]) -> None:
        if task_id not in self._task_ids:
            return
        if len(set(rewards)) <= 1 and self._cooldown_passes:
            self._cooling[task_id] = self._cooldown_passes
        else:
            self._cooling.pop(task_id, None)

    def state(self) -> dict[str, Any]:
        return {"task_sampling": "cycle", "cooling_tasks": self.cooling}

    def _next_pass(self) -> list[str]:
        order = [t for t in self._task_ids if t not in self._cooling] or list(self._task_ids)
        self._cooling = {t: left - 1 for t, left in self._cooling.items() if left > 1}
        self._rng.shuffle(order)
        return order
