"""Crash and restart the trainer: every produced group is trained exactly once.

The real service (`riptide serve trainer`, megatron model on CPU, disk-streamed optimizer)
reads from a real redis-server; it is SIGKILLed after a few steps and started again. A second
test crashes an in-process loop in the window between a durable checkpoint and its ack.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from services.common import process
from services.common.buffer import SampleBuffer
from services.common.config import RedisConfig
from services.common.ports import free_ports
from services.testing.trainer_groups import scored_group
from services.trainer.config import TrainerConfig
from services.trainer.data.data import GroupStream
from services.trainer.loop import TrainerLoop
from services.trainer.model.policy import ModelPolicy
from services.trainer.optim.optimizer_stream import MasterAdam
from services.trainer.weights.checkpoint import STATE_FILE, Checkpointer

ADMIN = "admin-token-123"
RUN = "restart"


def _produce(buffer: SampleBuffer, indices: range) -> list[str]:
    for i in indices:
        assert buffer.put(scored_group(i, vocab=200))
    return [f"group-{i:03d}" for i in indices]


def _trained(ckpt_dir: Path) -> tuple[int, list[str]]:
    while True:  # the trainer may delete an old checkpoint while we read it
        latest = Checkpointer(ckpt_dir).latest()
        if latest is None:
            return 0, []
        try:
            state = json.loads((latest / STATE_FILE).read_text())
        except FileNotFoundError:
            continue
        return state["step"], state["trained_group_ids"]


def _wait(predicate, proc, timeout_s: float, what: str, log: Path) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        assert proc.poll() is None, f"trainer exited: {log.read_text()[-3000:]}"
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}: {log.read_text()[-3000:]}")


@pytest.mark.slow
def test_sigkill_and_restart_trains_each_group_once(
    redis_config: RedisConfig, workdir: Path,
) -> None:
    from services.common.tiny_model import create_tiny_model

    model_dir = create_tiny_model(workdir / "model", num_layers=1)
    ckpt_dir = workdir / "ckpt"
    grpc_port, admin_port = free_ports(2)
    config = workdir / "deploy.toml"
    config.write_text(f"""
