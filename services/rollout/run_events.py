"""The rollout service's events: episodes, dropped groups, evaluations, engine pauses, load.

A thin layer over the shared EventPublisher (services/common/events.py) that knows the
rollout's objects: the scheduler reports episodes and dropped groups, the weight-update
coordinator engine pauses, and the service's load loop calls `load` about once a second
with the fleet's per-rank loads and the router's per-target counters (health, circuit,
prompt and cached tokens of the calls it routed: the cache hit rate's source).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.events import EventPublisher
from services.common.no_verdict import trajectory_cause
from services.rollout.episodes import generated_versions


def episode_seconds(timings: common_pb2.EpisodeTimings) -> dict[str, float]:
    """Where an episode's wall time went, as the sandbox service measured it: queued for a
    slot, creating the sandbox, generating, running commands, verifying, and in all."""
    return {name: round(getattr(timings, field), 3) for name, field in (
        ("queued", "queued_s"), ("create", "sandbox_create_s"), ("generate", "generate_s"),
        ("commands", "exec_s"), ("verify", "verify_s"), ("total", "total_s"))}


class RolloutEvents:
    """What the rollout publishes; every method returns at once."""

    def __init__(self, publisher: EventPublisher | None = None) -> None:
        self.publisher = publisher or EventPublisher.disabled("rollout")
        self._paused_at: dict[str, float] = {}
        self._eval_started: dict[int, float] = {}

    def episode(self, request: sandbox_pb2.RunEpisodeRequest, trajectory: common_pb2.Trajectory,
                started: float, weight_version: int, evaluation: bool = False) -> None:
        if not self.publisher.enabled:
            return  # building the attrs is the only cost on the scheduler's path
        versions = sorted(generated_versions(trajectory))
        scored = trajectory.status == common_pb2.VERDICT_STATUS_SCORED
        verdict = common_pb2.VerdictStatus.Name(trajectory.status).removeprefix(
            "VERDICT_STATUS_").lower()
        self.publisher.publish("rollout.episode", id=request.sample_id, start=started,
                               end=time.time(), weight_version=weight_version, attrs={
            "sample_id": request.sample_id, "group_id": request.group_id,
            "task_id": request.task_id, "engine": trajectory.engine_url,
            "dp_rank": trajectory.dp_rank, "turns": trajectory.num_turns,
            "prompt_tokens": len(trajectory.prompt_ids),
            "response_tokens": len(trajectory.response_ids),
            "segments": 1 + len(trajectory.segments),
            "engine_prompt_tokens": trajectory.prompt_tokens,
            "cached_tokens": trajectory.cached_tokens,
            "reward": trajectory.reward if scored else None, "verdict": verdict,
            "finish_reason": trajectory.finish_reason, "weight_versions": versions,
            "truncated": trajectory.finish_reason in ("context_length", "max_turns",
                                                      "wall_time"),
            "aborted": "Aborted" in trajectory.status_message,
            "message": trajectory.status_message[:300], "eval": evaluation,
            "no_verdict_cause": trajectory_cause(trajectory),
            "seconds": episode_seconds(trajectory.timings),
        })  # fmt: skip

    def group_dropped(self, group_id: str, reason: str, weight_version: int,
                      num_samples: int) -> None:
        self.publisher.publish("rollout.group_dropped", id=group_id,
                               weight_version=weight_version,
                               attrs={"group_id": group_id, "reason": reason,
                                      "samples": num_samples})

    def eval_started(self, version: int) -> None:
        self._eval_started.setdefault(version, time.time())

    def eval_done(self, version: int, summary: dict[str, Any]) -> None:
        """Publish `version`'s evaluation once all of its episodes are in."""
        result = summary.get(str(version))
        if result is None or result["done"] < result["expected"]:
            return
        started = self._eval_started.pop(version, time.time())
        self.publisher.publish("rollout.eval", id=str(version), start=started, end=time.time(),
                               weight_version=version,
                               attrs={"weight_version": version,
                                      "mean_success": result["mean_success"],
                                      "per_task": result["tasks"]})

    def engines_paused(self, urls: Iterable[str]) -> None:
        now = time.time()
        for url in urls:
            self._paused_at[url] = now

    def engines_resumed(self, reason: str, version: int, outcome: str) -> None:
        """Close every open pause span (pause..resume) of the engines paused before."""
        now = time.time()
        for url, started in self._paused_at.items():
            self.publisher.publish("rollout.engine_pause", id=url, start=started, end=now,
                                   weight_version=version,
                                   attrs={"engine": url, "reason": reason, "outcome": outcome})
        self._paused_at.clear()

    def load(self, in_flight: int, cap: int, members: list[Any],
             targets: Iterable[dict[str, Any]]) -> None:
        """One load snapshot: a row per (engine, dp rank), from the fleet and the router."""
        if not self.publisher.enabled:
            return
        routed = {(str(t.get("engine_url", "")).rstrip("/"), int(t.get("dp_rank", 0))): t
                  for t in targets}
        engines = []
        for member in members:
            for rank in member.load or [{"dp_rank": r} for r in range(member.ranks)]:
                dp_rank = int(rank.get("dp_rank", 0))
                target = routed.get((member.url.rstrip("/"), dp_rank), {})
                total = int(rank.get("num_reqs", 0))
                waiting = int(rank.get("num_waiting_reqs", 0))
                engines.append({
                    "engine": member.url, "dp_rank": dp_rank, "state": member.state,
                    "running": max(total - waiting, 0), "waiting": waiting,
                    # GetStatus details travel as a protobuf Struct: numbers come back floats.
                    "in_flight": int(target["in_flight"]) if "in_flight" in target else None,
                    "prompt_tokens": int(target.get("prompt_tokens", 0)),
                    "cached_tokens": int(target.get("cached_tokens", 0)),
                    "healthy": bool(target.get("healthy", member.state == "ready")),
                    "weight_version": member.weight_version,
                    "circuit": "open" if target.get("circuit_open") else "closed",
                    # the router's word on the engine's load reads: ok, missing, pending
                    "load_signal": target.get("load_signal"),
                })  # fmt: skip
        self.publisher.publish("rollout.load", attrs={"in_flight": in_flight, "cap": cap,
                                                      "engines": engines})
