"""The run's metrics as scalars, built from its events in stream order.

Two x-axes: `trainer_step` for the trainer's figures (`train/*`) and for what the rollout did
between two steps (`rollout/*`, `dropped/*`), and `weight_version` for evaluations
(`eval/*`). Each `trainer.step` event closes an interval: the load readings, episodes and
dropped groups seen since the previous step are summed or averaged into that step's point.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from services.common.events import Event

Axis = Literal["trainer_step", "weight_version"]

#: trainer.step attrs exported as they are, as train/<name>.
STEP_FIELDS = ("reward_mean", "success_rate", "loss", "mismatch_kl", "tokens_per_s",
               "idle_fraction", "groups", "samples", "tokens")


@dataclass(frozen=True)
class Scalar:
    """One point: `tag` at `step` of its `axis`."""

    tag: str
    value: float
    step: int
    axis: Axis
    wall_time: float


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class _Interval:
    """What the rollout did since the previous trainer step."""

    in_flight: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    episodes: int = 0
    truncated: int = 0
    no_verdict: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    wait_s: float = 0.0
    weight_sync_s: float | None = None


class ScalarBuilder:
    """Feed it every event in stream order; it returns the scalars each one completes."""

    def __init__(self) -> None:
        self._interval = _Interval()
        self._load: Event | None = None

    def add(self, event: Event) -> list[Scalar]:
        interval = self._interval
        a = event.attrs
        if event.kind == "trainer.step":
            return self._step(event)
        if event.kind == "rollout.eval":
            return self._eval(event)
        if event.kind == "rollout.load":
            self._load = event
            if (in_flight := _number(a.get("in_flight"))) is not None:
                interval.in_flight.append(in_flight)
            interval.running.append(sum(_number(e.get("running")) or 0.0
                                        for e in a.get("engines") or []))
        elif event.kind == "rollout.episode" and not a.get("eval"):
            interval.episodes += 1
            interval.truncated += bool(a.get("truncated"))
            if (reward := _number(a.get("reward"))) is None:
                interval.no_verdict += 1
            else:
                interval.rewards.append(reward)
        elif event.kind in ("rollout.group_dropped", "trainer.group_dropped"):
            interval.dropped[f"{event.service}/{a.get('reason', 'unknown')}"] += 1
        elif event.kind == "trainer.wait_data":
            interval.wait_s += event.end - event.start
        elif event.kind == "trainer.weight_sync":
            interval.weight_sync_s = event.end - event.start
        return []

    def _step(self, event: Event) -> list[Scalar]:
        a, interval = event.attrs, self._interval
        step = int(_number(a.get("step")) or 0)
        staleness = [float(s) for s in a.get("staleness") or [] if _number(s) is not None]
        values: dict[str, float | None] = {f"train/{name}": _number(a.get(name))
                                           for name in STEP_FIELDS}
        values.update({
            "train/step_time_s": event.end - event.start,
            "train/staleness_mean": _mean(staleness),
            "train/staleness_max": max(staleness, default=None),
            "train/wait_data_s": interval.wait_s,
            "train/weight_sync_s": interval.weight_sync_s,
            "rollout/in_flight_mean": _mean(interval.in_flight),
            "rollout/running_requests_mean": _mean(interval.running),
            "rollout/cache_hit_rate": self._hit_rate(),
            "rollout/episodes": float(interval.episodes),
            "rollout/episode_reward_mean": _mean(interval.rewards),
            "rollout/truncated_fraction": (interval.truncated / interval.episodes
                                           if interval.episodes else None),
            "rollout/no_verdict": float(interval.no_verdict),
        })
        values.update({f"dropped/{reason}": float(n) for reason, n in interval.dropped.items()})
        self._interval = _Interval()
        return [Scalar(tag, value, step, "trainer_step", event.end)
                for tag, value in values.items() if value is not None]

    def _hit_rate(self) -> float | None:
        """Cached over prompt tokens the router saw so far (cumulative), newest reading."""
        engines = self._load.attrs.get("engines") or [] if self._load is not None else []
        prompt = sum(_number(e.get("prompt_tokens")) or 0.0 for e in engines)
        cached = sum(_number(e.get("cached_tokens")) or 0.0 for e in engines)
        return cached / prompt if prompt else None

    def _eval(self, event: Event) -> list[Scalar]:
        version = event.weight_version
        if version is None:
            return []
        values = {"eval/mean_success": _number(event.attrs.get("mean_success"))}
        per_task = event.attrs.get("per_task") or {}
        values.update({f"eval/task/{task}": _number(success)
                       for task, success in per_task.items()})
        return [Scalar(tag, value, version, "weight_version", event.end)
                for tag, value in values.items() if value is not None]
