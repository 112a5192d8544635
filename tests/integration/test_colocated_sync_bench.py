"""bench/colocated_sync.py end to end on CPU at the tiny shape: a real engine process loads the
syncs, and the last line is the JSON that compares a sync with the copies of the same bytes and
splits it into its phases."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_bench_syncs_exactly_and_reports_every_phase_and_baseline() -> None:
    out = subprocess.run(
        [sys.executable, "bench/colocated_sync.py", "--device", "cpu", "--shape", "tiny",
         "--repeats", "2"], cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["weights_read_back_exact"] is True
    assert result["logprob_max_abs_diff_before_sync"] > 0.01  # other weights before the sync
    assert result["logprob_max_abs_diff_after_sync"] < 1e-3
    assert result["engine_weight_version"] == "v3"  # the last of repeats + 2 syncs
    phases = result["sync_phases_s"]
    assert set(phases) == {"share_s", "post_s", "open_s", "load_s"}
    assert phases["post_s"] >= phases["open_s"] + phases["load_s"]
    assert result["sync_http_s"] >= 0
    assert 0 < result["http_round_trip_s"] and 0 < result["http_with_loop_turn_s"]
    assert result["update_empty_s"] > 0
    for baseline in ("flat", "per_tensor", "foreach", "engine"):
        assert result[f"d2d_copy_{baseline}_s"] >= 0
    assert result["sync_over_flat_copy"] > 0
