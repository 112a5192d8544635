"""The trainer's figures: totals over the steps it recorded (what the learning run reports as
seconds per step) and each step's own metrics in its snapshot."""

from __future__ import annotations

from services.trainer.objective.stats import StepRecord, TrainerStats


def _record(step: int, wait_s: float, step_s: float, sync_s: float,
            metrics: dict[str, float] | None = None) -> StepRecord:
    return StepRecord(step=step, weight_version=step, step_s=step_s, wait_s=wait_s,
                      checkpoint_s=0.0, weight_sync_s=sync_s, num_groups=2, num_samples=16,
                      num_tokens=1000, reward_mean=0.5, staleness_mean=0.0, staleness_max=0,
                      metrics=metrics or {})


def test_the_snapshot_sums_every_step_and_keeps_the_last_ones_metrics() -> None:
    stats = TrainerStats()
    stats.record(_record(1, wait_s=2.0, step_s=0.5, sync_s=0.25))
    stats.record(_record(2, wait_s=1.0, step_s=0.75, sync_s=0.5,
                         metrics={"cuda_peak_reserved_gib": 3.5}))
    snap = stats.snapshot()
    assert snap["steps_recorded"] == 2 and snap["total_tokens"] == 2000
    assert (snap["total_wait_s"], snap["total_step_s"], snap["total_weight_sync_s"]) == (
        3.0, 1.25, 0.75)
    assert snap["last_step"]["step"] == 2
    assert snap["last_step"]["metrics"] == {"cuda_peak_reserved_gib": 3.5}


def test_a_fresh_trainer_reports_zero_steps() -> None:
    snap = TrainerStats().snapshot()
    assert snap["steps_recorded"] == 0 and snap["total_weight_sync_s"] == 0.0
    assert snap["last_step"] is None
