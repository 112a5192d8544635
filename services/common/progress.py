"""One line per trainer step and per evaluation for `riptide up` and the long benches, read
from the run's events stream.

Each `trainer.step` event becomes a line with its reward, groups, the trainer's idle
fraction, the staleness of the samples it consumed, the prefix-cache hit rate (cumulative,
from the newest `rollout.load` snapshot: cached over prompt tokens the router saw) and, when
a target step is set, an ETA from the mean time per step so far. With an exporter, every event
read also goes to it (the run's live TensorBoard / W&B export), so the stream is tailed once.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import redis

from services.common.config import RedisConfig
from services.common.events import Event, EventTail, stream_id_before

if TYPE_CHECKING:
    from services.common.tracking.exporter import MetricsExporter


def _duration(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def cache_hit_rate(load: Event | None) -> float | None:
    """Cached over prompt tokens, summed over a load snapshot's engines (None: no tokens)."""
    if load is None:
        return None
    engines = load.attrs.get("engines") or []
    prompt = sum(int(e.get("prompt_tokens") or 0) for e in engines)
    cached = sum(int(e.get("cached_tokens") or 0) for e in engines)
    return cached / prompt if prompt else None


def step_line(step: Event, load: Event | None, eta_s: float | None = None) -> str:
    """The progress line of one `trainer.step` event."""
    a: dict[str, Any] = step.attrs
    staleness = a.get("staleness") or []
    mean_stale = sum(staleness) / len(staleness) if staleness else 0.0
    hit = cache_hit_rate(load)
    parts = [f"[step {a.get('step', step.id)}]",
             f"reward {float(a.get('reward_mean') or 0.0):.3f}",
             f"success {float(a.get('success_rate') or 0.0):.0%}",
             f"groups {a.get('groups', 0)}",
             f"idle {float(a.get('idle_fraction') or 0.0):.0%}",
             f"cache hit {hit:.0%}" if hit is not None else "cache hit -",
             f"staleness {mean_stale:.2f} (max {max(staleness, default=0)})",
             f"step {step.end - step.start:.2f}s"]
    if eta_s is not None:
        parts.append(f"ETA {_duration(eta_s)}")
    return "  ".join(parts)


def eval_line(evaluation: Event) -> str:
    """The progress line of one finished `rollout.eval` (an evaluation of a weight version)."""
    a: dict[str, Any] = evaluation.attrs
    per_task: dict[str, float] = a.get("per_task") or {}
    solved = sorted(t for t, success in per_task.items() if success >= 1.0)
    return "  ".join([f"[eval v{a.get('weight_version', evaluation.weight_version)}]",
                      f"success {float(a.get('mean_success') or 0.0):.0%}",
                      f"tasks {len(per_task)}",
                      f"solved {', '.join(solved) if solved else '-'}",
                      f"took {evaluation.end - evaluation.start:.0f}s"])


class StepProgress:
    """Follows the events stream and yields a line for each new trainer step and each
    finished evaluation."""

    def __init__(self, redis: RedisConfig, run: str, target_step: int | None = None,
                 exporter: MetricsExporter | None = None) -> None:
        self._target = target_step
        self.exporter = exporter
        # Stream ids begin with their unix ms: steps of an earlier (resumed) run are skipped.
        self._tail = EventTail(redis, run, since_id=stream_id_before(int(time.time() * 1000)))
        self._load: Event | None = None
        self._first: tuple[float, int] | None = None  # (end, step) of the first step seen

    def poll(self) -> list[str]:
        """Lines for the steps published since the last poll ([] while Redis is away)."""
        try:
            events = self._tail.read()
        except redis.RedisError:
            return []
        lines = []
        for event in events:
            if self.exporter is not None:
                self.exporter.add(event)
            if event.kind == "rollout.load":
                self._load = event
            elif event.kind == "trainer.step":
                lines.append(step_line(event, self._load, self._eta(event)))
            elif event.kind == "rollout.eval":
                lines.append(eval_line(event))
        return lines

    def _eta(self, step: Event) -> float | None:
        """Steps left times the mean time per step between the first step seen and this."""
        number = int(step.attrs.get("step", 0))
        if self._target is None:
            return None
        if self._first is None:
            self._first = (step.end, number)
            return None
        first_end, first = self._first
        done = number - first
        return (self._target - number) * (step.end - first_end) / done if done > 0 else None

    def close(self) -> None:
        self._tail.close()
        if self.exporter is not None:
            self.exporter.close()
