"""The trainer loop against a real Redis stream when weight syncs fail or groups are stale.

A failed sync is retried under the same version (the marker is written once), the loop
reports `degraded` meanwhile and goes on training once a try lands; a resume sync to a
rollout that is not up yet waits for it instead of ending the loop; groups older than
`max_staleness` are dropped with a recorded reason and acked with the next checkpoint; an
idle trainer pushes weights when the engines lack them.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.errors import Unavailable
from services.testing.trainer_groups import scored_group
from services.trainer.config import TrainerConfig
from services.trainer.data.data import GroupStream
from services.trainer.loop import TrainerLoop
from services.trainer.model.policy import ModelPolicy
from services.trainer.optim.optimizer_stream import MasterAdam
from services.trainer.weights.checkpoint import Checkpointer

RUN = "syncfaults"


class FlakySync:
    """Fails the first `failures` calls (the rollout is away), then records versions."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls: list[int] = []
        self.delivered: list[int] = []
        self.phases: list[str] = []
        self.loop: TrainerLoop | None = None

    def __call__(self, version: int) -> None:
        self.calls.append(version)
        if self.loop is not None:
            self.phases.append(self.loop.stats.phase)
        if self.failures:
            self.failures -= 1
            raise Unavailable("UNAVAILABLE: rollout not up")
        self.delivered.append(version)


def _loop(redis_config: RedisConfig, workdir: Path, sync: object, **config: object) -> TrainerLoop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(200, 16), torch.nn.Linear(16, 200))
    opt = MasterAdam(list(model.parameters()), lr=1e-2, state_dir=workdir / "optstate")
    cfg = TrainerConfig(rollout_batch_size=2, read_block_ms=50, **config)  # type: ignore[arg-type]
    cfg.weight_sync.retry_initial_s = 0.05
    cfg.weight_sync.retry_max_s = 0.1
    stream = GroupStream(SampleBuffer(redis_config, RUN), "trainer-0", 2, True,
                         4096, block_ms=50)
    return TrainerLoop(cfg, ModelPolicy(model, opt), stream, Checkpointer(workdir / "ckpt"),
                       sync)  # type: ignore[arg-type]


def _fill(redis_config: RedisConfig, indices: range) -> SampleBuffer:
    buffer = SampleBuffer(redis_config, RUN)
    for i in indices:
        assert buffer.put(scored_group(i, vocab=200))
    return buffer


def _marker(workdir: Path) -> int:
    return int(json.loads((workdir / "ckpt" / "weight_version_sent.json").read_text())
               ["weight_version"])


def test_a_failed_sync_is_retried_under_one_version_and_training_goes_on(
    redis_config: RedisConfig, workdir: Path
) -> None:
    _fill(redis_config, range(6))
    sync = FlakySync(failures=3)
    loop = sync.loop = _loop(redis_config, workdir, sync, max_steps=3)
    state = loop.run(lambda: False)
    assert state.step == 3 and state.weight_version == 3
    assert sync.calls == [1, 1, 1, 1, 2, 3] and sync.delivered == [1, 2, 3]
    assert sync.phases == ["syncing", "degraded", "degraded", "degraded", "syncing", "syncing"]
    assert loop.stats.sync_failures == 3
    assert loop.stats.last_sync_error is None  # cleared once a try landed
    assert _marker(workdir) == 3


def test_resume_sync_to_an_absent_rollout_waits_without_bumping_the_marker(
    redis_config: RedisConfig, workdir: Path
) -> None:
    _fill(redis_config, range(2))
    first = _loop(redis_config, workdir, FlakySync(0), max_steps=1)
    first.config.checkpoint.interval_steps = 1
    first.run(lambda: False)  # checkpoint at v0, then sync v1 (marker 1 > checkpoint)
    assert _marker(workdir) == 1
    # The second start: the rollout is away for several tries (the old `make demo` failure).
    sync = FlakySync(failures=5)
    second = _loop(redis_config, workdir, sync, max_steps=1)
    state = second.run(lambda: False)
    assert sync.calls == [2] * 6 and sync.delivered == [2] and _marker(workdir) == 2
    assert state.weight_version == 2


def test_stop_while_a_sync_keeps_failing_ends_the_loop(
    redis_config: RedisConfig, workdir: Path,
) -> None:
    _fill(redis_config, range(2))
    sync = FlakySync(failures=10**6)
    loop = _loop(redis_config, workdir, sync, max_steps=5)
    deadline = time.monotonic() + 1.0
    state = loop.run(lambda: time.monotonic() > deadline)
    assert state.step == 1 and len(sync.calls) >= 3 and sync.delivered == []
    assert Checkpointer(workdir / "ckpt").steps() == [1]  # what was trained is kept


def test_groups_beyond_max_staleness_are_dropped_recorded_and_acked(
    redis_config: RedisConfig, workdir: Path
) -> None:
    sync = FlakySync(0)
    loop = _loop(redis_config, workdir, sync, max_steps=4, max_staleness=1)
    loop.config.checkpoint.interval_steps = 1
    buffer = _fill(redis_config, range(4))  # steps 1 and 2 at versions 0 and 1
    stale = [scored_group(i, vocab=200) for i in (10, 11)]  # generated at v0
    fresh = []
    for i in range(4, 8):
        group = scored_group(i, vocab=200)
        group.min_weight_version = 2
        fresh.append(group)
    for group in [*stale, *fresh]:
        assert buffer.put(group)
    state = loop.run(lambda: False)
    assert state.dropped_groups == {"group-010": "stale", "group-011": "stale"}
    assert state.trained_group_ids == [f"group-{i:03d}" for i in range(8)]
    assert loop.stats.dropped_groups == {"stale": 2}
    assert buffer.stats().length == 0  # dropped entries acked with a checkpoint, not lost
    saved = json.loads((Checkpointer(workdir / "ckpt").latest() / "trainer_state.json")  # type: ignore[operator]
                       .read_text())
    assert saved["dropped_groups"] == state.dropped_groups


def test_an_idle_trainer_pushes_weights_when_the_engines_lack_them(
    redis_config: RedisConfig, workdir: Path
) -> None:
    sync = FlakySync(0)
    asked = []
    loop = _loop(redis_config, workdir, sync)
    loop.config.weight_sync.check_interval_s = 0.05
    loop.needs_weights = lambda: (asked.append(1), len(sync.delivered) == 0)[1]
    deadline = time.monotonic() + 1.0
    state = loop.run(lambda: time.monotonic() > deadline)
    assert state.step == 0 and sync.delivered == [1] and len(asked) >= 3


class SlowSync(FlakySync):
    """A push that takes `seconds`, as a real one does."""

    def __init__(self, seconds: float) -> None:
        super().__init__(0)
        self.seconds = seconds

    def __call__(self, version: int) -> None:
        time.sleep(self.seconds)
        super().__call__(version)


def test_the_next_ask_waits_a_whole_interval_after_an_idle_push(
    redis_config: RedisConfig, workdir: Path
) -> None:
    # The rollout's status still says "needs weights" for a moment after a push; an ask timed
    # from before the push would push (and bump the version) again at once.
    sync = SlowSync(0.8)
    loop = _loop(redis_config, workdir, sync)
    loop.config.weight_sync.check_interval_s = 1.0
    loop.needs_weights = lambda: True
    deadline = time.monotonic() + 2.4
    loop.run(lambda: time.monotonic() > deadline)
    assert sync.delivered == [1, 2]  # at 0 s and 1.8 s; timed from the ask: 0, 1 and 2 s