[run]
name = "{RUN}"
admin_token = "{ADMIN}"
log_format = "text"
[redis]
url = "{redis_config.url}"
password = "{redis_config.password}"
[trainer]
grpc_port = {grpc_port}
admin_port = {admin_port}
rollout_batch_size = 2
read_block_ms = 200
[trainer.model]
hf_path = "{model_dir}"
dtype = "bfloat16"
[trainer.optimizer]
lr = 1e-3
stream_optimizer_state_to_disk = "{workdir / 'optstate'}"
bucket_mb = 0.5
[trainer.checkpoint]
dir = "{ckpt_dir}"
[trainer.weight_sync]
mode = "off"
""")
    cmd = [sys.executable, "-m", "services.cli", "serve", "trainer", "--config", str(config)]
    buffer = SampleBuffer(redis_config, RUN)
    produced = _produce(buffer, range(10))
    log = workdir / "trainer.log"
    proc = process.spawn(cmd, log_path=log)
    try:
        _wait(lambda: _trained(ckpt_dir)[0] >= 2, proc, 120, "two checkpoints", log)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        killed_at = _trained(ckpt_dir)[0]
        produced += _produce(buffer, range(10, 20))
        proc = process.spawn(cmd, log_path=log)
        _wait(lambda: len(_trained(ckpt_dir)[1]) >= 20, proc, 120, "all groups", log)
        state = httpx.get(f"http://127.0.0.1:{admin_port}/admin/state",
                          headers={"Authorization": f"Bearer {ADMIN}"}, timeout=5).json()
        assert process.stop(proc) == 0, log.read_text()[-3000:]
    finally:
        process.stop(proc, grace_s=2)
    step, trained = _trained(ckpt_dir)
    assert sorted(trained) == sorted(produced) and len(trained) == len(set(trained))
    assert step == 10 and killed_at >= 2
    stats = buffer.stats()
    assert (stats.length, stats.pending) == (0, 0)  # everything acked (and deleted)
    details = state["details"]
    print("killed after step", killed_at, "recovery", details["recovery"])
    assert details["step"] >= 9 and details["last_step"]["num_groups"] == 2
    for key in ("step_s", "wait_s", "bubble_ratio", "tokens_per_s", "loss", "reward_mean",
                "clip_frac", "mismatch_kl", "staleness_mean", "weight_sync_s"):
        assert key in details["last_step"], key


class _CrashAfterSave(Checkpointer):
    """Dies (raises) right after the n-th durable checkpoint, before the loop acks."""

    def __init__(self, directory: Path, crash_at_step: int) -> None:
        super().__init__(directory)
        self.crash_at_step = crash_at_step

    def save(self, policy, state):  # type: ignore[no-untyped-def]
        path = super().save(policy, state)
        if state.step == self.crash_at_step:
            raise KeyboardInterrupt("crash between checkpoint and ack")
        return path


def _tiny_loop(
    redis_config: RedisConfig, workdir: Path, checkpointer: Checkpointer, synced: list[int]
) -> TrainerLoop:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(200, 16), torch.nn.Linear(16, 200))
    opt = MasterAdam(list(model.parameters()), lr=1e-2, state_dir=workdir / "optstate")
    config = TrainerConfig(rollout_batch_size=2, read_block_ms=50, max_steps=5)
    buffer = SampleBuffer(redis_config, RUN)
    stream = GroupStream(buffer, "trainer-0", 2, True, 4096, block_ms=50)
    return TrainerLoop(config, ModelPolicy(model, opt), stream, checkpointer, synced.append)


def test_crash_between_checkpoint_and_ack_neither_skips_nor_repeats(
    redis_config: RedisConfig, workdir: Path
) -> None:
    buffer = SampleBuffer(redis_config, RUN)
    produced = _produce(buffer, range(10))
    synced: list[int] = []
    crashing = _tiny_loop(redis_config, workdir, _CrashAfterSave(workdir / "ckpt", 3), synced)
    with pytest.raises(KeyboardInterrupt):
        crashing.run(lambda: False)
    assert buffer.stats().pending == 2  # step 3's groups: checkpointed, not acked
    loop = _tiny_loop(redis_config, workdir, Checkpointer(workdir / "ckpt"), synced)
    state = loop.run(lambda: False)
    assert loop.recovery.acked_covered == 2 and loop.recovery.requeued == 0
    assert state.step == 5 and state.trained_group_ids == produced
    assert (buffer.stats().length, buffer.stats().pending) == (0, 0)
    assert synced == [1, 2, 3, 4] and state.weight_version == 4  # never a version twice


def test_restart_after_an_unsaved_sync_pushes_the_checkpoint_under_a_new_version(
    redis_config: RedisConfig, workdir: Path
) -> None:
    buffer = SampleBuffer(redis_config, RUN)
    _produce(buffer, range(4))
    synced: list[int] = []
    first = _tiny_loop(redis_config, workdir, Checkpointer(workdir / "ckpt"), synced)
    first.config.max_steps = 2
    first.config.checkpoint.interval_steps = 2
    first.config.weight_sync.interval_steps = 1
    first.run(lambda: False)  # syncs v1 after step 1 (not checkpointed), v2 after step 2
    assert synced == [1, 2]
    (workdir / "ckpt" / "step-00000002").rename(workdir / "ckpt" / "lost")
    Checkpointer(workdir / "ckpt").save(first.policy, _state_at_step_zero())
    second = _tiny_loop(redis_config, workdir, Checkpointer(workdir / "ckpt"), synced)
    second.config.max_steps = 1
    second.run(lambda: True)
    assert synced == [1, 2, 3]  # the engines may hold v2's weights: resync under v3


def _state_at_step_zero():  # type: ignore[no-untyped-def]
    from services.trainer.weights.checkpoint import TrainerState

    return TrainerState()
