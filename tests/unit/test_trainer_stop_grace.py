"""The local stack's grace for the trainer's stop: long enough for the step in progress, its
sync and a checkpoint, judged by the last step; a floor where there is nothing to judge by."""

from __future__ import annotations

from services.local_stack import TRAINER_STOP_GRACE_S, trainer_stop_grace_s


def test_a_fast_or_unknown_trainer_gets_the_floor() -> None:
    assert trainer_stop_grace_s({}) == TRAINER_STOP_GRACE_S
    assert trainer_stop_grace_s({"last_step": None}) == TRAINER_STOP_GRACE_S
    fast = {"last_step": {"step_s": 1.0, "weight_sync_s": 0.1, "checkpoint_s": 2.0}}
    assert trainer_stop_grace_s(fast) == TRAINER_STOP_GRACE_S
    assert trainer_stop_grace_s({"last_step": {"step_s": "n/a"}}) == TRAINER_STOP_GRACE_S


def test_a_slow_trainer_gets_twice_its_last_step_and_a_minute() -> None:
    # two CPU cores, float32: a 166 s step and a 1.3 s sync; the fixed 180 s killed the step
    # in progress and with it the four steps not yet checkpointed
    slow = {"last_step": {"step_s": 166.0, "weight_sync_s": 1.3, "checkpoint_s": 0.0}}
    assert trainer_stop_grace_s(slow) == 2 * 167.3 + 60.0
    assert trainer_stop_grace_s({"last_step": {"step_s": 100.0, "checkpoint_s": 40.0}}) == 340.0
