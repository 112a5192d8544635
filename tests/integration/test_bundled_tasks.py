"""Every bundled task, run in a local sandbox: its oracle earns reward 1, no attempt earns 0."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.sandbox.provider import SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task, TaskSet

TASKS = TaskSet.load(Path(__file__).resolve().parents[2] / "tasks")


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


@pytest.mark.slow
def test_oracle_passes_and_no_attempt_fails(provider: LocalProvider) -> None:
    async def run_all() -> dict[tuple[str, bool], str]:
        limit = asyncio.Semaphore(8)

        async def one(task: Task, solve: bool) -> tuple[tuple[str, bool], str]:
            async with limit:
                return (task.name, solve), await _reward(provider, task, solve)

        pairs = await asyncio.gather(*(one(t, s) for t in TASKS for s in (True, False)))
        return dict(pairs)

    rewards = asyncio.run(run_all())
    wrong = {key: r for key, r in rewards.items() if r != ("1" if key[1] else "0")}
    assert not wrong, f"(task, solved) -> reward that should not be: {wrong}"
    assert len(rewards) == 2 * len(TASKS) >= 20
    assert provider.stats()["sandboxes_alive"] == 0
