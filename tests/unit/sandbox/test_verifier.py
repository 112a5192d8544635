"""The verifier: rewards read from the task's own files, no verdict (never 0) otherwise."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from services._proto.riptide.v1 import common_pb2
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task
from services.sandbox.verifier import Verdict, parse_reward, verify

SCORED, NO_VERDICT = common_pb2.VERDICT_STATUS_SCORED, common_pb2.VERDICT_STATUS_NO_VERDICT


def _task(root: Path, test_sh: str, timeout_s: float = 20.0) -> Task:
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text(
        f'version = "1.0"\n[verifier]\ntimeout_sec = {timeout_s}\n'
        '[environment]\nallow_internet = false\n')
    (root / "instruction.md").write_text("Nothing to do.\n")
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "tests" / "test.sh").write_text(test_sh)
    (root / "tests" / "expected.txt").write_text("42\n")
    return Task.load(root)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig())
    yield provider
    asyncio.run(provider.close())


def _verify(provider: LocalProvider, task: Task) -> Verdict:
    async def run() -> Verdict:
        handle = await provider.create(task)
        try:
            return await verify(provider, handle, task)
        finally:
            await provider.delete(handle)

    return asyncio.run(run())


def test_reward_txt_is_read_and_tests_were_uploaded(provider: LocalProvider,
                                                    tmp_path: Path) -> None:
    task = _task(tmp_path, "cp /tests/expected.txt /logs/verifier/reward.txt\n")
    verdict = _verify(provider, task)
    assert (verdict.status, verdict.reward) == (SCORED, 42.0)


def test_reward_json_wins_over_txt(provider: LocalProvider, tmp_path: Path) -> None:
    task = _task(tmp_path, 'echo 0 > /logs/verifier/reward.txt\n'
                           'echo \'{"reward": 0.5}\' > /logs/verifier/reward.json\n')
    assert _verify(provider, task).reward == 0.5


def test_no_reward_file_is_no_verdict_not_zero(provider: LocalProvider, tmp_path: Path) -> None:
    verdict = _verify(provider, _task(tmp_path, "echo tests crashed; exit 3\n"))
    assert verdict.status == NO_VERDICT
    assert "no /logs/verifier/reward" in verdict.message and "tests crashed" in verdict.message
    assert verdict.cause == common_pb2.NO_VERDICT_CAUSE_VERIFIER_ERROR


def test_verifier_timeout_is_no_verdict(provider: LocalProvider, tmp_path: Path) -> None:
    task = _task(tmp_path, "echo 1 > /logs/verifier/reward.txt; sleep 30\n", timeout_s=0.5)
    verdict = _verify(provider, task)
    assert verdict.status == NO_VERDICT and "timed out" in verdict.message
    assert verdict.cause == common_pb2.NO_VERDICT_CAUSE_VERIFIER_TIMEOUT


def test_a_dead_sandbox_is_no_verdict(provider: LocalProvider, tmp_path: Path) -> None:
    task = _task(tmp_path, "echo 1 > /logs/verifier/reward.txt\n")

    async def run() -> Verdict:
        handle = await provider.create(task)
        await provider.delete(handle)
        return await verify(provider, handle, task)

    verdict = asyncio.run(run())
    assert verdict.status == NO_VERDICT and "sandbox failure" in verdict.message
    assert verdict.cause == common_pb2.NO_VERDICT_CAUSE_SANDBOX_LOST


def test_an_unreadable_reward_is_a_verifier_error(provider: LocalProvider,
                                                  tmp_path: Path) -> None:
    verdict = _verify(provider, _task(tmp_path, "echo pass > /logs/verifier/reward.txt\n"))
    assert verdict.status == NO_VERDICT and "not a float" in verdict.message
    assert verdict.cause == common_pb2.NO_VERDICT_CAUSE_VERIFIER_ERROR


def test_a_scored_verdict_has_no_cause(provider: LocalProvider, tmp_path: Path) -> None:
    verdict = _verify(provider, _task(tmp_path, "echo 1 > /logs/verifier/reward.txt\n"))
    assert verdict.status == SCORED
    assert verdict.cause == common_pb2.NO_VERDICT_CAUSE_UNSPECIFIED


def test_parse_reward_formats() -> None:
    assert parse_reward("reward.txt", " 1\n") == 1.0
    assert parse_reward("reward.json", '{"reward": 0.25, "other": "x"}') == 0.25
    assert parse_reward("reward.json", '{"score": 1}') == 1.0
    assert parse_reward("reward.json", "0.75") == 0.75
    for name, text in (("reward.txt", "pass"), ("reward.json", "{}"), ("reward.txt", "nan")):
        with pytest.raises(ValueError):
            parse_reward(name, text)
