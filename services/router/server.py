"""The router service: builds the runtime that `riptide serve router` runs.

Owns the engine client, registry, health checker, router and the SGLang-compatible HTTP front
(`http_port`); the gRPC servicer, the front and the admin routes call into it. Live tuning
(`PATCH /admin/config`) changes RouterConfig in place; a new `policy` takes effect on the
next call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter

from services.common.config import HttpTlsConfig
from services.common.engine_client import EngineClient
from services.common.errors import Unavailable
from services.common.event_loop import running_loop_name
from services.common.grpc_server import GuardedRegistrar
from services.common.service import ServiceRuntime
from services.router import metrics
from services.router.config import TUNABLE_FIELDS, RouterConfig
from services.router.engine_calls import EngineCalls
from services.router.health import HealthChecker
from services.router.registry import EngineRegistry
from services.router.router import RoutedReply, Router

log = logging.getLogger(__name__)


class RouterRuntime(ServiceRuntime):
    """The router's behaviour behind the shared gRPC server and admin app."""

    name = "router"
    tunable_fields = TUNABLE_FIELDS

    def __init__(self, config: RouterConfig, engine_api_key: str | None = None,
                 http_tls: HttpTlsConfig | None = None) -> None:
        super().__init__()
        self.config = config
        self.tunable = config
        self.client = EngineClient(timeout_s=config.generate_timeout_s,
                                   connect_timeout_s=config.connect_timeout_s,
                                   max_connections=config.max_connections,
                                   api_key=engine_api_key)
        self.registry = EngineRegistry(self.client, config.initial_weight_version,
                                       probe_timeout_s=config.health_timeout_s)
        self.health = HealthChecker(self.registry, config)
        self.calls = EngineCalls(timeout_s=config.generate_timeout_s,
                                 connect_timeout_s=config.connect_timeout_s,
                                 max_connections=config.max_connections, api_key=engine_api_key)
        self.router = Router(config, self.registry, self.health, self.calls)
        self._started = False
        self._background: list[asyncio.Task[None]] = []
        self.front: Any = None
        self.engine_api_key = engine_api_key
        self.http_tls = http_tls  # the HTTP front's TLS (run.http_tls)

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        from services._proto.riptide.v1 import router_pb2_grpc
        from services.router.servicer import RouterServicer

        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self), server)

    async def start(self) -> None:
        for url in self.config.engine_urls:
            try:
                await self.registry.register(url)
            except Unavailable as exc:  # it may still be starting: keep trying in background
                log.warning("configured engine not reachable yet", extra={"error": str(exc)})
                self._background.append(asyncio.create_task(self._register_later(url)))
        self.health.start()
        if self.config.http_port is not None:
            from services.common.tls import server_context
            from services.router.http_front import HttpFront

            self.front = HttpFront(self, self.config.listen_host, self.config.http_port,
                                   api_key=self.engine_api_key,
                                   ssl_context=server_context(self.http_tls)
                                   if self.http_tls else None)  # fmt: skip
            await self.front.start()
        self._started = True

    async def _register_later(self, url: str) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.registry.register(url)
                return
            except Unavailable:
                continue

    async def stop(self) -> None:
        if self.front is not None:
            await self.front.stop()
        for task in self._background:
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.health.stop()
        await self.calls.close()
        await self.client.close()

    def ready(self) -> bool:
        return self._started

    async def generate(self, session_key: str, body: dict[str, Any]) -> RoutedReply:
        if self.paused:
            raise Unavailable("router is paused")
        return await self.router.generate(session_key, body)

    def stream(self, session_key: str, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if self.paused:
            raise Unavailable("router is paused")
        return self.router.stream(session_key, body)

    def end_session(self, session_key: str) -> bool:
        return self.router.end_session(session_key)

    async def register_engine(self, url: str) -> list[int]:
        engine = await self.registry.register(url)
        return [t.dp_rank for t in engine.targets]

    async def deregister_engine(self, url: str, drain: bool) -> None:
        targets = self.registry.find(url, None)
        await self.registry.deregister(url, drain, self.config.drain_timeout_s)
        for target in targets:
            metrics.forget(target)

    async def set_weight_version(self, version: int) -> None:
        """Engines become routable only once they report `version`; re-read them now."""
        self.registry.weight_version = version
        self.registry.notify()
        await self.health.refresh_versions()
        log.info("weight version set", extra={"weight_version": version})

    def on_config_changed(self, keys: list[str]) -> None:
        if "policy" in keys:
            self.router.set_policy(self.config.policy)
        elif "num_virtual_nodes" in keys:
            self.router.refresh_targets()

    def state(self) -> dict[str, Any]:
        state = self.router.state()
        state["event_loop"] = running_loop_name()
        if self.front is not None:
            state["http_port"] = self.front.port
        return state

    def admin_routes(self) -> APIRouter | None:
        from services.router.admin import admin_routes

        return admin_routes(self)


def build_runtime(deployment_config: Any) -> RouterRuntime:
    """The router runtime for the deployment's [router] section."""
    return RouterRuntime(deployment_config.router, deployment_config.run.engine_api_key,
                         deployment_config.run.http_tls)
