"""The rollout service runtime: wires the fleet, the scheduler and the weight-update coordinator.

Start-up: connect the sample buffer and read the last committed weight version from it (a
restarted rollout service continues the run's numbering; its fresh engines wait for the next
update), bring the engines up and register them (fleet.py), find the task set (config or
Sandbox.ListTasks, retried until the sandbox answers), then start the scheduler, which counts
what already sits in the stream and admits nothing while no engine holds current weights.
Group ids carry a random 128-bit incarnation id, so no two incarnations ever share one.
The gRPC servicer (server.py) hands UpdateWeights streams to the coordinator; the admin
app's pause/resume and live config patches go to the scheduler. In `score` mode there is no
buffer and no scheduler: the engines come up, scoring.py runs one evaluation of the eval task
set, writes its result file and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import Any

import grpc
from fastapi import APIRouter

from services.common.config import EventsConfig, GrpcTlsConfig, RedisConfig
from services.common.engine_client import EngineClient
from services.common.errors import ConfigError, Unavailable
from services.common.events import EventPublisher
from services.common.grpc_client import aio_channel
from services.common.grpc_server import GuardedRegistrar
from services.common.service import ServiceRuntime
from services.rollout import metrics
from services.rollout.config import RolloutConfig
from services.rollout.episodes import GroupSink
from services.rollout.evaluation import EvalQueue, eval_task_ids
from services.rollout.fleet import EngineFleet
from services.rollout.router_link import GrpcRouterLink, NoRouter
from services.rollout.run_events import RolloutEvents
from services.rollout.sandbox_runner import SandboxEpisodeRunner
from services.rollout.scheduler import Scheduler
from services.rollout.sglang_command import fleet_route_shape
from services.rollout.task_sampler import task_sampler
from services.rollout.weight_update import WeightUpdateCoordinator

log = logging.getLogger(__name__)

TUNABLE_FIELDS = frozenset({
    "max_concurrent_samples", "granularity", "max_staleness", "drop_zero_variance_groups",
    "max_queued_groups", "temperature", "top_p", "max_new_tokens",
})


class RolloutRuntime(ServiceRuntime):
    """The rollout service behind the shared gRPC server and admin app."""

    name = "rollout"
    tunable_fields = TUNABLE_FIELDS

    def __init__(self, config: RolloutConfig, redis: RedisConfig, run_name: str,
                 sandbox_address: str, router_address: str, grpc_token: str | None,
                 events: EventsConfig | None = None, engine_api_key: str | None = None,
                 grpc_tls: GrpcTlsConfig | None = None) -> None:
        super().__init__()
        self._tls = grpc_tls
        self.config = config
        self.tunable = config.scheduler
        self._redis, self._run_name, self._token = redis, run_name, grpc_token
        self._sandbox_address, self._router_address = sandbox_address, router_address
        self.engines = EngineClient(config.weight_update.step_timeout_s, api_key=engine_api_key)
        self._router_channel: grpc.aio.Channel | None = None  # made on the serving loop
        self.fleet = EngineFleet(config.fleet, self.engines, NoRouter(),
                                 config.weight_update.initial_weight_version, engine_api_key)
        self.events = RolloutEvents(EventPublisher(redis, run_name, "rollout",
                                                   events or EventsConfig()))
        self.coordinator = WeightUpdateCoordinator(self.fleet, config.weight_update,
                                                   self._on_committed, self.events)
        self.scheduler: Scheduler | None = None
        self.scoring: EvalQueue | None = None  # score mode's one evaluation
        self.buffer: Any = None
        self.buffer_depth: int | None = None
        self._sandbox_channel: grpc.aio.Channel | None = None
        self._background: list[asyncio.Task[None]] = []
        self._stores: set[asyncio.Task[None]] = set()
        self._dashboard_source: Any = None

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        from services._proto.riptide.v1 import rollout_pb2_grpc
        from services.rollout.server import RolloutServicer

        rollout_pb2_grpc.add_RolloutServicer_to_server(RolloutServicer(self), server)

    async def start(self) -> None:
        from services.common.buffer import AsyncSampleBuffer

        scoring = self.config.mode == "score"
        if not scoring:
            self.buffer = await self._connect_buffer(AsyncSampleBuffer)
            stored = await self.buffer.weight_version()
            if stored is not None and stored > self.fleet.current_version:
                log.info("the run is at weight version %d: engines wait for the next update",
                         stored)
                self.fleet.current_version = stored
        self._router_channel = aio_channel(self._router_address, self._token, tls=self._tls)
        self.fleet.router = GrpcRouterLink(self._router_channel)
        await self.fleet.start()
        self._sandbox_channel = aio_channel(self._sandbox_address, self._token, tls=self._tls)
        metrics.install(self.metrics_snapshot)
        if scoring:
            self._background = [asyncio.create_task(self._score())]
            return
        self._background = [asyncio.create_task(self._start_scheduler(self.buffer)),
                            asyncio.create_task(self._watch_buffer())]
        if self.events.publisher.enabled:
            self._background.append(asyncio.create_task(self._publish_load()))
        self._background[0].add_done_callback(self._on_scheduler_start_failed)

    def _on_scheduler_start_failed(self, task: asyncio.Task[None]) -> None:
        """A scheduler that cannot start leaves nothing to serve: exit (2 for a config
        error, which a restart cannot fix; else 1, so the supervisor restarts this one)."""
        exc = None if task.cancelled() else task.exception()
        if exc is not None:
            log.error("the scheduler could not start: %s", exc)
            self.request_exit(2 if isinstance(exc, ConfigError) else 1,
                              f"the scheduler could not start: {exc}")

    async def _score(self) -> None:
        """Score mode: one evaluation at the engines' weights, its result file, exit 0."""
        from services.rollout.scoring import score, write_result

        assert self._sandbox_channel is not None
        cfg = self.config
        try:
            runner = SandboxEpisodeRunner(self._sandbox_channel)
            task_ids = eval_task_ids(cfg.eval, await self._list_tasks(runner), every_task=True)
            self.scoring = EvalQueue(cfg.eval, cfg.scheduler.max_new_tokens,
                                     cfg.scheduler.top_p, task_ids)
            while not any(m.state == "ready" and m.registered for m in self.fleet.members):
                await asyncio.sleep(0.2)  # engines come up; the fleet registers them
            version = self.fleet.current_version
            log.info("scoring %d tasks x %d samples at weight version %d", len(task_ids),
                     cfg.eval.num_samples, version)
            result = await score(self.scoring, version, runner,
                                 cfg.scheduler.max_concurrent_samples)
            result["engines"] = cfg.fleet.model_path or list(cfg.fleet.attach_urls)
            assert cfg.eval.result_path is not None  # the config requires it in score mode
            write_result(cfg.eval.result_path, result)
        except ConfigError as exc:  # the task set does not fit the sandbox's: no restart
            self.request_exit(2, f"scoring cannot start: {exc}")
            return
        except Exception as exc:
            log.exception("scoring failed")
            self.request_exit(1, f"scoring failed: {type(exc).__name__}: {exc}")
            return
        self.request_exit(0, f"scored {result['num_tasks']} tasks: mean success "
                             f"{result['mean_success']:.3f}, written to {cfg.eval.result_path}")

    async def _list_tasks(self, runner: SandboxEpisodeRunner) -> list[str]:
        """The sandbox's tasks, asked until it answers (start order is free)."""
        while True:
            try:
                task_ids = await runner.list_tasks()
            except grpc.aio.AioRpcError as exc:
                log.warning("sandbox not reachable for ListTasks: %s", exc.code().name)
                await asyncio.sleep(1.0)
                continue
            if not task_ids:
                raise Unavailable("the sandbox service lists no tasks")
            return task_ids

    async def _connect_buffer(self, cls: Any) -> Any:
        """The sample buffer, waiting for Redis while it is not up (start order is free)."""
        while True:
            try:
                return await cls.connect(self._redis, self._run_name)
            except Unavailable as exc:
                log.warning("sample buffer not reachable yet: %s", exc)
                await asyncio.sleep(1.0)

    async def _start_scheduler(self, sink: GroupSink) -> None:
        assert self._sandbox_channel is not None
        runner = SandboxEpisodeRunner(self._sandbox_channel)
        ev = self.config.eval
        needs_list = not self.config.task_ids or ev.task_ids or ev.num_tasks
        listed = await self._list_tasks(runner) if needs_list else list(self.config.task_ids)
        task_ids = list(self.config.task_ids) or listed
        held_out = eval_task_ids(self.config.eval, listed)
        task_ids = [t for t in task_ids if t not in set(held_out)]  # never trained on
        if not task_ids:
            raise ConfigError("every task is a held-out eval task (rollout.eval): none is "
                              "left to train on")
        backlog = await self._backlog_groups()
        tasks = task_sampler(self.config.scheduler, task_ids, self.config.task_seed)
        scheduler = Scheduler(self.config.scheduler, tasks,
                              runner, sink, weight_version=self.fleet.current_version,
                              id_prefix=f"{self._run_name}-{secrets.token_hex(16)}",
                              backlog_samples=backlog * self.config.scheduler.n_samples_per_prompt,
                              can_generate=self.fleet.can_generate,
                              evaluation=EvalQueue(self.config.eval,
                                                   self.config.scheduler.max_new_tokens,
                                                   self.config.scheduler.top_p, held_out),
                              events=self.events,
                              route_shape=fleet_route_shape(self.config.fleet))
        if self.paused:
            scheduler.pause()
        await scheduler.start()
        self.scheduler = scheduler
        log.info("scheduler started with %d tasks, %d groups already in the stream",
                 len(task_ids), backlog)

    async def _backlog_groups(self) -> int:
        while True:
            try:
                return int((await self.buffer.stats()).length)
            except Unavailable as exc:
                log.warning("cannot count the stream's backlog yet: %s", exc)
                await asyncio.sleep(1.0)

    async def _watch_buffer(self) -> None:
        while True:
            try:
                self.buffer_depth = (await self.buffer.stats()).length
            except Unavailable:
                self.buffer_depth = None
            if self.scheduler is not None:
                self.scheduler.config_changed()  # re-checks whether an engine can generate
            await asyncio.sleep(1.0)

    async def _publish_load(self, interval_s: float = 1.0) -> None:
        """A `rollout.load` event about every second: the scheduler, the fleet, the router."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                view = await self.fleet.router.view()
            except Unavailable:
                view = None
            in_flight = self.scheduler.in_flight if self.scheduler is not None else 0
            self.events.load(in_flight, self.config.scheduler.max_concurrent_samples,
                             self.fleet.members, view.targets if view is not None else ())

    async def stop(self) -> None:
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.scheduler is not None:
            await self.scheduler.stop()
        await self.fleet.stop()
        await self.engines.aclose()
        if self.buffer is not None:
            await self.buffer.aclose()
        if self._dashboard_source is not None:
            await self._dashboard_source.aclose()
        for channel in (self._sandbox_channel, self._router_channel):
            if channel is not None:
                await channel.close()
        await asyncio.to_thread(self.events.publisher.close)

    def ready(self) -> bool:
        return self.scheduler is not None or self.scoring is not None

    def _on_committed(self, version: int) -> None:
        if self.scheduler is not None:
            self.scheduler.set_weight_version(version)
        task = asyncio.get_running_loop().create_task(self._store_version(version))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _store_version(self, version: int) -> None:
        try:  # a restarted rollout service reads it back (start-up above)
            await self.buffer.set_weight_version(version)
        except Unavailable as exc:
            log.warning("storing weight version %d failed: %s", version, exc)

    async def pause(self) -> None:
        await super().pause()
        if self.scheduler is not None:
            self.scheduler.pause()

    async def resume(self) -> None:
        await super().resume()
        if self.scheduler is not None:
            self.scheduler.resume()

    def on_config_changed(self, keys: list[str]) -> None:
        if self.scheduler is not None:
            self.scheduler.config_changed()

    def page_routes(self) -> APIRouter | None:
        """The run dashboard (/dashboard), reading the run's events streams in Redis."""
        if not self.config.dashboard.enabled:
            return None
        from services.rollout.dashboard.routes import dashboard_router
        from services.rollout.dashboard.source import RedisSource

        source = RedisSource(self._redis, self._run_name, self.config.dashboard.max_events)
        self._dashboard_source = source
        return dashboard_router(source, self.config.dashboard)

    def snapshot(self) -> dict[str, Any]:
        recent = [u for u in self.coordinator.history if "duration_s" in u]
        return {
            "mode": self.config.mode,
            "scheduler": self.scheduler.state() if self.scheduler is not None else None,
            **({"scoring": self.scoring.summary()} if self.scoring is not None else {}),
            "engines": self.fleet.state(),
            "weight_updates": self.coordinator.state(),
            "buffer_depth": self.buffer_depth,
            "weight_version": self.fleet.current_version,
            "needs_weights": self.fleet.needs_weights,
            "router_reregistrations": self.fleet.router_reregistrations,
            "last_update_s": recent[-1]["duration_s"] if recent else None,
        }

    def state(self) -> dict[str, Any]:
        return self.snapshot()

    def metrics_snapshot(self) -> dict[str, Any]:
        """The state plus the histograms /metrics exposes."""
        return {**self.snapshot(), "_update_durations": self.coordinator.durations_s,
                "_latency": self.scheduler.stats.group_latency_s if self.scheduler else None}
