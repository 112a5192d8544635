"""The rollout's score mode end to end: `riptide up` with a score-mode config runs router,
sandbox and rollout (its built-in engine serving the tiny model), no Redis and no trainer;
every episode of the task set runs in a real local sandbox and is scored by the task's own
tests; the stack ends by itself, exit 0, with per-task results in the result file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.config import dump_config
from services.local_stack import ensure_tiny_model, local_config

REPO = Path(__file__).resolve().parents[2]
HELDOUT = REPO / "tasks" / "starter" / "heldout"
TASKS = ["last-line", "write-goodbye"]


@pytest.mark.slow
def test_score_mode_scores_every_task_and_exits_0(tmp_path: Path) -> None:
    model = ensure_tiny_model(tmp_path)
    result_path = tmp_path / "eval" / "result.json"
    config = local_config(tmp_path, {
        "rollout": {"mode": "score", "scheduler": {"max_new_tokens": 8},
                    "weight_update": {"initial_weight_version": 12},
                    "eval": {"task_ids": TASKS, "num_samples": 2, "greedy": False,
                             "result_path": str(result_path)}},
        "sandbox": {"tasks_dir": str(HELDOUT),
                    "agent": {"max_turns": 1, "max_new_tokens": 8}},
    })
    config_path = tmp_path / "score.toml"
    config_path.write_text(dump_config(config))
    os.chmod(config_path, 0o600)
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--dir", str(tmp_path),
         "--config", str(config_path)], capture_output=True, text=True, timeout=240, cwd=REPO)
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}"
                     for p in sorted((tmp_path / "logs").glob("*.log")))
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-2000:]}\n{logs}"
    assert not (tmp_path / "logs" / "redis.log").exists(), "score mode runs no Redis"
    assert not (tmp_path / "logs" / "trainer.log").exists(), "score mode runs no trainer"
    result = json.loads(result_path.read_text())
    assert '"mean_success"' in done.stdout  # riptide up prints the result
    assert result["weight_version"] == 12 and result["engines"] == str(model)
    assert sorted(result["tasks"]) == TASKS and result["done"] == result["expected"] == 4
    for task in TASKS:
        entry = result["tasks"][task]
        assert len(entry["rewards"]) == 2 and entry["no_verdict"] == 0, entry  # verified
        # each episode took its one model turn (router -> engine) before the tests ran
        assert entry["finish_reasons"] == ["max_turns", "max_turns"], entry
        assert entry["success"] == 0.0, "a random tiny model solves nothing"
    assert result["mean_success"] == 0.0 and result["no_verdict"] == 0
