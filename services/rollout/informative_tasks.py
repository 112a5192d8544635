"""The `informative` task sampler: draw each task in proportion to the chance that its next
group has reward variance, so generation goes where advantages are non-zero.

A group whose samples all score the same teaches nothing (every advantage is 0) and, with
`drop_zero_variance_groups`, is dropped: the engine time it took is lost. Early in a run most
tasks are out of the policy's reach and a few are always solved; a uniform pass spends most
groups on them. Here a task's pass rate p is estimated from its last `window_groups` groups
(a sample passes when its reward is positive; a Jeffreys prior keeps a task never solved in
16 samples at p ~ 0.03, not 0), and the task is drawn with weight 1 - p^n - (1 - p)^n for
groups of n: the probability that such a group is not all-pass or all-fail. A task never
seen has p = 0.5 and is drawn first; `floor` keeps every task drawn now and then, so one the
policy has grown into is found again.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence
from typing import Any

from services.common.errors import ConfigError


class InformativeTasks:
    """Tasks drawn by the chance that their next group of `group_size` has reward variance."""

    def __init__(self, task_ids: Sequence[str], group_size: int, window_groups: int = 4,
                 floor: float = 0.05, seed: int = 0) -> None:
        if not task_ids:
            raise ConfigError("the task set is empty: give rollout.task_ids or bundle tasks")
        self._task_ids = list(dict.fromkeys(task_ids))
        self._group_size = group_size
        self._floor = floor
        self._rng = random.Random(seed)
        # task id -> (passed, samples) of each of its last `window_groups` scored groups
        self._recent: dict[str, deque[tuple[int, int]]] = {
            t: deque(maxlen=window_groups) for t in self._task_ids}

    def __len__(self) -> int:
        return len(self._task_ids)

    def pass_rate(self, task_id: str) -> float:
        """The estimated chance that one sample of `task_id` passes."""
        passed = sum(p for p, _ in self._recent[task_id])
        samples = sum(n for _, n in self._recent[task_id])
        return (passed + 0.5) / (samples + 1.0)

    def weight(self, task_id: str) -> float:
        """The chance that the task's next group has reward variance, at least `floor`."""
        p, n = self.pass_rate(task_id), self._group_size
        return max(self._floor, 1.0 - p**n - (1.0 - p) ** n)

    def next_task(self) -> str:
        weights = [self.weight(t) for t in self._task_ids]
        return self._rng.choices(self._task_ids, weights=weights)[0]

    def record_group(self, task_id: str, rewards: Sequence[float]) -> None:
        if task_id in self._recent and rewards:
            self._recent[task_id].append((sum(r > 0 for r in rewards), len(rewards)))

    def state(self) -> dict[str, Any]:
        return {"task_sampling": "informative",
                "task_weights": {t: round(self.weight(t), 3) for t in self._task_ids}}
