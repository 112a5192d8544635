"""`riptide up` with the colocated weight sync: the trainer hands its weights to the engine as
shared tensors (the CPU form of CUDA IPC handles) through the rollout service's coordinator,
with no weight-update group; two steps train and sync, and the engine's log-probs match the
trainer's after each sync."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from services.common import process

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("release", [False, True])
def test_up_trains_and_syncs_with_the_colocated_weight_sync(tmp_path: Path,
                                                            release: bool) -> None:
    """With `release`, the engines also free their memory before each step (synchronous
    colocated training) and each sync resumes it."""
    from services.common.config import dump_config
    from services.local_stack import ensure_tiny_model, local_config

    run_dir = tmp_path / "stack"
    ensure_tiny_model(run_dir)
    config_path = tmp_path / "colocated.toml"
    config_path.write_text(dump_config(local_config(
        run_dir, {"trainer": {"weight_sync": {"mode": "colocated",
                                              "release_engines_during_step": release}}})))
    log = tmp_path / "up.log"
    up = process.spawn([sys.executable, "-m", "services.cli", "up", "--dir", str(run_dir),
                        "--config", str(config_path), "--steps", "2"], log_path=log)
    try:
        assert up.wait(540) == 0, log.read_text()[-4000:]
    finally:
        process.stop(up)
    summary_line = next(line for line in log.read_text().splitlines()
                        if line.startswith('{"riptide_up_summary"'))
    summary = json.loads(summary_line)["riptide_up_summary"]
    assert summary["steps"] == summary["weight_version"] == 2
    assert summary["mismatch_kl_last_step"] < 1e-3  # the engine holds the trainer's weights
    logs = run_dir / "logs"
    engine_logs = "".join(p.read_text() for p in logs.glob("engine*.log"))
    rollout_log = (logs / "rollout.log").read_text() if (logs / "rollout.log").exists() else ""
    assert "memory: weights " in engine_logs  # the budget it generates within, logged by the
    assert "memory: weights " in rollout_log  # engine and by the fleet that launched it
    assert "joined weight update group" not in engine_logs  # no group was formed
    # Each colocated update resumed the engine's weights before its buckets.
    assert engine_logs.count("resumed ['weights']") == 2, engine_logs[-3000:]
    released = engine_logs.count("released ['cuda_graph', 'kv_cache', 'weights']")
    assert released == (2 if release else 0), engine_logs[-3000:]
