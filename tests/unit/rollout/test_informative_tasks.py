"""The informative task sampler: tasks drawn by the chance that their next group varies."""

from __future__ import annotations

from collections import Counter

import pytest

from services.common.errors import ConfigError
from services.rollout.config import SchedulerConfig
from services.rollout.informative_tasks import InformativeTasks
from services.rollout.task_sampler import task_sampler


def draws(sampler: InformativeTasks, n: int) -> Counter[str]:
    return Counter(sampler.next_task() for _ in range(n))


def test_unseen_tasks_weigh_most_and_settled_ones_least() -> None:
    sampler = InformativeTasks(["new", "never", "always", "half"], group_size=8, floor=0.01)
    for _ in range(2):
        sampler.record_group("never", [0.0] * 8)
        sampler.record_group("always", [1.0] * 8)
        sampler.record_group("half", [1.0, 0.0] * 4)
    assert sampler.pass_rate("new") == 0.5
    assert sampler.pass_rate("never") == pytest.approx(0.5 / 17)
    assert sampler.weight("new") == pytest.approx(1 - 2 * 0.5**8)
    assert sampler.weight("half") == pytest.approx(1 - 2 * 0.5**8)
    # 16 failures in a row: a group of 8 varies with chance 1 - (1 - 0.5/17)^8 - (0.5/17)^8.
    assert sampler.weight("never") == pytest.approx(0.213, abs=1e-3)
    assert sampler.weight("always") == pytest.approx(sampler.weight("never"))
    counts = draws(sampler, 4000)
    assert counts["half"] > 3.5 * counts["never"] and counts["new"] > 3.5 * counts["always"]


def test_the_window_forgets_old_groups_so_a_task_the_policy_grew_into_comes_back() -> None:
    sampler = InformativeTasks(["a"], group_size=4, window_groups=2)
    for _ in range(5):
        sampler.record_group("a", [0.0] * 4)
    low = sampler.weight("a")
    sampler.record_group("a", [1.0, 0.0, 0.0, 0.0])
    sampler.record_group("a", [1.0, 1.0, 0.0, 0.0])
    assert sampler.pass_rate("a") == pytest.approx(3.5 / 9)
    assert sampler.weight("a") > 3 * low


def test_the_floor_keeps_every_task_drawn() -> None:
    sampler = InformativeTasks(["a", "b"], group_size=64, window_groups=8, floor=0.1, seed=1)
    for _ in range(8):
        sampler.record_group("a", [0.0] * 64)
    assert sampler.weight("a") == 0.1
    assert 0 < draws(sampler, 1100)["a"] < 200


def test_unknown_tasks_and_empty_groups_are_ignored_and_an_empty_set_is_refused() -> None:
    sampler = InformativeTasks(["a"], group_size=4)
    sampler.record_group("held-out", [1.0] * 4)
    sampler.record_group("a", [])
    assert sampler.pass_rate("a") == 0.5
    with pytest.raises(ConfigError, match="task set is empty"):
        InformativeTasks([], group_size=4)


def test_the_factory_builds_it_from_the_scheduler_config() -> None:
    config = SchedulerConfig(task_sampling="informative", n_samples_per_prompt=4,
                             task_sampling_window_groups=1, task_sampling_floor=0.2)
    sampler = task_sampler(config, ["a", "b"], seed=3)
    assert isinstance(sampler, InformativeTasks)
    sampler.record_group("a", [0.0] * 4)
    sampler.record_group("a", [0.0] * 4)
    assert sampler.pass_rate("a") == pytest.approx(0.1)  # one group in the window
    assert sampler.state() == {"task_sampling": "informative",
                               "task_weights": {"a": 0.344, "b": 0.875}}
