"""The trainer's main loop: read batch, step, checkpoint, ack, sync.

`TrainerLoop.run` is the whole control flow; the work lives in data.py (stream), step.py
(loss and optimizer updates; pipeline_step.py with PP > 1), checkpoint.py and the injected
weight-sync callable. The policy is injected too, so the same loop drives the megatron model
(service.py) and tiny torch models (tests). Entries are acked only after the checkpoint
covering them is durable; on start the loop resumes from the newest checkpoint and re-reads
what it had not covered.

A failed weight sync never ends the loop: the same version is pushed again with backoff
(phase `degraded` meanwhile; the weight sync forms its group afresh after a failure), until it
lands or the loop is stopped. While it waits for groups the loop also asks `needs_weights`
(the rollout restarted and its engines hold no current weights) and pushes a new version
then, so a restarted rollout never waits for a step that waits for its groups.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from services.common.events import EventPublisher
from services.trainer.config import TrainerConfig
from services.trainer.data.batch import RolloutBatch
from services.trainer.data.data import GroupStream, Recovery
from services.trainer.model.policy import LogprobSource, Policy
from services.trainer.objective.stats import StepRecord, TrainerStats
from services.trainer.pipeline_step import train_step_for
from services.trainer.step import DataShard
from services.trainer.weights.checkpoint import Checkpointer, TrainerState

#: Pushes the policy's weights to the engines as the given weight version.
WeightSyncFn = Callable[[int], Any]
#: Called with each batch right before it is trained (rank 0 hands it to the other ranks).
OnStepFn = Callable[[RolloutBatch], Any]
#: Whether the engines lack the trainer's current weights (asked while waiting for groups).
NeedsWeightsFn = Callable[[], bool]
_SYNC_MARKER = "weight_version_sent.json"
log = logging.getLogger(__name__)


class TrainerLoop:
    """Trains from the stream until stopped (or `max_steps`), checkpointing as it goes."""

    def __init__(
        self,
        config: TrainerConfig,
        policy: Policy,
        stream: GroupStream,
        checkpointer: Checkpointer,
        sync: WeightSyncFn | None = None,
        reference: LogprobSource | None = None,
        stats: TrainerStats | None = None,
        on_step: OnStepFn | None = None,
        shard: DataShard | None = None,
        device: torch.device | None = None,
        needs_weights: NeedsWeightsFn | None = None,
        events: EventPublisher | None = None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.stream = stream
        self.checkpointer = checkpointer
        self.sync = sync
        self.reference = reference
        self.stats = stats or TrainerStats()
        self.on_step = on_step
        self.shard = shard
        self.device = device or torch.device("cpu")  # where the policy's parameters live
        self.needs_weights = needs_weights
        self.events = events or EventPublisher.disabled("trainer")
        self._should_stop: Callable[[], bool] = lambda: False
        self._next_weights_check = 0.0
        self._waited_once = False
        self.train_step = train_step_for(config.parallel)
        self.state = TrainerState()
        self.recovery: Recovery | None = None
        self.unpaused = threading.Event()
        self.unpaused.set()

    def run(self, should_stop: Callable[[], bool]) -> TrainerState:
        self._should_stop = should_stop
        self._resume()
        while not should_stop() and not self._reached_max_steps():
            if not self.unpaused.wait(timeout=0.2):
                continue
            self.stats.set_phase("waiting")
            waited_at = time.time()
            batch = self.stream.next_batch(should_stop, self._known, self._reject,
                                           self._while_waiting)                 # read (blocks)
            self._take_rejected()
            if batch is None:
                break
            # The first wait of a process also covers engines starting and the first
            # episodes: `warmup` keeps it out of the dashboard's idle fraction.
            self.events.publish("trainer.wait_data", start=waited_at, end=time.time(),
                                weight_version=self.state.weight_version,
                                attrs={"groups": len(batch.group_ids),
                                       "warmup": not self._waited_once})
            self._waited_once = True
            self.stats.set_phase("training")
            trained_version, start, started_at = (self.state.weight_version, time.monotonic(),
                                                  time.time())
            if self.on_step is not None:
                self.on_step(batch)
            metrics = self.train_step(                                  # step
                self.policy, batch.on_device(self.device), self.config.loss.settings(),
                self.config.num_minibatches, self.reference, self.shard,
            )  # fmt: skip
            step_s = time.monotonic() - start
            self._warn_routing_fallback(metrics)
            self._advance(batch)
            checkpoint_s = 0.0
            if self.state.step % self.config.checkpoint.interval_steps == 0:
                checkpoint_s = self._checkpoint_and_ack()                # checkpoint, ack
            sync_s = 0.0
            if self.sync and self.state.step % self.config.weight_sync.interval_steps == 0:
                sync_s = self._sync()                                    # sync
            self._record(batch, metrics, trained_version, step_s, checkpoint_s, sync_s)
            self._publish_step(batch, metrics, trained_version, started_at, step_s,
                               checkpoint_s + sync_s)
        if self.state.unacked_entry_ids:
            self._checkpoint_and_ack()
        self.stats.set_phase("stopped")
        return self.state

    def _warn_routing_fallback(self, metrics: dict[str, float]) -> None:
        """Tokens of an MoE step that had no engine routes (routing_replay.py): a warning, an
        event and the counter in stats.py."""
        fallback = metrics.get("routing_replay_fallback_tokens", 0.0)
        if fallback > 0:
            replayed = metrics.get("routing_replay_tokens", 0.0)
            log.warning("step %d: %d of %d tokens had no routed experts from the engine and "
                        "were routed by the trainer", self.state.step + 1, int(fallback),
                        int(fallback + replayed))
            self.events.publish("trainer.routing_replay_fallback", id=str(self.state.step + 1),
                                weight_version=self.state.weight_version,
                                attrs={"fallback_tokens": fallback, "replayed_tokens": replayed})

    def _reached_max_steps(self) -> bool:
        return 0 < self.config.max_steps <= self.state.step

    def _resume(self) -> None:
        self.stats.set_phase("resuming")
        self.checkpointer.discard_incomplete()
        self.state = self.checkpointer.load(self.policy) or TrainerState()
        self._trained = set(self.state.trained_group_ids)
        self._known = self._trained | set(self.state.dropped_groups)
        self.recovery = self.stream.recover(self.state.unacked_entry_ids, self._known)
        self.state.unacked_entry_ids = []
        sent = self._read_sync_marker()
        if self.sync and sent > self.state.weight_version:
            # The engines may hold weights of steps lost with the crash: push the checkpoint's
            # weights under a version number never used before.
            self.state.weight_version = sent
            self._sync()

    def _advance(self, batch: RolloutBatch) -> None:
        self.state.step += 1
        self.state.trained_group_ids += batch.group_ids
        self._trained.update(batch.group_ids)
        self._known.update(batch.group_ids)
        self.state.unacked_entry_ids += batch.entry_ids
        self.state.num_samples += batch.num_samples
        self.state.num_tokens += batch.num_tokens

    def _checkpoint_and_ack(self) -> float:
        start = time.monotonic()
        self.stats.set_phase("checkpointing")
        step = self.state.step
        with self.events.span("trainer.checkpoint", id=str(step), attrs={"step": step},
                              weight_version=self.state.weight_version):
            self.checkpointer.save(self.policy, self.state)
            self.stream.ack(self.state.unacked_entry_ids)
        self.state.unacked_entry_ids = []
        return time.monotonic() - start

    def _sync(self) -> float:
        assert self.sync is not None
        start = time.monotonic()
        self.stats.set_phase("syncing")
        self.state.weight_version += 1
        version = self.state.weight_version
        self._write_sync_marker(version)  # once per version, not per try
        with self.events.span("trainer.weight_sync", id=str(version),
                              weight_version=version) as attrs:
            report = self._push(version)
            attrs.update(bytes=getattr(report, "num_bytes", None),
                         buckets=getattr(report, "num_buckets", None))
        for index, (begin, end, size) in enumerate(getattr(report, "bucket_spans", ())):
            self.events.publish("trainer.weight_sync.bucket", id=f"{version}/{index}",
                                start=begin, end=end, weight_version=version,
                                attrs={"index": index, "bytes": size})
        return time.monotonic() - start

    def _push(self, version: int) -> Any:
        """Push `version` until it lands; back off while it fails; give up only on stop."""
        assert self.sync is not None
        ws = self.config.weight_sync
        delay, attempt = ws.retry_initial_s, 0
        while True:
            attempt += 1
            try:
                report = self.sync(version)
                self.stats.sync_succeeded(version)
                return report
            except Exception as exc:  # any failure: the engines keep the previous weights
                log.warning("weight sync v%d failed (attempt %d), retrying in %.1fs: %s",
                            version, attempt, delay, exc)
                self.stats.sync_failed(version, f"{type(exc).__name__}: {exc}")
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:
                if self._should_stop():
                    log.warning("stopping with weight sync v%d not delivered", version)
                    return None
                time.sleep(min(0.2, delay))
            delay = min(delay * 2, ws.retry_max_s)

    def _while_waiting(self) -> None:
        """Between blocking reads: push weights when the engines lack the current ones."""
        if self.sync is None or self.needs_weights is None:
            return
        now = time.monotonic()
        if now < self._next_weights_check:
            return
        self._next_weights_check = now + self.config.weight_sync.check_interval_s
        try:
            needed = self.needs_weights()
        except Exception as exc:  # the rollout is away: nothing to push to yet
            log.debug("asking whether the engines need weights failed: %s", exc)
            return
        if needed:
            log.info("the engines lack weight version %d: pushing the current weights",
                     self.state.weight_version)
            self._sync()
            self.stats.set_phase("waiting")
            # From the push's end: the rollout's status needs a moment to show the engines
            # ready, and asking at once would push (and bump the version) a second time.
            self._next_weights_check = (time.monotonic()
                                        + self.config.weight_sync.check_interval_s)

    def _reject(self, group: Any) -> str | None:
        """Why a group must not be trained (None: train it): older than max_staleness."""
        bound = self.config.max_staleness
        if bound is not None and self.state.weight_version - group.min_weight_version > bound:
            return "stale"
        return None

    def _take_rejected(self) -> None:
        """Groups the stream left out: recorded with their reason, acked with the next
        checkpoint (so a crash before it re-reads and re-judges them, never loses them)."""
        for entry_id, group_id, reason in self.stream.take_rejected():
            self.state.dropped_groups[group_id] = reason
            self._known.add(group_id)
            self.state.unacked_entry_ids.append(entry_id)
            self.stats.group_dropped(reason)
            self.events.publish("trainer.group_dropped", id=group_id,
                                weight_version=self.state.weight_version,
                                attrs={"group_id": group_id, "reason": reason})

    def _marker_path(self) -> Path:
        return self.checkpointer.directory / _SYNC_MARKER

    def _read_sync_marker(self) -> int:
        try:
            return int(json.loads(self._marker_path().read_text())["weight_version"])
        except FileNotFoundError:
            return 0

    def _write_sync_marker(self, version: int) -> None:
        tmp = self._marker_path().with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"weight_version": version}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._marker_path())

    def _record(
        self,
        batch: RolloutBatch,
        metrics: dict[str, float],
        trained_version: int,
        step_s: float,
        checkpoint_s: float,
        sync_s: float,
    ) -> None:
        staleness = [max(0, trained_version - v) for v in batch.min_weight_versions]
        self.stats.record(
            StepRecord(
                step=self.state.step,
                weight_version=self.state.weight_version,
                step_s=step_s,
                wait_s=batch.wait_s,
                checkpoint_s=checkpoint_s,
                weight_sync_s=sync_s,
                num_groups=len(batch.group_ids),
                num_samples=batch.num_samples,
                num_tokens=batch.num_tokens,
                reward_mean=sum(batch.rewards) / max(len(batch.rewards), 1),
                staleness_mean=sum(staleness) / max(len(staleness), 1),
                staleness_max=max(staleness, default=0),
                metrics=metrics,
            )
        )

    def _publish_step(self, batch: RolloutBatch, metrics: dict[str, float],
                      trained_version: int, started_at: float, step_s: float,
                      after_s: float) -> None:
        """The step's span and figures; idle is this cycle's wait for data over the cycle."""
        cycle_s = batch.wait_s + step_s + after_s
        rewards = batch.rewards
        self.events.publish("trainer.step", id=str(self.state.step), start=started_at,
                            end=started_at + step_s, weight_version=trained_version, attrs={
            "step": self.state.step,
            "reward_mean": sum(rewards) / max(len(rewards), 1),
            "success_rate": sum(r >= 1.0 for r in rewards) / max(len(rewards), 1),
            "groups": len(batch.group_ids), "samples": batch.num_samples,
            "tokens": batch.num_tokens, "tokens_per_s": batch.num_tokens / max(step_s, 1e-9),
            "loss": metrics.get("loss"), "mismatch_kl": metrics.get("mismatch_kl"),
            "staleness": [max(0, trained_version - v) for v in batch.sample_weight_versions],
            "idle_fraction": batch.wait_s / cycle_s if cycle_s > 0 else 0.0,
        })  # fmt: skip
