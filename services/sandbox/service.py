"""The sandbox service: the Sandbox gRPC API over the episode runner, plus admin state.

Owns the task set, the provider, the model client, the episode runner and, where the
provider can list its sandboxes, the lease renewals and the reaper (leases.py, reaper.py:
a first sweep at start-up, one per `reap_interval_s`, a last one at stop); serves
`RunEpisode` (progress events, then exactly one trajectory), `ListTasks` and `GetStatus`.
Built by server.py's `build_runtime`, run by services/common/serve.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from fastapi import APIRouter

from services._proto.riptide.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.common.bounds import check_id
from services.common.errors import Conflict, NotFound, Unavailable
from services.common.event_loop import running_loop_name
from services.common.grpc_requests import require
from services.common.grpc_server import GuardedRegistrar
from services.common.sampling_params import sampling_params
from services.common.service import ServiceRuntime, status_message
from services.sandbox.config import SandboxConfig
from services.sandbox.episode import EpisodeRunner
from services.sandbox.live import publish_live, publish_snapshot
from services.sandbox.model_client import ModelClient
from services.sandbox.provider import SandboxProvider
from services.sandbox.reaper import Reaper
from services.sandbox.stats import SandboxStats
from services.sandbox.task import Task, TaskSet

if TYPE_CHECKING:
    from services.sandbox.gateway.server import AgentGateway

log = logging.getLogger(__name__)

_End = common_pb2.Trajectory | BaseException


def check_episode_request(request: sandbox_pb2.RunEpisodeRequest,
                          max_context_tokens: int) -> None:
    """Range checks of a RunEpisode request before any sandbox is made: ids that are set,
    short and printable, sampling parameters an engine accepts, and no more new tokens per
    turn than the agent's whole context holds (InvalidRequest)."""
    for name in ("task_id", "sample_id", "group_id"):
        check_id(name, getattr(request, name))
    require(bool(request.task_id), "task_id is empty: ListTasks lists the tasks")
    require(bool(request.sample_id), "RunEpisode needs a sample_id (the router session key)")
    sampling_params(request.sampling_params)  # the router would refuse it at the first turn
    asked = request.sampling_params.max_new_tokens
    require(asked <= max_context_tokens,
            f"sampling_params.max_new_tokens: {asked} is more than the agent's context cap "
            f"(sandbox.agent.max_context_tokens = {max_context_tokens})")


