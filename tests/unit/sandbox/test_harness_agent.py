"""How the harness agent reads a harness's end: a harness that stops itself at its deadline
(HarnessTimeout) is an agent timeout, not a crash, unless the gateway's cap ended it first."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from services.sandbox.config import AgentConfig
from services.sandbox.harness import (
    Harness,
    HarnessContext,
    HarnessError,
    HarnessOutcome,
    HarnessTimeout,
)
from services.sandbox.harness_agent import HarnessAgent

from .gateway.test_session import RecordingModel, session


class Raising(Harness):
    name = "raising"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def run(self, context: HarnessContext) -> HarnessOutcome:
        raise self.error


def _run(error: BaseException, limit_hit: str | None = None) -> str:
    agent = HarnessAgent(Raising(error), None, None, AgentConfig())  # type: ignore[arg-type]
    s = session(RecordingModel([]))
    s.limit_hit = limit_hit
    context: Any = HarnessContext(
        episode_id="ep-1", base_url="http://127.0.0.1:9/v1", api_key="k", model="m",
        instruction="", task=None, terminal=None, max_turns=3,  # type: ignore[arg-type]
        deadline=time.monotonic() + 30, work_dir=Path("."))
    return asyncio.run(agent._run_harness(context, s, context.deadline))


def test_a_harness_timeout_stays_an_agent_timeout() -> None:
    with pytest.raises(HarnessTimeout, match="agent timeout"):
        _run(HarnessTimeout("raising did not finish in time (agent timeout)"))


def test_a_cap_hit_first_ends_the_episode_at_that_cap() -> None:
    assert _run(HarnessTimeout("late"), limit_hit="wall_time") == "wall_time"
    assert _run(HarnessError("refused"), limit_hit="max_turns") == "max_turns"


def test_any_other_crash_is_a_harness_error() -> None:
    with pytest.raises(HarnessError, match="raising crashed: KeyError"):
        _run(KeyError("x"))
