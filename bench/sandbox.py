"""Sandbox-service throughput with local (bubblewrap) sandboxes and the scripted agent.

Each episode goes through the sandbox service's runtime exactly as RunEpisode does (the
gRPC transport aside): acquire a local sandbox, run the scripted agent (`--extra` harmless
commands, then the task's solve.sh, each its own model turn and command), then the task's
verifier, then delete. `c` clients each keep one episode in flight over the bundled tasks.
`acquire_ms` is the time from asking for a sandbox to holding it (create cap included);
`episodes_per_s` counts finished episodes over the wall time of the level.

Usage: python bench/sandbox.py [--levels 1,8,32] [--episodes-per-client 8,6,2] [--extra 3]
Last line: {"c1": {"acquire_ms_p50": ..., "acquire_ms_p99": ..., "episodes_per_s": ...}, ...}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.deployment import validate_config
from services.sandbox.server import build_runtime
from services.sandbox.stats import percentile

REPO = Path(__file__).resolve().parents[1]


async def _episode(runtime: Any, task_id: str, sample_id: str) -> common_pb2.Trajectory:
    request = sandbox_pb2.RunEpisodeRequest(task_id=task_id, sample_id=sample_id)
    trajectory = None
    async for event in runtime.run_episode(request):
        if event.HasField("trajectory"):
            trajectory = event.trajectory
    assert trajectory is not None
    return trajectory


async def _level(runtime: Any, clients: int, per_client: int) -> dict[str, Any]:
    tasks = runtime.tasks.names
    trajectories: list[common_pb2.Trajectory] = []

    async def client(index: int) -> None:
        for round_ in range(per_client):
            task = tasks[(index * per_client + round_) % len(tasks)]
            trajectories.append(await _episode(runtime, task, f"c{clients}-{index}-{round_}"))

    started = time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    wall_s = time.monotonic() - started
    acquire_ms = [1000 * t.timings.sandbox_create_s for t in trajectories]
    scored = [t for t in trajectories if t.status == common_pb2.VERDICT_STATUS_SCORED]
    return {
        "acquire_ms_p50": round(percentile(acquire_ms, 50), 1),
        "acquire_ms_p99": round(percentile(acquire_ms, 99), 1),
        "episodes_per_s": round(len(trajectories) / wall_s, 3),
        "episodes": len(trajectories),
        "no_verdict": len(trajectories) - len(scored),
        "mean_reward": round(sum(t.reward for t in scored) / max(1, len(scored)), 3),
        "episode_s_p50": round(percentile([t.timings.total_s for t in trajectories], 50), 3),
        "turns_per_episode": round(sum(t.num_turns for t in trajectories)
                                   / max(1, len(trajectories)), 2),
    }


async def _run(levels: list[int], per_client: list[int], extra: int,
               max_creates: int) -> dict[str, Any]:
    config = validate_config({
        "run": {"admin_token": "bench-admin-token", "name": "bench"},
        "sandbox": {"tasks_dir": str(REPO / "tasks"), "model_client": "scripted",
                    "max_concurrent_episodes": max(levels),
                    "max_concurrent_creates": max_creates,
                    "scripted": {"policy": "oracle", "num_extra_commands": extra}},
    })
    runtime: Any = build_runtime(config)
    await runtime.start()
    try:
        await _episode(runtime, runtime.tasks.names[0], "warmup")
        result = {f"c{c}": await _level(runtime, c, n) for c, n in zip(levels, per_client,
                                                                      strict=True)}
        result["sandboxes_alive_after"] = runtime.state()["sandboxes_alive"]
        return result
    finally:
        await runtime.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,8,32")
    parser.add_argument("--episodes-per-client", default="8,6,2")
    parser.add_argument("--extra", type=int, default=3, help="commands before solve.sh")
    parser.add_argument("--max-creates", type=int, default=8)
    args = parser.parse_args()
    levels = [int(v) for v in args.levels.split(",")]
    per_client = [int(v) for v in args.episodes_per_client.split(",")]
    result = asyncio.run(_run(levels, per_client, args.extra, args.max_creates))
    for key, value in result.items():
        print(f"{key}: {value}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
