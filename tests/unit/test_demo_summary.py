"""The demo summary's episodes: which are shown, and how a transcript reads; the demo's
split of the cores between its engine and its trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.demo import demo_overrides, pick_episodes, transcript


def _episode(sample: str, task: str, reward: float, turns: list[dict[str, Any]] | None = None,
             verdict: str = "scored") -> dict[str, Any]:
    return {"sample_id": sample, "task_id": task, "reward": reward, "verdict": verdict,
            "finish_reason": "complete", "message": "",
            "turns": turns or [{"assistant": "x", "commands": ["ls"], "observation": ""}]}


def test_the_newest_solved_and_failed_episodes_come_first_eval_ones_never() -> None:
    episodes = [_episode("a", "t1", 1.0), _episode("b", "t1", 0.0), _episode("c", "t2", 0.0),
                _episode("d", "t2", 1.0), _episode("eval-v1-t3-s0", "t3", 1.0),
                _episode("e", "t3", 0.0)]
    assert [e["sample_id"] for e in pick_episodes(episodes, 3)] == ["d", "e", "b"]
    assert [e["sample_id"] for e in pick_episodes(episodes[:2], 3)] == ["a", "b"]


def test_a_transcript_shows_commands_their_output_and_the_verdict() -> None:
    turns = [{"assistant": "```bash\nmkdir /app/build\n```", "commands": ["mkdir /app/build"],
              "observation": "\n".join(f"line {i}" for i in range(6))},
             {"assistant": "The   directory\nexists now.", "commands": [], "observation": ""}]
    lines = transcript(_episode("s1", "make-dir", 1.0, turns))
    assert lines == ["[demo] episode s1  task make-dir",
                     "  turn 1: $ mkdir /app/build",
                     "           | line 0", "           | line 1", "           | line 2",
                     "           | line 3", "           | ... (2 more lines)",
                     "  turn 2: no command; said: The directory exists now.",
                     "  verdict: reward 1, solved (complete)"]
    failed = transcript(_episode("s2", "t", 0.0, verdict="no_verdict") | {"reward": None,
                                                                          "message": "timeout"})
    assert failed[-1] == "  verdict: no verdict: timeout"


def test_the_demo_engine_and_trainer_each_take_half_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from services.common import cpu_split

    monkeypatch.setattr(cpu_split.os, "sched_getaffinity", lambda _pid: set(range(6)))
    overrides = demo_overrides(Path("model"))
    engine_args = overrides["rollout"]["fleet"]["builtin_args"]
    assert engine_args[engine_args.index("--num-threads") + 1] == "3"
    assert overrides["trainer"]["cpu_threads"] == 3
