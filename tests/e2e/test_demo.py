"""`riptide up --demo` (what `make demo` runs), with the tiny model to stay cheap: the summary
shows each trained step and a few episodes as transcripts, and its steps are the checkpoints."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from services.common import process
from services.common.checkpoint_steps import checkpoint_steps
from services.local_stack import ensure_tiny_model

pytestmark = pytest.mark.slow


def test_demo_summary_shows_steps_and_episodes_matching_the_checkpoints(tmp_path: Path) -> None:
    model = ensure_tiny_model(tmp_path / "tiny")
    run_dir, log = tmp_path / "demo", tmp_path / "demo.log"
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--demo", "--model",
                        str(model), "--dir", str(run_dir), "--steps", "2"], log_path=log)
    try:
        assert up.wait(420) == 0, log.read_text()[-4000:]
    finally:
        process.stop(up)
    text = log.read_text()
    assert f"[up] model {model}" in text
    lines = text.splitlines()
    start = lines.index("[demo] what the agent did")
    assert lines[start + 1].split() == ["step", "reward", "success", "episodes"]
    rows = [line.split() for line in lines[start + 2:start + 4]]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(row[2].endswith("%") and int(row[3]) == 4 for row in rows)  # a group of 4
    assert lines[start + 4].split()[:2] == ["episodes", "finished"]
    figures = json.loads(next(line for line in lines
                              if line.startswith('{"riptide_demo_summary"')))
    summary = figures["riptide_demo_summary"]
    assert summary["steps"] == [1, 2] == checkpoint_steps(run_dir / "checkpoints")
    assert len(summary["reward_by_step"]) == len(summary["success_by_step"]) == 2
    assert summary["episodes_finished"] >= 8  # two trained steps of four at least
    assert summary["episodes_solved"] == 0  # the tiny random model solves nothing
    assert 1 <= len(summary["episodes_shown"]) <= 3
    episodes = [i for i, line in enumerate(lines) if line.startswith("[demo] episode ")]
    assert len(episodes) == len(summary["episodes_shown"])
    for first in episodes:
        body = lines[first + 1:]
        end = next(i for i, line in enumerate(body) if line.startswith("  verdict: "))
        assert all(line.startswith(("  turn ", "           | ")) for line in body[:end])
        assert end >= 1  # at least one turn shown
        assert "solved" in body[end] or "no verdict" in body[end]
