"""Which task next: a shuffled pass over the task set, and the zero-variance cooldown."""

from __future__ import annotations

from collections import Counter

import pytest

from services.common.errors import ConfigError
from services.rollout.config import SchedulerConfig
from services.rollout.task_cycle import TaskCycle
from services.rollout.task_sampler import task_sampler


def one_pass(cycle: TaskCycle, size: int) -> list[str]:
    return [cycle.next_task() for _ in range(size)]


def test_each_pass_holds_every_task_once() -> None:
    cycle = TaskCycle(["a", "b", "c", "d"], seed=3)
    for _ in range(3):
        assert sorted(one_pass(cycle, 4)) == ["a", "b", "c", "d"]


def test_a_zero_variance_task_sits_out_its_passes_then_returns() -> None:
    cycle = TaskCycle(["a", "b", "c"], cooldown_passes=2, seed=0)
    one_pass(cycle, 3)
    cycle.record_group("a", [0.0] * 4)
    assert cycle.cooling == ["a"]
    assert sorted(one_pass(cycle, 2)) == ["b", "c"]
    assert sorted(one_pass(cycle, 2)) == ["b", "c"]
    assert cycle.cooling == []
    assert sorted(one_pass(cycle, 3)) == ["a", "b", "c"]


def test_a_group_with_variance_ends_the_cooldown() -> None:
    cycle = TaskCycle(["a", "b"], cooldown_passes=5, seed=0)
    cycle.record_group("a", [1.0, 1.0])
    assert cycle.cooling == ["a"]
    cycle.record_group("a", [1.0, 0.0])
    assert cycle.cooling == []
    assert sorted(one_pass(cycle, 2)) == ["a", "b"]


def test_no_cooldown_when_it_is_off_and_no_empty_pass_when_all_cool() -> None:
    off = TaskCycle(["a", "b"], seed=0)
    off.record_group("a", [0.0, 0.0])
    assert off.cooling == []
    cycle = TaskCycle(["a", "b"], cooldown_passes=1, seed=0)
    for task in ("a", "b"):
        cycle.record_group(task, [0.0, 0.0])
    assert Counter(one_pass(cycle, 4)) == {"a": 2, "b": 2}  # all cooling: all in


def test_unknown_tasks_are_ignored_and_an_empty_set_is_refused() -> None:
    cycle = TaskCycle(["a"], cooldown_passes=3)
    cycle.record_group("held-out", [0.0, 0.0])
    assert cycle.cooling == []
    with pytest.raises(ConfigError, match="task set is empty"):
        TaskCycle([])


def test_the_factory_builds_the_cycle_by_default_with_the_configured_cooldown() -> None:
    sampler = task_sampler(SchedulerConfig(zero_variance_cooldown_passes=1), ["a", "b"])
    assert isinstance(sampler, TaskCycle)
    sampler.record_group("a", [0.0] * 8)
    assert sampler.state() == {"task_sampling": "cycle", "cooling_tasks": ["a"]}
