"""Evaluation during training: held-out episodes at the engines' current weight version.

Every `eval.interval_steps` weight versions (and at the starting version) the queue fills with
`num_samples` episodes of each held-out task; the scheduler gives them the next free slots,
ahead of training episodes and outside the staleness budget, so training never waits for an
evaluation to finish. Their trajectories never reach the sample stream: only their rewards
are kept, by weight version, for the rollout's admin state and the run summary. The version
an evaluation is filed under is the one current when it was queued. Called by scheduler.py,
and by scoring.py, which runs one evaluation alone (the rollout's score mode).
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import ConfigError
from services.rollout.config import EvalConfig


def eval_task_ids(config: EvalConfig, listed: list[str], *, every_task: bool = False
                  ) -> list[str]:
    """The held-out task set out of the sandbox's `listed` tasks: `task_ids`, else
    `num_tasks` drawn with `seed` from the sorted list (the same set for the same seed and
    tasks, in training and in scoring), else every task when `every_task` (score mode)."""
    if config.task_ids:
        missing = sorted(set(config.task_ids) - set(listed))
        if missing:
            raise ConfigError(f"rollout.eval.task_ids: the sandbox lists no task "
                              f"{', '.join(missing[:5])} ({len(listed)} tasks listed)")
        return list(config.task_ids)
    if config.num_tasks:
        if config.num_tasks > len(listed):
            raise ConfigError(f"rollout.eval.num_tasks = {config.num_tasks}, but the sandbox "
                              f"lists only {len(listed)} tasks")
        return sorted(random.Random(config.seed).sample(sorted(listed), config.num_tasks))
    return sorted(listed) if every_task else []


class EvalQueue:
    """Queued evaluation episodes and their results by weight version."""

    def __init__(self, config: EvalConfig, max_new_tokens: int, top_p: float,
                 task_ids: list[str] | None = None) -> None:
        self.config = config
        self.task_ids = list(config.task_ids if task_ids is None else task_ids)
        self._sampling = common_pb2.SamplingParams(
            max_new_tokens=max_new_tokens, top_p=top_p,
            temperature=0.0 if config.greedy else config.temperature)
        self._pending: deque[tuple[int, sandbox_pb2.RunEpisodeRequest]] = deque()
        self._scheduled: set[int] = set()
        self._rewards: dict[int, dict[str, list[float]]] = {}
        self._no_verdict: dict[int, dict[str, int]] = {}
        self._finish_reasons: dict[int, dict[str, list[str]]] = {}
        self._expected: dict[int, int] = {}

    @property
    def enabled(self) -> bool:
        return self.config.interval_steps > 0 and bool(self.task_ids)

    def on_version(self, version: int) -> None:
        """Queue an evaluation when `version` is due and not yet evaluated."""
        if not self.enabled or version % self.config.interval_steps:
            return
        self.queue(version)

    def queue(self, version: int) -> None:
        """Queue one evaluation of every held-out task at `version` (once per version)."""
        if version in self._scheduled:
            return
        self._scheduled.add(version)
        self._expected[version] = len(self.task_ids) * self.config.num_samples
        for task_id in self.task_ids:
            for index in range(self.config.num_samples):
                group_id = f"eval-v{version}-{task_id}"
                params = common_pb2.SamplingParams()
                params.CopyFrom(self._sampling)
                if not self.config.greedy:
                    params.sampling_seed = version * 7919 + index
                self._pending.append((version, sandbox_pb2.RunEpisodeRequest(
                    task_id=task_id, sample_id=f"{group_id}-s{index}", group_id=group_id,
                    sample_index=index, sampling_params=params)))

    def next_request(self) -> tuple[int, sandbox_pb2.RunEpisodeRequest] | None:
        return self._pending.popleft() if self._pending else None

    def record(self, version: int, request: sandbox_pb2.RunEpisodeRequest,
               trajectory: common_pb2.Trajectory) -> None:
        """File one finished episode; no verdict counts as a failure."""
        scored = trajectory.status == common_pb2.VERDICT_STATUS_SCORED
        by_task = self._rewards.setdefault(version, {})
        by_task.setdefault(request.task_id, []).append(trajectory.reward if scored else 0.0)
        missed = self._no_verdict.setdefault(version, {})
        missed[request.task_id] = missed.get(request.task_id, 0) + (0 if scored else 1)
        reasons = self._finish_reasons.setdefault(version, {}).setdefault(request.task_id, [])
        reasons.append(trajectory.finish_reason or ("scored" if scored else "no_verdict"))

    def pending(self) -> int:
        """Queued episodes not yet handed out."""
        return len(self._pending)

    def detail(self, version: int) -> dict[str, Any]:
        """One evaluation in full: per task its success, rewards, episodes without verdict
        and how each episode ended; the mean success over tasks."""
        threshold = self.config.success_threshold
        by_task = self._rewards.get(version, {})
        tasks: dict[str, dict[str, Any]] = {
            t: {"success": sum(r >= threshold for r in rs) / len(rs), "rewards": rs,
                "no_verdict": self._no_verdict[version][t],
                "finish_reasons": self._finish_reasons[version][t]}
            for t, rs in sorted(by_task.items())}
        return {"weight_version": version, "num_tasks": len(tasks),
                "num_samples": self.config.num_samples, "greedy": self.config.greedy,
                "temperature": 0.0 if self.config.greedy else self.config.temperature,
                "mean_success": sum(e["success"] for e in tasks.values()) / max(len(tasks), 1),
                "no_verdict": sum(e["no_verdict"] for e in tasks.values()),
                "done": sum(len(rs) for rs in by_task.values()),
                "expected": self._expected.get(version, 0), "tasks": tasks}

    def summary(self) -> dict[str, Any]:
        """{version: {mean_success, done, expected, tasks: {task: success}}}, complete or not."""
        out: dict[str, Any] = {}
        threshold = self.config.success_threshold
        for version, by_task in sorted(self._rewards.items()):
            tasks = {t: sum(r >= threshold for r in rs) / len(rs) for t, rs in by_task.items()}
            out[str(version)] = {
                "mean_success": sum(tasks.values()) / len(tasks),
                "done": sum(len(rs) for rs in by_task.values()),
                "expected": self._expected[version], "tasks": tasks}
        return out
