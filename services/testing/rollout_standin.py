"""The rollout service's real weight-update coordinator over attached engines, served on gRPC
from a background event loop (no scheduler, router or sandboxes): what a trainer's weight sync
talks to in the trainer's integration tests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import grpc


class _NoRouter:
    """No router: nothing to reconcile, every call is accepted."""

    async def view(self) -> None:
        return None

    async def register(self, url: str) -> None:
        pass

    async def deregister(self, url: str) -> None:
        pass

    async def set_weight_version(self, version: int) -> None:
        pass


class RolloutStandIn:
    """The rollout service's real weight-update coordinator over an attached engine, served
    on gRPC from a background event loop (no scheduler, router or sandboxes)."""

    def __init__(self, engine_url: str) -> None:
        self.committed: list[int] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(engine_url), self.loop).result(60)
        self.address = f"127.0.0.1:{port}"

    async def _start(self, engine_url: str) -> int:
        from services._proto.riptide.v1 import rollout_pb2_grpc
        from services.common.engine_client import EngineClient
        from services.rollout.config import FleetConfig, WeightUpdateConfig
        from services.rollout.fleet import EngineFleet
        from services.rollout.weight_update import WeightUpdateCoordinator

        self.fleet = EngineFleet(
            FleetConfig(kind="attach", attach_urls=[engine_url], health_interval_s=60),
            EngineClient(), _NoRouter(), weight_version=0)
        await self.fleet.start()
        coordinator = WeightUpdateCoordinator(self.fleet, WeightUpdateConfig(),
                                              self.committed.append)

        class Servicer(rollout_pb2_grpc.RolloutServicer):
            async def UpdateWeights(self, request_iterator: Any, context: Any) -> Any:  # noqa: N802
                async for event in coordinator.run(request_iterator):
                    yield event

            async def ReleaseEngineMemory(self, request: Any, context: Any) -> Any:  # noqa: N802
                return await coordinator.release_memory(list(request.tags))

        self.server = grpc.aio.server()
        rollout_pb2_grpc.add_RolloutServicer_to_server(Servicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    async def _stop(self) -> None:
        await self.server.stop(1)
        await self.fleet.stop()
        await self.fleet.client.aclose()

    def __enter__(self) -> RolloutStandIn:
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
