"""The fully asynchronous scheduler: keeps episodes in flight and turns them into groups.

Owns admission (how many episodes run, when a new one may start: concurrency, granularity,
pause, staleness via staleness.py), group assembly and filtering, and the ordered hand-off of
complete groups to the sink. Calls an EpisodeRunner and a GroupSink (episodes.py); the rollout
service (service.py) and bench/overlap.py drive it. Times come from the running event loop's
clock, so a virtual-time loop can run it fast and deterministically.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import Backpressure
from services.common.no_verdict import trajectory_cause
from services.rollout.config import SchedulerConfig
from services.rollout.episodes import (
    EpisodeRunner,
    GroupSink,
    call_failure_cause,
    generated_versions,
    no_verdict_trajectory,
)
from services.rollout.evaluation import EvalQueue
from services.rollout.run_events import RolloutEvents
from services.rollout.scheduler_stats import SchedulerStats
from services.rollout.staleness import StalenessGate
from services.rollout.task_sampler import TaskSampler

log = logging.getLogger(__name__)

SINK_RETRY_S = 1.0
# After this many episodes in a row without verdict, each failing one holds its slot a while
# longer (doubling up to FAILURE_BACKOFF_MAX_S), so a broken dependency is not hammered.
FAILURES_BEFORE_BACKOFF = 4
FAILURE_BACKOFF_MAX_S = 10.0


@dataclass
class _OpenGroup:
    group_id: str
    task_id: str
    size: int
    started_at: float
    next_index: int = 0
    start_versions: list[int] = field(default_factory=list)
    done: dict[int, common_pb2.Trajectory] = field(default_factory=dict)
    running: dict[int, asyncio.Task[None]] = field(default_factory=dict)


class Scheduler:
    """Keeps `max_concurrent_samples` episodes in flight and writes finished groups."""

    def __init__(self, config: SchedulerConfig, tasks: TaskSampler, runner: EpisodeRunner,
                 sink: GroupSink, *, weight_version: int = 0, id_prefix: str = "",
                 backlog_samples: int = 0, can_generate: Callable[[], bool] | None = None,
                 evaluation: EvalQueue | None = None,
                 events: RolloutEvents | None = None) -> None:
        self.config = config
        self.events = events or RolloutEvents()
        self._tasks = tasks
        self._runner = runner
        self._sink = sink
        # Groups already in the stream are consumed before any this scheduler writes.
        self._gate = StalenessGate(config, weight_version, backlog_samples)
        self._can_generate = can_generate  # False: no engine holds current weights; wait
        self._prefix = id_prefix or f"{int(time.time() * 1000):x}-{secrets.token_hex(16)}"
        self._group_seq = 0
        self._open: _OpenGroup | None = None
        self._unfinished: dict[str, _OpenGroup] = {}  # groups with samples still to finish
        self._episodes: set[asyncio.Task[None]] = set()
        self._write_queue: asyncio.Queue[tuple[common_pb2.Group, float, int]] = asyncio.Queue()
        self._writing = 0
        self._wake = asyncio.Event()
        self.paused = False
        self.in_flight = 0
        self.consecutive_failures = 0
        self.stats = SchedulerStats()
        self._tasks_running: list[asyncio.Task[None]] = []
        self.evaluation = evaluation
        if evaluation is not None:
            evaluation.on_version(weight_version)

    # -- control -----------------------------------------------------------------------
    @property
    def weight_version(self) -> int:
        return self._gate.version

    def set_weight_version(self, version: int) -> None:
        """The engines now hold `version`; admission may move on, and groups that can no
        longer be consumed in time stop early."""
        self._gate.version = version
        if self.evaluation is not None:
            self.evaluation.on_version(version)
        for group in list(self._unfinished.values()):
            self._stop_if_doomed(group)
        self._wake.set()

    def pause(self) -> None:
        """Start no new episodes; those in flight run to their end."""
        self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._wake.set()

    def config_changed(self) -> None:
        """Re-evaluate admission after a live change of the config."""
        self._wake.set()

    @property
    def queued_groups(self) -> int:
        """Complete groups accepted but not yet written to the sink."""
        return self._write_queue.qsize() + self._writing

    async def start(self) -> None:
        """Start admission and the writer as background tasks."""
        self.stats.record_in_flight(self._now(), 0)
        self._tasks_running = [asyncio.create_task(self._admission_loop()),
                               asyncio.create_task(self._writer_loop())]

    async def stop(self, flush_timeout_s: float = 10.0) -> None:
        """Cancel admission and every episode in flight, write the complete groups still
        queued (for up to `flush_timeout_s`), then stop the writer."""
        admission, writer = self._tasks_running or (None, None)
        tasks = [t for t in (admission, *self._episodes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if writer is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + flush_timeout_s
            while self.queued_groups and loop.time() < deadline and not writer.done():
                await asyncio.sleep(0.05)
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
        self._tasks_running = []

    def state(self) -> dict[str, Any]:
        now = self._now()
        return {
            "paused": self.paused,
            "in_flight_samples": self.in_flight,
            "queued_groups": self.queued_groups,
            "weight_version": self._gate.version,
            "staleness_budget": self._gate.budget(),
            "consecutive_failures": self.consecutive_failures,
            "task_sampler": self._tasks.state(),
            "config": self.config.model_dump(),
            **self.stats.as_dict(now),
            **({"eval": self.evaluation.summary()} if self.evaluation is not None else {}),
        }

    # -- admission ---------------------------------------------------------------------
    async def _admission_loop(self) -> None:
        while True:
            self._admit()
            await self._wake.wait()
            self._wake.clear()

    def _admit(self) -> None:
        cfg = self.config
        if self._can_generate is not None and not self._can_generate():
            return  # woken again when an engine is ready (the service pokes config_changed)
        while self.evaluation is not None and not self.paused \
                and self.in_flight < cfg.max_concurrent_samples:
            item = self.evaluation.next_request()
            if item is None:
                break
            self._start_eval(*item)
        while not self.paused and self.queued_groups < cfg.max_queued_groups:
            free = cfg.max_concurrent_samples - self.in_flight
            group = self._open or self._new_group()
            want = 1 if cfg.granularity == "sample" else group.size - group.next_index
            if free < want or not self._gate.can_admit(want):
                return
            for _ in range(want):
                self._start_sample(group)
            self._open = None if group.next_index == group.size else group

    def _new_group(self) -> _OpenGroup:
        self._group_seq += 1
        group = _OpenGroup(group_id=f"{self._prefix}-g{self._group_seq:06d}",
                           task_id=self._tasks.next_task(),
                           size=self.config.n_samples_per_prompt, started_at=0.0)
        self._open = group
        return group

    def _start_sample(self, group: _OpenGroup) -> None:
        index = group.next_index
        group.next_index += 1
        if index == 0:
            group.started_at = self._now()
            self._unfinished[group.group_id] = group
        group.start_versions.append(self._gate.version)
        cfg = self.config
        request = sandbox_pb2.RunEpisodeRequest(
            task_id=group.task_id, sample_id=f"{group.group_id}-s{index}",
            group_id=group.group_id, sample_index=index,
            sampling_params=common_pb2.SamplingParams(
                max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p),
        )
        self._gate.on_admit(1)
        self.in_flight += 1
        self.stats.submitted_samples += 1
        self.stats.record_in_flight(self._now(), self.in_flight)
        task = asyncio.create_task(self._run_episode(group, request))
        self._episodes.add(task)
        group.running[index] = task
        task.add_done_callback(self._episodes.discard)

    async def _run_episode(self, group: _OpenGroup,
                           request: sandbox_pb2.RunEpisodeRequest) -> None:
        started = time.time()
        try:
            try:
                trajectory = await self._runner.run(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # an episode failure is a sample without verdict
                log.warning("episode %s failed: %s", request.sample_id, exc)
                self.stats.runner_errors += 1
                trajectory = no_verdict_trajectory(request, f"{type(exc).__name__}: {exc}",
                                                   call_failure_cause(exc))
            await self._back_off_after(trajectory)
        finally:
            self.in_flight -= 1
            self.stats.record_in_flight(self._now(), self.in_flight)
            self._wake.set()
        self.events.episode(request, trajectory, started, self._gate.version)
        self._on_sample_done(group, request, trajectory)

    def _start_eval(self, version: int, request: sandbox_pb2.RunEpisodeRequest) -> None:
        """An evaluation episode in the next free slot; its result goes to the EvalQueue."""
        self.in_flight += 1
        self.stats.record_in_flight(self._now(), self.in_flight)
        self.events.eval_started(version)
        task = asyncio.create_task(self._run_eval(version, request))
        self._episodes.add(task)
        task.add_done_callback(self._episodes.discard)

    async def _run_eval(self, version: int, request: sandbox_pb2.RunEpisodeRequest) -> None:
        assert self.evaluation is not None
        started = time.time()
        try:
            trajectory = await self._runner.run(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # counted as a failed evaluation episode
            log.warning("evaluation episode %s failed: %s", request.sample_id, exc)
            trajectory = no_verdict_trajectory(request, f"{type(exc).__name__}: {exc}",
                                               call_failure_cause(exc))
        finally:
            self.in_flight -= 1
            self.stats.record_in_flight(self._now(), self.in_flight)
            self._wake.set()
        self.events.episode(request, trajectory, started, version, evaluation=True)
        self.evaluation.record(version, request, trajectory)
        self.events.eval_done(version, self.evaluation.summary())

    async def _back_off_after(self, trajectory: common_pb2.Trajectory) -> None:
        if trajectory.status == common_pb2.VERDICT_STATUS_SCORED:
            self.consecutive_failures = 0
            return
        self.consecutive_failures += 1
        excess = self.consecutive_failures - FAILURES_BEFORE_BACKOFF
        if excess >= 0:
            await asyncio.sleep(min(FAILURE_BACKOFF_MAX_S, 0.1 * 2 ** min(excess, 10)))

    # -- assembly ----------------------------------------------------------------------
    def _on_sample_done(self, group: _OpenGroup, request: sandbox_pb2.RunEpisodeRequest,
                        trajectory: common_pb2.Trajectory) -> None:
        trajectory.sample_id = request.sample_id
        trajectory.group_id = request.group_id
        trajectory.task_id = request.task_id
        trajectory.sample_index = request.sample_index
        self.stats.finished_samples += 1
        cause = trajectory_cause(trajectory)
        if cause is not None:
            self.stats.no_verdict_samples += 1
            self.stats.no_verdict_by_cause[cause] += 1
        if len(generated_versions(trajectory)) > 1:
            self.stats.mixed_version_samples += 1
        group.running.pop(request.sample_index, None)
        group.done[request.sample_index] = trajectory
        if len(group.done) == group.size:
            self._unfinished.pop(group.group_id, None)
            self._complete(group)
        else:
            self._stop_if_doomed(group)

    def _stop_if_doomed(self, group: _OpenGroup) -> None:
        """Drop a group at once when a finished sample already makes it too stale to use,
        cancelling its episodes still running: their slots go to fresh samples."""
        staleness = self.config.max_staleness
        versions = set().union(*(generated_versions(t) for t in group.done.values()))
        if staleness is None or not versions or not self._gate.is_stale(min(versions)):
            return
        self._unfinished.pop(group.group_id, None)
        if self._open is group:
            self._open = None
        for task in group.running.values():
            task.cancel()
        self.stats.cancelled_samples += len(group.running)
        self.stats.dropped_groups["stale"] += 1
        self.events.group_dropped(group.group_id, "stale", self._gate.version, group.next_index)
        self.stats.dropped_samples += group.next_index
        self._gate.on_drop(group.next_index)
        self._wake.set()

    def _complete(self, group: _OpenGroup) -> None:
        samples = [group.done[i] for i in range(group.size)]
        versions = set().union(*(generated_versions(t) for t in samples))
        min_version = min(versions) if versions else min(group.start_versions)
        reason = self._drop_reason(samples, min_version)
        if all(t.status == common_pb2.VERDICT_STATUS_SCORED for t in samples):
            self._tasks.record_group(group.task_id, [t.reward for t in samples])
        if reason is not None:
            self.stats.dropped_groups[reason] += 1
            if reason == "no_verdict":
                self.stats.dropped_no_verdict_by_cause.update(
                    c for t in samples if (c := trajectory_cause(t)) is not None)
            self.events.group_dropped(group.group_id, reason, self._gate.version, group.size)
            self.stats.dropped_samples += group.size
            self._gate.on_drop(group.size)
            self._wake.set()
            return
        staleness = self._gate.predicted_consume_version() - min_version
        self._gate.on_accept(group.size)
        message = common_pb2.Group(
            group_id=group.group_id, task_id=group.task_id, samples=samples,
            created_unix_ms=int(time.time() * 1000), min_weight_version=min_version)
        self._write_queue.put_nowait((message, self._now() - group.started_at, staleness))

    def _drop_reason(self, samples: list[common_pb2.Trajectory], min_version: int) -> str | None:
        if any(t.status != common_pb2.VERDICT_STATUS_SCORED for t in samples):
            return "no_verdict"
        if self.config.drop_zero_variance_groups and len({t.reward for t in samples}) == 1:
            return "zero_variance"
        if self._gate.is_stale(min_version):
            return "stale"
        return None

    # -- hand-off ----------------------------------------------------------------------
    async def _writer_loop(self) -> None:
        while True:
            group, latency_s, staleness = await self._write_queue.get()
            self._writing = 1
            attempts = 0
            while True:
                attempts += 1
                try:
                    written = await self._sink.put(group)
                    break
                except asyncio.CancelledError:
                    raise
                except Backpressure:  # the buffer stayed full for the put's whole timeout
                    self.stats.sink_backpressure += 1
                    continue
                except Exception as exc:  # the sink is idempotent by group id: retry
                    self.stats.sink_errors += 1
                    log.warning("writing group %s failed, retrying: %s", group.group_id, exc)
                    await asyncio.sleep(SINK_RETRY_S)
            self._writing = 0
            if written is False and attempts == 1:
                # The sink already holds this id and this scheduler never wrote it: an id
                # collision. Never a silent drop: counted, logged, and its budget returned.
                log.error("group %s rejected by the sink: its id was already written",
                          group.group_id)
                self.stats.sink_rejected += 1
                self.stats.dropped_groups["rejected_duplicate_id"] += 1
                self.events.group_dropped(group.group_id, "rejected_duplicate_id",
                                          self._gate.version, len(group.samples))
                self.stats.dropped_samples += len(group.samples)
                self._gate.on_drop(len(group.samples))
            else:  # False after a failed try: that try's write landed
                self.stats.record_group(latency_s, len(group.samples), staleness)
            self._wake.set()

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()
