"""One episode end to end: acquire a sandbox, run the agent, verify, always delete.

Owns the caps on concurrent episodes and creates, and the guarantee that a sandbox never
outlives its episode: deletion runs in a `finally`, shielded from cancellation, and a
create that completes after its episode was cancelled is deleted as soon as it lands.
Called by the gRPC servicer (service.py); calls the provider, agent.py and verifier.py.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import RiptideError
from services.common.events import EventPublisher
from services.common.no_verdict import trajectory_cause
from services.sandbox.agent import AgentRun, EpisodeAgent
from services.sandbox.episode_detail import episode_detail
from services.sandbox.failures import AgentError, AgentTimeout, Phase, cause_of
from services.sandbox.leases import Leases, Owner, new_incarnation
from services.sandbox.limiter import Limiter
from services.sandbox.live import LiveSandboxes
from services.sandbox.provider import SandboxHandle, SandboxProvider
from services.sandbox.stats import SandboxStats
from services.sandbox.task import Task
from services.sandbox.verifier import Verdict, verify

log = logging.getLogger(__name__)

EmitFn = Callable[[sandbox_pb2.EpisodeProgress], None]


class EpisodeRunner:
    """Runs episodes under the service's caps and keeps its sandbox accounting."""

    def __init__(self, provider: SandboxProvider, agent: EpisodeAgent, stats: SandboxStats,
                 max_concurrent_episodes: int, max_concurrent_creates: int,
                 run_name: str, delete_timeout_s: float = 60.0,
                 events: EventPublisher | None = None, leases: Leases | None = None) -> None:
        self.events = events or EventPublisher.disabled("sandbox")
        self.leases = leases or Leases(provider, Owner(run_name, "", new_incarnation()))
        self.provider = provider
        self.agent = agent
        self.stats = stats
        self.episodes = Limiter(max_concurrent_episodes)
        self.creates = Limiter(max_concurrent_creates)
        self.run_name = run_name
        self.delete_timeout_s = delete_timeout_s
        self._deletes: set[asyncio.Task[None]] = set()
        self.live = LiveSandboxes()

    async def run(self, task: Task, request: sandbox_pb2.RunEpisodeRequest,
                  emit: EmitFn) -> common_pb2.Trajectory:
        """The episode's trajectory; infrastructure failures become no_verdict, not errors."""
        queued = time.monotonic()
        self.stats.episodes_queued += 1
        try:
            await self.episodes.acquire()
        finally:
            self.stats.episodes_queued -= 1
        self.stats.episode_started()
        self.live.begin(request.sample_id, request.group_id, task.name)
        status = finish_reason = ""
        cause: str | None = None
        try:
            trajectory = await self._run(task, request, emit, queued)
            status = common_pb2.VerdictStatus.Name(trajectory.status)
            finish_reason = trajectory.finish_reason
            cause = trajectory_cause(trajectory)
        finally:
            self.live.end(request.sample_id)
            self.stats.episode_finished(status, finish_reason, cause)
            await asyncio.shield(self.episodes.release())
        return trajectory

    async def _run(self, task: Task, request: sandbox_pb2.RunEpisodeRequest, emit: EmitFn,
                   queued: float) -> common_pb2.Trajectory:
        started = time.monotonic()
        timings = common_pb2.EpisodeTimings(queued_s=started - queued)

        def progress(kind: str, turn: int, detail: str) -> None:
            self.live.update(request.sample_id, turns=turn)
            emit(sandbox_pb2.EpisodeProgress(kind=kind, turn=turn, detail=detail,
                                             elapsed_s=time.monotonic() - started))

        run: AgentRun | None = None
        handle: SandboxHandle | None = None
        phase: Phase = "create"
        try:
            handle = await self._acquire(task, request.sample_id, timings)
            self.live.update(request.sample_id, state="running", sandbox_id=handle.sandbox_id)
            progress("sandbox_ready", 0, f"{handle.sandbox_id} in {timings.sandbox_create_s:.3f} s")
            phase = "agent"
            run = await self._run_agent(task, request, handle, progress)
            timings.generate_s, timings.exec_s = run.generate_s, run.exec_s
            self.live.update(request.sample_id, state="verifying")
            phase = "verify"
            with self.events.span("sandbox.verify", id=request.sample_id,
                                  attrs={"task_id": task.name}) as attrs:
                verdict = await verify(self.provider, handle, task)
                attrs.update(passed=verdict.reward >= 1.0
                             and verdict.status == common_pb2.VERDICT_STATUS_SCORED,
                             exit_code=verdict.exit_code, reward=verdict.reward,
                             scored=verdict.status == common_pb2.VERDICT_STATUS_SCORED)
            timings.verify_s = verdict.verify_s
        except RiptideError as exc:
            log.warning("episode %s of %s has no verdict: %s", request.sample_id, task.name, exc)
            verdict = Verdict.no_verdict(f"{type(exc).__name__}: {exc}", cause_of(exc, phase))
        finally:
            if handle is not None:
                self.live.update(request.sample_id, state="deleting")
                await self._delete_shielded(handle)
        if verdict.status == common_pb2.VERDICT_STATUS_SCORED:
            progress("verifier", run.num_turns if run else 0, f"reward {verdict.reward:g}")
        else:
            progress("verifier", run.num_turns if run else 0, f"no_verdict: {verdict.message}")
        timings.total_s = time.monotonic() - queued
        trajectory = _trajectory(task, request, run, verdict, timings)
        self.events.publish_episode(episode_detail(trajectory, run, verdict, self._decode))
        return trajectory

    async def _run_agent(self, task: Task, request: sandbox_pb2.RunEpisodeRequest,
                         handle: SandboxHandle, progress: Callable[[str, int, str], None]
                         ) -> AgentRun:
        """The agent's turns; it stops by itself at its wall time, and an agent still going
        `stop_grace_s` later (a hung command or harness) is an agent timeout."""
        wall_time_s = min(task.config.agent.timeout_sec, self.agent.config.wall_time_s)
        hard_limit_s = wall_time_s + self.agent.config.stop_grace_s
        try:
            return await asyncio.wait_for(
                self.agent.run(handle, task.instruction, request.sample_id,
                               request.sampling_params, task.config.agent.timeout_sec, progress,
                               task=task),
                hard_limit_s)
        except TimeoutError:
            raise AgentTimeout(f"the agent did not stop within {hard_limit_s:g} s (wall time "
                               f"{wall_time_s:g} s + grace {self.agent.config.stop_grace_s:g} "
                               "s)") from None
        except RiptideError:
            raise
        except Exception as exc:  # a crash of the agent or harness: this episode's, not ours
            log.exception("the agent of episode %s failed", request.sample_id)
            raise AgentError(f"{type(exc).__name__}: {exc}") from exc

    def _decode(self, ids: list[int]) -> str:
        """The text of a run of token ids (one to four: episode_detail.token_texts)."""
        return str(self.agent.tokenizer.decode(ids, skip_special_tokens=False))

    async def _acquire(self, task: Task, sample_id: str,
                       timings: common_pb2.EpisodeTimings) -> SandboxHandle:
        labels = self.leases.labels(task.name, sample_id)
        waited = time.monotonic()
        creation = asyncio.ensure_future(self._create(task, labels, waited))
        try:
            handle = await asyncio.shield(creation)
        except asyncio.CancelledError:
            # The create goes on; whatever it yields must not outlive this episode.
            creation.add_done_callback(self._delete_late_arrival)
            raise
        timings.sandbox_create_s = time.monotonic() - waited
        return handle

    async def _create(self, task: Task, labels: dict[str, str], waited: float) -> SandboxHandle:
        async with self.creates:
            started = time.monotonic()
            with self.events.span("sandbox.create", id=labels["riptide.episode"],
                                  attrs={"task_id": task.name}) as attrs:
                try:
                    handle = await self.provider.create(task, labels=labels)
                except BaseException as exc:
                    self.stats.create_failed()
                    attrs["error"] = type(exc).__name__
                    raise
                attrs["sandbox"] = handle.sandbox_id
        now = time.monotonic()
        self.stats.sandbox_created(handle, now - started, now - waited)
        self.leases.track(handle, labels)
        return handle

    def _delete_late_arrival(self, creation: asyncio.Future[SandboxHandle]) -> None:
        if not creation.cancelled() and creation.exception() is None:
            self._start_delete(creation.result())

    def _start_delete(self, handle: SandboxHandle) -> asyncio.Task[None]:
        deletion = asyncio.get_running_loop().create_task(self._delete(handle))
        self._deletes.add(deletion)
        deletion.add_done_callback(self._deletes.discard)
        return deletion

    async def _delete_shielded(self, handle: SandboxHandle) -> None:
        await asyncio.shield(self._start_delete(handle))

    async def _delete(self, handle: SandboxHandle) -> None:
        ok = False
        self.leases.forget(handle.sandbox_id)
        with self.events.span("sandbox.delete", id=handle.sandbox_id,
                              attrs={"sandbox": handle.sandbox_id,
                                     "task_id": handle.task_name}) as attrs:
            try:
                await asyncio.wait_for(self.provider.delete(handle), self.delete_timeout_s)
                ok = True
            except Exception:  # noqa: BLE001 - counted and logged; the episode's result stands
                log.exception("deleting sandbox %s failed", handle.sandbox_id)
            finally:
                self.stats.sandbox_deleted(handle, ok)
                self.live.touch()
                attrs["ok"] = ok

    async def drain_deletes(self, timeout_s: float) -> None:
        """Wait for deletions still in flight (at shutdown)."""
        if self._deletes:
            await asyncio.wait(set(self._deletes), timeout=timeout_s)


def _trajectory(task: Task, request: sandbox_pb2.RunEpisodeRequest, run: AgentRun | None,
                verdict: Verdict, timings: common_pb2.EpisodeTimings) -> common_pb2.Trajectory:
    trajectory = common_pb2.Trajectory(
        sample_id=request.sample_id, group_id=request.group_id, task_id=task.name,
        sample_index=request.sample_index, reward=verdict.reward, status=verdict.status,
        status_message=verdict.message, timings=timings, no_verdict_cause=verdict.cause)
    if run is not None:
        trace = run.trace
        trajectory.prompt_ids.extend(trace.prompt_ids)
        trajectory.response_ids.extend(trace.response_ids)
        trajectory.loss_mask.extend(trace.loss_mask)
        trajectory.rollout_logprobs.extend(trace.logprobs)
        trajectory.weight_versions.extend(trace.weight_versions)
        trajectory.segments.extend(segment.as_segment() for segment in run.extra_segments)
        trajectory.num_turns = run.num_turns
        trajectory.finish_reason = run.finish_reason
        trajectory.engine_url, trajectory.dp_rank = run.engine_url, run.dp_rank
        trajectory.prompt_tokens, trajectory.cached_tokens = run.prompt_tokens, run.cached_tokens
    return trajectory
