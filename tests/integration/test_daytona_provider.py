"""The real `daytona` SDK against the local Daytona stand-in (services/testing/daytona_server.py).

An episode runs end to end through the sandbox service's runtime with the Daytona provider
(snapshots, labels, session commands, bulk upload and download, delete), and rate-limited
creates are retried with backoff or fail precisely.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.deployment import validate_config
from services.sandbox.config import DaytonaProviderConfig
from services.sandbox.provider import SandboxError
from services.sandbox.providers.daytona import DaytonaProvider
from services.sandbox.task import TaskSet
from services.testing.daytona_server import DaytonaServer

REPO = Path(__file__).resolve().parents[2]
TASKS = TaskSet.load(REPO / "tasks")
IMAGES = "riptide-tasks/{task}:latest"


@pytest.fixture(scope="module")
def daytona() -> Iterator[DaytonaServer]:
    with DaytonaServer(REPO / "tasks") as server:
        yield server


@pytest.fixture
def api_key(daytona: DaytonaServer, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("DAYTONA_API_KEY", daytona.api_key)
    return daytona.api_key


def _provider_config(daytona: DaytonaServer, **overrides: object) -> DaytonaProviderConfig:
    return DaytonaProviderConfig(api_url=daytona.api_url, image_template=IMAGES,
                                 session_command_min_timeout_s=20, **overrides)


@pytest.mark.slow
def test_episodes_run_end_to_end_through_the_daytona_sdk(daytona: DaytonaServer,
                                                         api_key: str) -> None:
    from services.sandbox.server import build_runtime

    provider = _provider_config(daytona).model_dump()
    config = validate_config({"run": {"admin_token": "admin-token", "name": "dtest"},
                              "sandbox": {"tasks_dir": str(REPO / "tasks"),
                                          "model_client": "scripted", "provider": provider}})
    names = TASKS.names[:2]

    async def run() -> list[common_pb2.Trajectory]:
        runtime = build_runtime(config)
        await runtime.start()
        try:
            async def one(name: str, index: int) -> common_pb2.Trajectory:
                request = sandbox_pb2.RunEpisodeRequest(task_id=name, sample_id=f"d-{index}")
                events = [e async for e in runtime.run_episode(request)]  # type: ignore[attr-defined]
                return events[-1].trajectory

            return await asyncio.gather(*(one(n, i) for i, n in enumerate(names * 2)))
        finally:
            await runtime.stop()

    before = daytona.state()
    trajectories = asyncio.run(run())
    assert [(t.status, t.reward) for t in trajectories] == \
        [(common_pb2.VERDICT_STATUS_SCORED, 1.0)] * 4, [t.status_message for t in trajectories]
    after = daytona.state()
    assert after["creates"] - before["creates"] == 4
    assert after["deletes"] - before["deletes"] == 4
    assert after["sandboxes"] == after["local_sandboxes"] == 0
    assert after["snapshot_creates"] - before["snapshot_creates"] == 2, "one snapshot per image"
    labels = after["created_labels"][-4:]
    assert {lab["riptide.episode"] for lab in labels} == {"d-0", "d-1", "d-2", "d-3"}
    assert {lab["riptide.run"] for lab in labels} == {"dtest"}
    assert {lab["riptide.task"] for lab in labels} == set(names)


def test_rate_limited_creates_are_retried_with_backoff(daytona: DaytonaServer,
                                                       api_key: str) -> None:
    task = TASKS.get(TASKS.names[0])
    config = _provider_config(daytona, backoff_initial_s=0.1, num_create_retries=4,
                              use_snapshots=False)

    async def run() -> tuple[float, dict[str, object], dict[str, object]]:
        provider = DaytonaProvider(config)
        try:
            daytona.reject_next_creates(3)
            started = time.monotonic()
            handle = await provider.create(task, labels={"riptide.episode": "retry"})
            elapsed = time.monotonic() - started
            result = await provider.exec(handle, "echo alive", 10)
            assert (result.exit_code, result.output) == (0, "alive\n")
            await provider.delete(handle)
            stats = provider.stats()
            daytona.reject_next_creates(10)
            with pytest.raises(SandboxError, match="Rate limit exceeded"):
                await provider.create(task)
            daytona.reject_next_creates(0)
            return elapsed, stats, provider.stats()
        finally:
            await provider.close()

    before = daytona.state()
    elapsed, stats, final = asyncio.run(run())
    after = daytona.state()
    assert stats["rate_limited"] == 3 and stats["created"] == 1
    assert after["rejected"] - before["rejected"] == 3 + 5  # then 1 try + 4 retries, all refused
    # Exponential backoff: at least half of 0.1 + 0.2 + 0.4 s (full jitter keeps 50-100%).
    assert elapsed >= 0.35
    assert final["created"] == 1 and after["sandboxes"] == 0
