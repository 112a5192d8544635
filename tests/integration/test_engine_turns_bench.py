"""bench/engine_turns.py on CPU with the tiny model: both shapes run on one real engine
process, generate what was asked, and the last line is the JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_both_shapes_run_on_one_engine_and_report_json() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "engine_turns.py"), "--concurrency", "3",
         "--episodes", "1", "--turns", "2", "--prompt-len", "30", "--turn-tokens", "5",
         "--max-new-tokens", "4"],
        capture_output=True, text=True, timeout=300, check=False, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    # single: each client sends episodes x turns single requests; multi-turn: the same count
    assert result["single"]["requests"] == result["multi_turn"]["requests"] == 3 * 2
    for phase in ("single", "multi_turn"):
        assert result[phase]["tokens_per_s"] > 0
        assert result[phase]["mean_itl_ms"] is not None
    assert result["profile_top_frames"] is None


def test_top_frames_counts_each_frame_once_per_stack(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import engine_turns
    finally:
        sys.path.remove(str(REPO / "bench"))
    raw = tmp_path / "raw.txt"
    raw.write_text("main;loop;step 3\nmain;loop;loop;wait 1\n")
    assert sorted(engine_turns.top_frames(raw)[:2]) == [("loop", 1.0), ("main", 1.0)]
    assert dict(engine_turns.top_frames(raw))["step"] == 0.75
