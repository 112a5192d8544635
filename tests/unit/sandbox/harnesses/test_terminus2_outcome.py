"""How a Terminus-2 episode ended, read from the trajectory Harbor writes (its ATIF steps):
complete only when task_complete was confirmed on the turn after it was first said."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.sandbox.harnesses.terminus2 import _agent_steps, _outcome


def _step(complete: bool) -> dict[str, Any]:
    calls = [{"tool_call_id": "call_0_1", "function_name": "bash_command"}]
    if complete:
        calls.append({"tool_call_id": "call_0_task_complete",
                      "function_name": "mark_task_complete"})
    return {"source": "agent", "tool_calls": calls}


def test_confirmed_completion_is_complete() -> None:
    outcome = _outcome([_step(False), _step(True), _step(True)], turns=3, max_turns=10)
    assert outcome.finish_reason == "complete"


def test_unconfirmed_completion_at_the_turn_limit_is_max_turns() -> None:
    assert _outcome([_step(False), _step(True)], 2, 2).finish_reason == "max_turns"
    assert _outcome([_step(True), _step(False)], 2, 2).finish_reason == "max_turns"


def test_an_ended_session_before_the_limit() -> None:
    assert _outcome([_step(False)], 1, 5).finish_reason == "session_ended"
    assert _outcome([], 0, 5).finish_reason == "session_ended"


def test_only_agent_steps_of_the_trajectory_count(tmp_path: Path) -> None:
    assert _agent_steps(tmp_path) == []  # no trajectory written (it crashed first)
    steps = [{"source": "user", "message": "task"}, _step(True),
             {"source": "system", "message": "summarized"}, _step(True)]
    (tmp_path / "trajectory.json").write_text(json.dumps({"steps": steps}))
    assert _agent_steps(tmp_path) == [_step(True), _step(True)]
    assert _outcome(_agent_steps(tmp_path), 2, 5).finish_reason == "complete"
