"""Scores a folder of terminal-bench-2 tasks with a model: N episodes per task, mean success.

Each episode is a real one (a sandbox from the provider, the configured agent protocol, the
task's own tests); a sample succeeds when its reward is at least `success_threshold`. Episodes
without a verdict count as failures and are reported apart. Called by `riptide eval`
(services/cli.py), which starts the engine; calls episode.py's runner with any ModelClient.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.episode import EpisodeRunner
from services.sandbox.model_client import ModelClient
from services.sandbox.provider import SandboxProvider
from services.sandbox.stats import SandboxStats
from services.sandbox.task import TaskSet


def eval_sample_id(task_name: str, index: int) -> str:
    """The sample id (the router's session key) of episode `index` of a task."""
    return f"eval-{task_name}-{index}-{uuid.uuid4().hex[:6]}"


def task_of_sample_id(sample_id: str) -> str:
    """The task name inside an `eval_sample_id` (task names may hold dashes; the rest not)."""
    return sample_id.removeprefix("eval-").rsplit("-", 2)[0]


async def evaluate(tasks: TaskSet, model: ModelClient, chat: ChatFormat,
                   provider: SandboxProvider, agent: AgentConfig, *, num_samples: int = 1,
                   greedy: bool = True, temperature: float = 0.8,
                   max_concurrent_episodes: int = 4, success_threshold: float = 1.0,
                   seed: int = 0) -> dict[str, Any]:
    """`{"tasks": {name: {...}}, "mean_success": x, ...}` for `num_samples` episodes a task."""
    runner = EpisodeRunner(provider, TerminalAgent(model, chat, provider, agent), SandboxStats(),
                           max_concurrent_episodes, max_concurrent_episodes, "eval")
    sampling = common_pb2.SamplingParams(max_new_tokens=agent.max_new_tokens,
                                         temperature=0.0 if greedy else temperature)
    started = time.monotonic()

    async def one(task_name: str, index: int) -> common_pb2.Trajectory:
        params = common_pb2.SamplingParams()
        params.CopyFrom(sampling)
        if not greedy:
            params.sampling_seed = seed * 1_000_003 + index
        request = sandbox_pb2.RunEpisodeRequest(
            task_id=task_name, sample_id=eval_sample_id(task_name, index),
            group_id=f"eval-{task_name}", sample_index=index, sampling_params=params)
        return await runner.run(tasks.get(task_name), request, lambda progress: None)

    jobs = [(name, i) for name in tasks.names for i in range(num_samples)]
    trajectories = await asyncio.gather(*(one(name, i) for name, i in jobs))
    await runner.drain_deletes(60.0)
    per_task: dict[str, dict[str, Any]] = {}
    for (name, _), t in zip(jobs, trajectories, strict=True):
        entry = per_task.setdefault(name, {"rewards": [], "no_verdict": 0, "finish_reasons": []})
        scored = t.status == common_pb2.VERDICT_STATUS_SCORED
        entry["rewards"].append(t.reward if scored else 0.0)
        entry["no_verdict"] += 0 if scored else 1
        entry["finish_reasons"].append(t.finish_reason or "no_verdict")
    for entry in per_task.values():
        rewards = entry["rewards"]
        entry["success"] = sum(r >= success_threshold for r in rewards) / len(rewards)
    return {
        "num_tasks": len(per_task), "num_samples": num_samples, "greedy": greedy,
        "temperature": 0.0 if greedy else temperature, "protocol": agent.protocol,
        "mean_success": sum(e["success"] for e in per_task.values()) / max(len(per_task), 1),
        "no_verdict": sum(e["no_verdict"] for e in per_task.values()),
        "wall_s": round(time.monotonic() - started, 2), "tasks": per_task,
    }
