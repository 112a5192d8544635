"""Which task next: a shuffled pass over the task set, and the zero-variance cooldown."""

from __future__ import annotations

from collections import Counter

import pytest

from services.common.errors import ConfigError
from services.rollout.episodes import TaskCycle


def one_pass(cycle: TaskCycle, size: int) -> list[str]:
    return [cycle.next_task() for _ in range(size)]


def test_each_pass_holds_every_task_once() -> None:
    cycle = TaskCycle(["a", "b", "c", "d"], seed=3)
    for _ in range(3):
        assert sorted(one_pass(cycle, 4)) == ["a", "b", "c", "d"]


def test_a_zero_variance_task_sits_out_its_passes_then_returns() -> None:
    cycle = TaskCycle(["a", "b", "c"], seed=0)
    one_pass(cycle, 3)
    cycle.record_group("a", zero_variance=True, cooldown_passes=2)
    assert cycle.cooling == ["a"]
    assert sorted(one_pass(cycle, 2)) == ["b", "c"]
    assert sorted(one_pass(cycle, 2)) == ["b", "c"]
    assert cycle.cooling == []
    assert sorted(one_pass(cycle, 3)) == ["a", "b", "c"]


def test_a_group_with_variance_ends_the_cooldown() -> None:
    cycle = TaskCycle(["a", "b"], seed=0)
    cycle.record_group("a", zero_variance=True, cooldown_passes=5)
    cycle.record_group("a", zero_variance=False, cooldown_passes=5)
    assert cycle.cooling == []
    assert sorted(one_pass(cycle, 2)) == ["a", "b"]


def test_no_cooldown_when_it_is_off_and_no_empty_pass_when_all_cool() -> None:
    cycle = TaskCycle(["a", "b"], seed=0)
    cycle.record_group("a", zero_variance=True, cooldown_passes=0)
    assert cycle.cooling == []
    for task in ("a", "b"):
        cycle.record_group(task, zero_variance=True, cooldown_passes=1)
    assert Counter(one_pass(cycle, 4)) == {"a": 2, "b": 2}  # all cooling: all in


def test_unknown_tasks_are_ignored_and_an_empty_set_is_refused() -> None:
    cycle = TaskCycle(["a"])
    cycle.record_group("held-out", zero_variance=True, cooldown_passes=3)
    assert cycle.cooling == []
    with pytest.raises(ConfigError, match="task set is empty"):
        TaskCycle([])