class SandboxService(ServiceRuntime):
    """Runs terminal-agent episodes in sandboxes, under live-tunable caps."""

    name = "sandbox"
    tunable_fields = frozenset({"max_concurrent_episodes", "max_concurrent_creates"})

    def __init__(self, config: SandboxConfig, tasks: TaskSet, provider: SandboxProvider,
                 model: ModelClient, runner: EpisodeRunner, stats: SandboxStats,
                 scripts: dict[str, list[str]] | None = None,
                 script_maker: Callable[[Task], list[str]] | None = None,
                 reaper: Reaper | None = None, gateway: AgentGateway | None = None) -> None:
        super().__init__()
        self.reaper = reaper
        self._upkeep: list[asyncio.Task[None]] = []
        self.config = config
        self.tunable = config
        self.tasks = tasks
        self.provider = provider
        self.model = model
        self.runner = runner
        self.stats = stats
        self._episodes: set[asyncio.Task[common_pb2.Trajectory]] = set()
        self._running: set[str] = set()
        self._started = False
        self._live: asyncio.Task[None] | None = None
        #: Scripted turns of the episodes in flight (model_client = "scripted" only).
        self.scripts = scripts if scripts is not None else {}
        self.script_maker = script_maker
        self.gateway = gateway

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        sandbox_pb2_grpc.add_SandboxServicer_to_server(SandboxServicer(self), server)

    async def start(self) -> None:
        if self.gateway is not None:
            await self.gateway.start()
            log.info("agent gateway on %s", self.gateway.base_url("<episode>"))
        self._started = True
        loop = asyncio.get_running_loop()
        if self.reaper is not None and self.provider.supports_listing:
            self._upkeep = [
                loop.create_task(self.reaper.keep_reaping(self.config.reap_interval_s)),
                loop.create_task(self.runner.leases.keep_renewing(
                    self.config.lease_renew_interval_s))]
        if self.runner.events.enabled:
            self._live = loop.create_task(publish_live(
                self.runner.events, self.runner.live, self.stats.alive,
                self.config.live_snapshot_interval_s, self.config.live_snapshot_heartbeat_s,
                self.sandbox_lifecycle))

    def ready(self) -> bool:
        return self._started

    async def stop(self) -> None:
        self._started = False
        for episode in list(self._episodes):
            episode.cancel()
        if self._episodes:
            await asyncio.wait(set(self._episodes), timeout=self.config.delete_timeout_s)
        await self.runner.drain_deletes(self.config.delete_timeout_s)
        if self.gateway is not None:
            await self.gateway.stop()
        for task in self._upkeep:
            task.cancel()
        if self._upkeep and self.reaper is not None:  # what this run's service made goes
            await asyncio.gather(*self._upkeep, return_exceptions=True)
            await self.reaper.sweep(final=True)
        if self._live is not None:
            self._live.cancel()
            # the last snapshot: what is still alive after the drain (usually nothing)
            publish_snapshot(self.runner.events, self.runner.live, self.stats.alive,
                             self.config.live_snapshot_heartbeat_s, self.sandbox_lifecycle)
        await self.model.close()
        await self.provider.close()
        await asyncio.to_thread(self.runner.events.close)

    def sandbox_lifecycle(self) -> dict[str, Any]:
        """Sandbox lifecycle figures: live, leased, reaped, failed deletes (episodes' and the
        reaper's), and whose they are."""
        leases, reaper = self.runner.leases, self.reaper
        return {"incarnation": leases.owner.incarnation, "service_instance": leases.owner.instance,
                "num_alive": len(self.stats.alive), "num_leased": leases.num_leased(),
                "num_reaped": sum(reaper.reaped.values()) if reaper else 0,
                "num_delete_failures": self.stats.delete_failures
                + (reaper.delete_failures if reaper else 0),
                "lease_renew_failures": leases.renew_failures,
                "reaping": bool(self._upkeep)}

    def state(self) -> dict[str, Any]:
        return {
            **self.stats.snapshot(),
            "lifecycle": self.sandbox_lifecycle(),
            "reaper": self.reaper.stats() if self.reaper else {},
            "provider": self.config.provider.type,
            "model_client": self.config.model_client,
            "num_tasks": len(self.tasks),
            "max_concurrent_episodes": self.runner.episodes.limit,
            "max_concurrent_creates": self.runner.creates.limit,
            "creates_in_flight": self.runner.creates.in_use,
            "creates_waiting": self.runner.creates.waiting,
            "provider_stats": self.provider.stats(),
            "harness": self.config.agent.harness,
            "event_loop": running_loop_name(),
            **({"gateway": {"url": self.gateway.base_url("<episode>"),
                            "sessions": len(self.gateway.sessions),
                            **self.gateway.stats.snapshot()}} if self.gateway else {}),
        }

    def on_config_changed(self, keys: list[str]) -> None:
        self.runner.episodes.set_limit(self.config.max_concurrent_episodes)
        self.runner.creates.set_limit(self.config.max_concurrent_creates)

    def admin_routes(self) -> APIRouter:
        router = APIRouter()

        @router.get("/sandboxes")
        async def sandboxes() -> dict[str, Any]:
            return {"sandboxes": [
                {"sandbox_id": h.sandbox_id, "task": h.task_name, "provider": h.provider,
                 "created_at": h.created_at} for h in self.stats.alive.values()]}

        return router

    def task(self, task_id: str) -> Task:
        if task_id not in self.tasks:
            examples = ", ".join(self.tasks.names[:5])
            raise NotFound(f"unknown task {task_id!r}: this sandbox service has "
                           f"{len(self.tasks)} tasks from {self.config.tasks_dir} "
                           f"(e.g. {examples}); ListTasks lists them all")
        return self.tasks.get(task_id)

    async def run_episode(self, request: sandbox_pb2.RunEpisodeRequest
                          ) -> AsyncIterator[sandbox_pb2.EpisodeEvent]:
        """Progress events as they happen, then the trajectory."""
        if self.paused:
            raise Unavailable("the sandbox service is paused; resume it or retry later")
        check_episode_request(request, self.config.agent.max_context_tokens)  # before any sandbox
        task = self.task(request.task_id)
        if request.sample_id in self._running:
            raise Conflict(f"an episode with sample_id {request.sample_id!r} is already running; "
                           "sample ids are router session keys and must be unique")
        if self.script_maker is not None:
            self.scripts[request.sample_id] = self.script_maker(task)
        self._running.add(request.sample_id)
        events: asyncio.Queue[sandbox_pb2.EpisodeProgress | _End] = asyncio.Queue()
        job = asyncio.get_running_loop().create_task(
            self.runner.run(task, request, events.put_nowait))
        self._episodes.add(job)
        job.add_done_callback(lambda done: self._finished(done, request.sample_id, events))
        try:
            while True:
                item = await events.get()
                if isinstance(item, sandbox_pb2.EpisodeProgress):
                    yield sandbox_pb2.EpisodeEvent(progress=item)
                elif isinstance(item, common_pb2.Trajectory):
                    yield sandbox_pb2.EpisodeEvent(trajectory=item)
                    return
                else:
                    raise item
        finally:
            if not job.done():
                job.cancel()  # the caller went away; the runner still deletes the sandbox

    def _finished(self, job: asyncio.Task[common_pb2.Trajectory], sample_id: str,
                  events: asyncio.Queue[sandbox_pb2.EpisodeProgress | _End]) -> None:
        self._episodes.discard(job)
        self._running.discard(sample_id)
        self.scripts.pop(sample_id, None)
        forget = getattr(self.model, "forget", None)
        if forget is not None:
            forget(sample_id)
        if job.cancelled():
            events.put_nowait(asyncio.CancelledError())
        elif job.exception() is not None:
            events.put_nowait(job.exception())  # type: ignore[arg-type]
        else:
            events.put_nowait(job.result())


class SandboxServicer(sandbox_pb2_grpc.SandboxServicer):
    """The Sandbox gRPC API; errors become statuses in the shared handler guard."""

    def __init__(self, service: SandboxService) -> None:
        self.service = service

    async def RunEpisode(self, request: sandbox_pb2.RunEpisodeRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[sandbox_pb2.EpisodeEvent]:
        async for event in self.service.run_episode(request):
            yield event

    async def ListTasks(self, request: sandbox_pb2.ListTasksRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> sandbox_pb2.ListTasksResponse:
        return sandbox_pb2.ListTasksResponse(task_ids=self.service.tasks.names)

    async def GetStatus(self, request: common_pb2.StatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> common_pb2.ServiceStatus:
        return status_message(self.service)
