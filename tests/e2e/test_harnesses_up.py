"""`riptide up --set sandbox.agent.harness=...`: Harbor's Terminus-2 and mini-swe-agent, run
unchanged by the sandbox service, play whole episodes of the bundled tasks against the tiny
model through the agent gateway, the tasks' tests score them, and the trainer steps on their
trajectories. Skipped, with the reason, where the harness's extra cannot be installed."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from services.common import process
from services.common.events import load_episodes
from services.testing.harness_extras import missing_harness_extra
from services.testing.proc_tree import alive, descendants

pytestmark = pytest.mark.slow

#: How each harness's episodes can end (builtin agents never say `format_errors`; caps at the
#: gateway end an episode as the built-in agent's would: max_turns, context_length, wall_time).
FINISH_REASONS = {
    "terminus2": {"complete", "max_turns", "session_ended", "context_length", "wall_time"},
    "mini_swe_agent": {"complete", "max_turns", "format_errors", "context_length", "wall_time"},
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("harness", ["terminus2", "mini_swe_agent"])
def test_up_trains_on_episodes_of_a_third_party_harness(tmp_path: Path, harness: str) -> None:
    reason = missing_harness_extra(harness)
    if reason:
        pytest.skip(reason)
    run_dir, log = tmp_path / "stack", tmp_path / "up.log"
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                        "--steps", "2", "--set", f"sandbox.agent.harness={harness}"],
                       log_path=log)
    try:
        deadline = time.monotonic() + 240
        while "all services ready" not in (log.read_text() if log.exists() else ""):
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        children = descendants(up.pid)
        assert up.wait(600) == 0, log.read_text()[-4000:]
    finally:
        process.stop(up)
    text = log.read_text()
    summary = json.loads(next(line for line in text.splitlines()
                              if line.startswith('{"riptide_up_summary"')))["riptide_up_summary"]
    assert summary["steps"] >= 2 and summary["groups_trained"] >= 4, text[-3000:]
    assert summary["episodes_finished"].get("VERDICT_STATUS_SCORED", 0) >= 8
    time.sleep(0.5)
    assert alive(children) == set(), "processes left behind after the run ended"

    episodes = [e for e in load_episodes(run_dir / "events.jsonl") if e["verdict"] == "scored"]
    assert len(episodes) >= 8
    reasons = {e["finish_reason"] for e in episodes}
    assert reasons <= FINISH_REASONS[harness], reasons
    for episode in episodes:  # whole episodes, tokens as the engine saw them
        tokens = episode["tokens"]
        assert episode["turns"] and len(tokens["loss_mask"]) == len(tokens["ids"])
        assert sum(tokens["loss_mask"]) > 0  # generated tokens, trained on
    if harness == "terminus2":  # its keystrokes went through tmux in the sandbox
        commands = [c for e in episodes for turn in e["turns"] for c in turn["commands"]]
        assert any(c.startswith("tmux capture-pane") for c in commands), commands[:20]
    else:
        assert "format_errors" in reasons or "complete" in reasons, reasons
    config = (run_dir / "config.toml").read_text()
    assert f'harness = "{harness}"' in config
