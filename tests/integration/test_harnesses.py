"""Harbor's Terminus-2 and mini-swe-agent, unchanged, run whole episodes of a bundled task on a
real local sandbox against a scripted OpenAI-compatible server; the task's own tests score
what they did. Every harness must pass the same contract: it reaches the model only through
the episode's base URL, key and model name, its commands run in the sandbox, it stops at
max_turns and at the deadline, and a failure is a HarnessError (never a silent outcome)."""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.sandbox.harness import (
    HarnessContext,
    HarnessError,
    HarnessOutcome,
    HarnessTimeout,
    SandboxTerminal,
    make_harness,
)
from services.sandbox.providers.local import LocalProvider, LocalProviderConfig
from services.sandbox.task import Task
from services.sandbox.verifier import verify
from services.testing.harness_extras import missing_harness_extra
from services.testing.openai_standin import OpenAIStandIn

pytestmark = pytest.mark.slow
TASK = Task.load(Path(__file__).resolve().parents[2] / "tasks" / "config-edit")
SOLVE = ("sed -i -e 's/^port = .*/port = 8080/' -e 's/^debug = .*/debug = false/' "
         "-e 's/^workers = .*/workers = 4/' -e 's/^# log_level = .*/log_level = warning/' "
         "/app/app.conf")
KEY, MODEL = "episode-key-1", "riptide-policy"


def _terminus2_command(command: str, complete: bool = False, duration: float = 0.5) -> str:
    keystrokes = [{"keystrokes": command + "\n", "duration": duration}] if command else []
    return json.dumps({"analysis": "looking at the task", "plan": "run it",
                       "commands": keystrokes, "task_complete": complete})


def _mini_command(command: str) -> str:
    return f"THOUGHT: one step at a time.\n\n```mswea_bash_command\n{command}\n```"


# What each harness's model says to run a command, and to finish (as its prompt asks).
SCRIPTS: dict[str, tuple[Callable[[str], str], list[str]]] = {
    "terminus2": (_terminus2_command,
                  [_terminus2_command("", complete=True)] * 2),  # task_complete, confirmed
    "mini_swe_agent": (_mini_command,
                       [_mini_command("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")]),
}


def _require_extra(harness: str) -> None:
    reason = missing_harness_extra(harness)
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def provider() -> Iterator[LocalProvider]:
    provider = LocalProvider(LocalProviderConfig())
    yield provider
    asyncio.run(provider.close())


def _episode(provider: LocalProvider, harness: str, server: OpenAIStandIn, tmp_path: Path,
             max_turns: int = 10, seconds: float = 180,
             api_key: str = KEY) -> tuple[HarnessOutcome | BaseException, list[str], float]:
    """Run one episode; return its outcome (or error), the commands run, and the reward."""
    commands: list[str] = []

    async def go() -> tuple[HarnessOutcome | BaseException, float]:
        handle = await provider.create(TASK)
        try:
            terminal = SandboxTerminal(provider, handle, lambda cmd, _: commands.append(cmd))
            context = HarnessContext(
                episode_id="ep-1", base_url=server.base_url, api_key=api_key, model=MODEL,
                instruction=TASK.instruction, task=TASK, terminal=terminal,
                max_turns=max_turns, deadline=time.monotonic() + seconds, work_dir=tmp_path)
            try:
                outcome: HarnessOutcome | BaseException = await make_harness(harness).run(context)
            except (HarnessError, HarnessTimeout) as exc:
                outcome = exc
            verdict = await verify(provider, handle, TASK)
            return outcome, verdict.reward
        finally:
            await provider.delete(handle)

    outcome, reward = asyncio.run(go())
    return outcome, commands, reward


@pytest.mark.parametrize("harness", ["terminus2", "mini_swe_agent"])
def test_harness_solves_a_bundled_task_through_the_base_url(
        provider: LocalProvider, harness: str, tmp_path: Path) -> None:
    _require_extra(harness)
    command, finish = SCRIPTS[harness]
    with OpenAIStandIn([command(SOLVE), *finish], api_key=KEY, model=MODEL) as server:
        outcome, commands, reward = _episode(provider, harness, server, tmp_path)
    assert isinstance(outcome, HarnessOutcome) and outcome.finish_reason == "complete", outcome
    assert reward == 1.0  # the task's own tests saw the agent's edit
    assert any("s/^port = .*/port = 8080/" in cmd for cmd in commands)
    assert server.refused == [] and len(server.requests) == 1 + len(finish)
    first = server.requests[0]["messages"]
    assert any("app.conf" in str(message.get("content")) for message in first)
    # Every later call carries the history: what the model said, then what the sandbox showed.
    assert len(server.requests[1]["messages"]) > len(first)


@pytest.mark.parametrize("harness", ["terminus2", "mini_swe_agent"])
def test_harness_stops_at_max_turns(provider: LocalProvider, harness: str,
                                    tmp_path: Path) -> None:
    _require_extra(harness)
    command, _ = SCRIPTS[harness]
    with OpenAIStandIn(lambda request: command("echo still working"), api_key=KEY,
                       model=MODEL) as server:
        outcome, commands, reward = _episode(provider, harness, server, tmp_path, max_turns=2)
    assert isinstance(outcome, HarnessOutcome) and outcome.finish_reason == "max_turns", outcome
    assert len(server.requests) == 2 and reward == 0.0
    assert sum("echo still working" in cmd for cmd in commands) == 2


@pytest.mark.parametrize("harness", ["terminus2", "mini_swe_agent"])
def test_harness_with_a_refused_key_is_a_harness_error(provider: LocalProvider, harness: str,
                                                       tmp_path: Path) -> None:
    _require_extra(harness)
    command, _ = SCRIPTS[harness]
    with OpenAIStandIn([command(SOLVE)] * 5, api_key=KEY, model=MODEL) as server:
        outcome, _, _ = _episode(provider, harness, server, tmp_path, api_key="expired-key")
    assert isinstance(outcome, HarnessError), outcome
    assert "Authentication" in str(outcome) and server.requests == []
    assert server.refused and all(status == 401 for status, _ in server.refused)


@pytest.mark.parametrize("harness", ["terminus2", "mini_swe_agent"])
def test_harness_stops_at_the_deadline(provider: LocalProvider, harness: str,
                                       tmp_path: Path) -> None:
    _require_extra(harness)
    command, _ = SCRIPTS[harness]
    if harness == "terminus2":  # keystrokes do not block: the harness waits their duration
        command = functools.partial(_terminus2_command, duration=30.0)
    with OpenAIStandIn(lambda request: command("sleep 120"), api_key=KEY, model=MODEL) as server:
        started = time.monotonic()
        outcome, _, _ = _episode(provider, harness, server, tmp_path, seconds=6)
        elapsed = time.monotonic() - started
    assert isinstance(outcome, HarnessTimeout), outcome
    assert "agent timeout" in str(outcome)
    assert elapsed < 40, elapsed  # litellm's first import is part of it


def test_terminus2_without_harbor_says_how_to_get_it(tmp_path: Path) -> None:
    if missing_harness_extra("terminus2") is None:
        pytest.skip("Harbor is installed here")
    context = HarnessContext(
        episode_id="ep-1", base_url="http://127.0.0.1:9/v1", api_key=KEY, model=MODEL,
        instruction=TASK.instruction, task=TASK, terminal=None,  # type: ignore[arg-type]
        max_turns=3, deadline=time.monotonic() + 30, work_dir=tmp_path)
    with pytest.raises(HarnessError, match=r"riptide\[terminus2\].*Python >= 3.12"):
        asyncio.run(make_harness("terminus2").run(context))
