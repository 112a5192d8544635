"""Every class of missing verdict, produced for real and classified where it is detected.

The episode runner runs on local (bubblewrap) sandboxes; model turns come from the scripted
client, or through the real router process from an SGLang-contract engine process that
refuses long prompts with SGLang's own 400 (context overflow) or fails (engine error). Only
the hung provider of the agent-timeout case is a fake: no real provider hangs on demand.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.episode import EpisodeRunner
from services.sandbox.model_client import (
    ModelClient,
    RouterModelClient,
    ScriptedModelClient,
    command_turn,
)
from services.sandbox.provider import SandboxProvider
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.stats import SandboxStats
from services.sandbox.task import Task
from services.testing.fake_provider import FakeProvider
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess

CHAT = ChatFormat(build_tokenizer())
NO_VERDICT = common_pb2.VERDICT_STATUS_NO_VERDICT


def _task(root: Path, test_sh: str = "echo 1 > /logs/verifier/reward.txt\n",
          verifier_timeout_s: float = 20.0) -> Task:
    (root / "environment").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "task.toml").write_text(
        f'version = "1.0"\n[verifier]\ntimeout_sec = {verifier_timeout_s}\n'
        '[agent]\ntimeout_sec = 60\n[environment]\nallow_internet = false\n')
    (root / "instruction.md").write_text("Nothing to do.\n")
    (root / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (root / "tests" / "test.sh").write_text(test_sh)
    return Task.load(root)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    root = Path(tempfile.mkdtemp(prefix="riptide-test-trees-"))
    root.chmod(0o711)  # sandbox uids must reach their own trees below it
    provider = LocalProvider(LocalProviderConfig(root_dir=root,
                                                 fail_create_while=root / "fail-creates"))
    yield provider
    asyncio.run(provider.close())
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def router() -> Iterator[tuple[RouterProcess, SimEngineProcess]]:
    with SimEngineProcess() as engine, RouterProcess() as router:
        router.register(engine.url)
        yield router, engine


def _scripted(turns: list[str]) -> ScriptedModelClient:
    return ScriptedModelClient(CHAT, lambda key: turns)


def _episode(provider: SandboxProvider, model: ModelClient, task: Task,
             agent: AgentConfig | None = None,
             on_progress: Callable[[EpisodeRunner, sandbox_pb2.EpisodeProgress], None]
             | None = None) -> tuple[common_pb2.Trajectory, SandboxStats]:
    config = agent or AgentConfig(persistent_shell=False, max_turns=2)
    stats = SandboxStats()
    runner = EpisodeRunner(provider, TerminalAgent(model, CHAT, provider, config), stats,
                           max_concurrent_episodes=4, max_concurrent_creates=4, run_name="t")
    request = sandbox_pb2.RunEpisodeRequest(task_id=task.name, sample_id="s-1", group_id="g-1")

    def emit(progress: sandbox_pb2.EpisodeProgress) -> None:
        if on_progress is not None:
            on_progress(runner, progress)

    async def run() -> common_pb2.Trajectory:
        trajectory = await runner.run(task, request, emit)
        await runner.drain_deletes(10)
        return trajectory

    trajectory = asyncio.run(run())
    assert not stats.alive, "a sandbox outlived its episode"
    return trajectory, stats


def _assert_cause(trajectory: common_pb2.Trajectory, stats: SandboxStats, name: str) -> None:
    assert trajectory.status == NO_VERDICT, trajectory.status_message
    cause = common_pb2.NoVerdictCause.Name(trajectory.no_verdict_cause)
    assert cause == f"NO_VERDICT_CAUSE_{name.upper()}", trajectory.status_message
    assert stats.no_verdict_by_cause == {name: 1}
    assert stats.snapshot()["no_verdict_by_cause"] == {name: 1}


def test_a_scored_episode_has_no_cause(provider: LocalProvider, tmp_path: Path) -> None:
    trajectory, stats = _episode(provider, _scripted([]), _task(tmp_path / "ok"))
    assert trajectory.status == common_pb2.VERDICT_STATUS_SCORED and trajectory.reward == 1.0
    assert trajectory.no_verdict_cause == common_pb2.NO_VERDICT_CAUSE_UNSPECIFIED
    assert stats.no_verdict_by_cause == {}


def test_provider_create_failed(provider: LocalProvider, tmp_path: Path) -> None:
    flag = provider.config.fail_create_while
    assert flag is not None
    flag.touch()
    try:
        trajectory, stats = _episode(provider, _scripted([]), _task(tmp_path / "t"))
    finally:
        flag.unlink()
    _assert_cause(trajectory, stats, "provider_create_failed")
    assert "injected fault" in trajectory.status_message


def test_sandbox_lost(provider: LocalProvider, tmp_path: Path) -> None:
    def lose_sandbox(runner: EpisodeRunner, progress: sandbox_pb2.EpisodeProgress) -> None:
        if progress.kind == "turn":  # the command is about to run: the sandbox vanishes
            for handle in list(runner.stats.alive.values()):
                asyncio.get_running_loop().call_later(
                    0.5, lambda h=handle: asyncio.ensure_future(provider.delete(h)))

    trajectory, stats = _episode(provider, _scripted([command_turn("sleep 20", 30)]),
                                 _task(tmp_path / "t"), on_progress=lose_sandbox)
    _assert_cause(trajectory, stats, "sandbox_lost")
    assert "deleted" in trajectory.status_message


def test_agent_timeout(tmp_path: Path) -> None:
    # A provider call that hangs past every timeout (a stuck control-plane request).
    hung = FakeProvider(delay_s=30.0)
    agent = AgentConfig(wall_time_s=0.5, stop_grace_s=0.5, persistent_shell=False)
    trajectory, stats = _episode(hung, _scripted([command_turn("true", 1)]),
                                 _task(tmp_path / "t"), agent)
    _assert_cause(trajectory, stats, "agent_timeout")
    assert "did not stop within 1 s" in trajectory.status_message


def test_agent_error(provider: LocalProvider, tmp_path: Path) -> None:
    def crashing_harness(session_key: str) -> list[str]:
        raise ValueError("the harness could not parse its own config")

    model = ScriptedModelClient(CHAT, crashing_harness)
    trajectory, stats = _episode(provider, model, _task(tmp_path / "t"))
    _assert_cause(trajectory, stats, "agent_error")
    assert "ValueError: the harness could not parse" in trajectory.status_message


def test_context_overflow(provider: LocalProvider, tmp_path: Path,
                          router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proxy, engine = router
    engine.control(context_len=16)  # the prompt alone is longer
    try:
        trajectory, stats = _episode(provider, RouterModelClient(proxy.address),
                                     _task(tmp_path / "t"))
    finally:
        engine.control(context_len=0)
    _assert_cause(trajectory, stats, "context_overflow")
    assert "longer than the model's context length" in trajectory.status_message


def test_engine_error(provider: LocalProvider, tmp_path: Path,
                      router: tuple[RouterProcess, SimEngineProcess]) -> None:
    proxy, engine = router
    engine.control(fail_generate_status=500)
    try:
        trajectory, stats = _episode(provider, RouterModelClient(proxy.address, num_retries=0),
                                     _task(tmp_path / "t"))
    finally:
        engine.control(fail_generate_status=0)
    _assert_cause(trajectory, stats, "engine_error")
    assert "EngineError" in trajectory.status_message


def test_verifier_error(provider: LocalProvider, tmp_path: Path) -> None:
    task = _task(tmp_path / "t", test_sh="echo tests crashed; exit 2\n")
    trajectory, stats = _episode(provider, _scripted([]), task)
    _assert_cause(trajectory, stats, "verifier_error")


def test_verifier_timeout(provider: LocalProvider, tmp_path: Path) -> None:
    task = _task(tmp_path / "t", test_sh="sleep 30\n", verifier_timeout_s=0.5)
    trajectory, stats = _episode(provider, _scripted([]), task)
    _assert_cause(trajectory, stats, "verifier_timeout")
