"""Every bundled task, run in a local sandbox: its oracle earns reward 1, no attempt earns 0."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.provider import SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task, TaskSet

TASKS_DIR = Path(__file__).resolve().parents[2] / "tasks"
TASKS = TaskSet.load(TASKS_DIR)
STARTER = {split: TaskSet.load(TASKS_DIR / "starter" / split) for split in ("train", "heldout")}


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig())
    yield provider
    asyncio.run(provider.close())


async def _reward(provider: SandboxProvider, task: Task, solve: bool) -> str:
    handle = await provider.create(task)
    try:
        if solve:
            await provider.upload(handle, task.solution_dir, "/solution")
            result = await provider.exec(handle, "bash /solution/solve.sh", timeout_s=60)
            assert result.exit_code == 0, f"{task.name} solve.sh: {result.output}"
        await provider.upload(handle, task.tests_dir, "/tests")
        result = await provider.exec(
            handle, "bash /tests/test.sh", timeout_s=task.config.verifier.timeout_sec
        )
        reward = await provider.exec(handle, "cat /logs/verifier/reward.txt", timeout_s=10)
        assert reward.exit_code == 0, f"{task.name}: no reward file; test.sh said {result.output}"
        return reward.stdout.strip()
    finally:
        await provider.delete(handle)


def _wrong_rewards(provider: LocalProvider, tasks: list[Task]) -> dict[tuple[str, bool], str]:
    """(task, solved) -> reward for every task whose oracle fails or whose no-attempt passes."""
    async def run_all() -> dict[tuple[str, bool], str]:
        limit = asyncio.Semaphore(8)

        async def one(task: Task, solve: bool) -> tuple[tuple[str, bool], str]:
            async with limit:
                return (task.name, solve), await _reward(provider, task, solve)

        pairs = await asyncio.gather(*(one(t, s) for t in tasks for s in (True, False)))
        return dict(pairs)

    rewards = asyncio.run(run_all())
    assert len(rewards) == 2 * len(tasks)
    return {key: r for key, r in rewards.items() if r != ("1" if key[1] else "0")}


@pytest.mark.slow
def test_oracle_passes_and_no_attempt_fails(provider: LocalProvider) -> None:
    assert len(TASKS) >= 10
    wrong = _wrong_rewards(provider, list(TASKS))
    assert not wrong, f"(task, solved) -> reward that should not be: {wrong}"
    assert provider.stats()["sandboxes_alive"] == 0


@pytest.mark.slow
def test_starter_tasks_oracle_passes_and_no_attempt_fails(provider: LocalProvider) -> None:
    """The starter set (tasks/starter/{train,heldout}): one- or two-command tasks."""
    train, heldout = STARTER["train"], STARTER["heldout"]
    assert len(train) + len(heldout) >= 24 and len(heldout) >= 8
    assert not set(train.names) & set(heldout.names)
    for task in [*train, *heldout]:
        solve = (task.solution_dir / "solve.sh").read_text().splitlines()
        assert len([line for line in solve[1:] if line.strip()]) <= 2, task.name
    wrong = _wrong_rewards(provider, [*train, *heldout])
    assert not wrong, f"(task, solved) -> reward that should not be: {wrong}"
    assert provider.stats()["sandboxes_alive"] == 0
