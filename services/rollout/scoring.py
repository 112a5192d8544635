"""Scoring a checkpoint: the rollout service's `score` mode, one evaluation and no training.

The engines serve the checkpoint (the fleet launches or attaches them as in training, at
`weight_update.initial_weight_version`); once one of them is registered with the router,
every episode of [rollout.eval]'s task set (evaluation.py's `eval_task_ids`, every listed task
by default) runs through the sandbox, at most `scheduler.max_concurrent_samples` at once, and
the result (EvalQueue.detail: per task its success, rewards and episodes without verdict, and
the mean success) is written atomically to `eval.result_path`. Nothing reaches Redis and no
trainer takes part. Called by service.py, which then ends the process with exit code 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from services._proto.riptide.v1 import sandbox_pb2
from services.rollout.episodes import (
    EpisodeRunner,
    call_failure_cause,
    no_verdict_trajectory,
)
from services.rollout.evaluation import EvalQueue

log = logging.getLogger(__name__)


async def score(queue: EvalQueue, version: int, runner: EpisodeRunner,
                max_concurrent_episodes: int) -> dict[str, Any]:
    """Run one evaluation of the queue's task set at `version`; its EvalQueue.detail."""
    started = time.monotonic()
    queue.queue(version)
    slots = asyncio.Semaphore(max_concurrent_episodes)

    async def one(item_version: int, request: sandbox_pb2.RunEpisodeRequest) -> None:
        async with slots:
            try:
                trajectory = await runner.run(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an episode that failed is a failure without verdict
                log.warning("scoring episode %s failed: %s", request.sample_id, exc)
                trajectory = no_verdict_trajectory(request, f"{type(exc).__name__}: {exc}",
                                                   call_failure_cause(exc))
        queue.record(item_version, request, trajectory)

    items = []
    while (item := queue.next_request()) is not None:
        items.append(item)
    await asyncio.gather(*(one(*item) for item in items))
    return {**queue.detail(version), "wall_s": round(time.monotonic() - started, 2)}


def write_result(path: str | Path, result: dict[str, Any]) -> None:
    """Write the result JSON whole or not at all (a reader never sees half of it)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    partial.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(partial, target)
