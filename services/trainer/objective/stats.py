"""The trainer's live numbers: the last step's figures, run totals, and Prometheus gauges.

loop.py records one `StepRecord` per step; service.py shows `snapshot()` under /admin/state
and the gauges under /metrics.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from services.common.metrics import counter, gauge

_GAUGES = {
    "step_s": "wall time of the last optimizer step (forward, backward, update)",
    "wait_s": "time the last step waited for groups (bubble)",
    "bubble_ratio": "share of the run's wall time spent waiting for groups",
    "tokens_per_s": "tokens trained per second of step time, last step",
    "loss": "policy loss of the last step",
    "reward_mean": "mean reward of the last step's samples",
    "clip_frac": "share of loss tokens whose PPO ratio was clipped, last step",
    "tis_clip_frac": "share of loss tokens whose importance weight was truncated, last step",
    "mismatch_kl": "KL(engine || trainer) estimate on the last step's tokens",
    "staleness_mean": "mean weight versions between generation and training, last step",
    "staleness_max": "largest weight-version lag of a group in the last step",
    "checkpoint_s": "duration of the last checkpoint",
    "weight_sync_s": "duration of the last weight sync",
}


@dataclass
class StepRecord:
    """What one step did and measured."""

    step: int
    weight_version: int
    step_s: float
    wait_s: float
    checkpoint_s: float
    weight_sync_s: float
    num_groups: int
    num_samples: int
    num_tokens: int
    reward_mean: float
    staleness_mean: float
    staleness_max: int
    metrics: dict[str, float]


class TrainerStats:
    """Thread-safe store of the trainer's figures (the loop writes, admin requests read)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._last: StepRecord | None = None
        self.total_wait_s = 0.0
        self.total_step_s = 0.0
        self.total_weight_sync_s = 0.0
        self.total_tokens = 0
        self.steps_recorded = 0
        self.phase = "starting"
        self.sync_failures = 0          # failed weight-sync tries, whole run
        self.last_sync_error: str | None = None
        self.dropped_groups: dict[str, int] = {}  # groups read but not trained, by reason
        self.eval_success: dict[int, float] = {}  # held-out success by weight version
        self._eval_gauges = {
            "success": gauge("riptide_trainer_eval_success",
                             "held-out success of the latest evaluated weight version"),
            "weight_version": gauge("riptide_trainer_eval_weight_version",
                                    "the latest weight version with a held-out evaluation"),
        }
        self._gauges = {k: gauge(f"riptide_trainer_{k}", doc) for k, doc in _GAUGES.items()}
        self._steps = counter("riptide_trainer_steps", "optimizer steps taken")
        self._tokens = counter("riptide_trainer_tokens", "tokens trained")
        self._sync_failures = counter("riptide_trainer_weight_sync_failures",
                                      "weight-sync tries that failed (each is retried)")
        self._replay = {
            "routing_replay_tokens": counter(
                "riptide_trainer_routing_replay_tokens",
                "MoE: tokens routed by the engine's routed experts (routing replay)"),
            "routing_replay_fallback_tokens": counter(
                "riptide_trainer_routing_replay_fallback_tokens",
                "MoE: tokens without the engine's routes, routed by the trainer itself"),
        }

    def set_phase(self, phase: str) -> None:
        with self._lock:
            self.phase = phase

    def sync_failed(self, version: int, error: str) -> None:
        """A weight-sync try failed: the trainer is `degraded` until one lands."""
        with self._lock:
            self.phase = "degraded"
            self.sync_failures += 1
            self.last_sync_error = f"v{version}: {error[:500]}"
        self._sync_failures.inc()

    def sync_succeeded(self, version: int) -> None:
        with self._lock:
            self.last_sync_error = None
            if self.phase == "degraded":
                self.phase = "syncing"

    def record_eval(self, weight_version: int, success: float) -> bool:
        """A held-out evaluation's result; False if that version's was already recorded."""
        with self._lock:
            if weight_version in self.eval_success:
                return False
            self.eval_success[weight_version] = success
            latest = max(self.eval_success)
        self._eval_gauges["success"].set(self.eval_success[latest])
        self._eval_gauges["weight_version"].set(latest)
        return True

    def group_dropped(self, reason: str) -> None:
        with self._lock:
            self.dropped_groups[reason] = self.dropped_groups.get(reason, 0) + 1

    def record(self, rec: StepRecord) -> None:
        with self._lock:
            self._last = rec
            self.total_wait_s += rec.wait_s
            self.total_step_s += rec.step_s
            self.total_weight_sync_s += rec.weight_sync_s
            self.total_tokens += rec.num_tokens
            self.steps_recorded += 1
            values = self._values(rec)
        for key, value in values.items():
            self._gauges[key].set(value)
        self._steps.inc()
        self._tokens.inc(rec.num_tokens)
        for key, replay_counter in self._replay.items():
            replay_counter.inc(rec.metrics.get(key, 0.0))

    def _values(self, rec: StepRecord) -> dict[str, float]:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return {
            "step_s": rec.step_s,
            "wait_s": rec.wait_s,
            "bubble_ratio": self.total_wait_s / elapsed,
            "tokens_per_s": rec.num_tokens / max(rec.step_s, 1e-9),
            "loss": rec.metrics.get("loss", 0.0),
            "reward_mean": rec.reward_mean,
            "clip_frac": rec.metrics.get("clip_frac", 0.0),
            "tis_clip_frac": rec.metrics.get("tis_clip_frac", 0.0),
            "mismatch_kl": rec.metrics.get("mismatch_kl", 0.0),
            "staleness_mean": rec.staleness_mean,
            "staleness_max": float(rec.staleness_max),
            "checkpoint_s": rec.checkpoint_s,
            "weight_sync_s": rec.weight_sync_s,
        }

    def snapshot(self) -> dict[str, Any]:
        """JSON-able state: phase, totals and the last step."""
        with self._lock:
            rec = self._last
            out: dict[str, Any] = {
                "phase": self.phase,
                "total_wait_s": round(self.total_wait_s, 3),
                "total_step_s": round(self.total_step_s, 3),
                "total_weight_sync_s": round(self.total_weight_sync_s, 3),
                "steps_recorded": self.steps_recorded,
                "total_tokens": self.total_tokens,
                "sync_failures": self.sync_failures,
                "last_sync_error": self.last_sync_error,
                "dropped_groups": dict(self.dropped_groups),
                "eval_success_by_weight_version": {
                    str(v): s for v, s in sorted(self.eval_success.items())},
                "last_step": None,
            }
            if rec is not None:
                out["last_step"] = {**asdict(rec), **self._values(rec)}
        return out
