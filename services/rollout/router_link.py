"""The rollout service's calls to the router: engine registration and the weight version."""

from __future__ import annotations

from typing import Protocol

import grpc

from services._proto.riptide.v1 import router_pb2, router_pb2_grpc
from services.common.errors import Unavailable


class RouterLink(Protocol):
    """What the fleet and the coordinator tell the router."""

    async def register(self, url: str) -> None: ...

    async def deregister(self, url: str) -> None: ...

    async def set_weight_version(self, version: int) -> None: ...


class GrpcRouterLink:
    """RouterLink over the Router gRPC service."""

    def __init__(self, channel: grpc.aio.Channel, timeout_s: float = 30.0) -> None:
        self._stub = router_pb2_grpc.RouterStub(channel)
        self._timeout_s = timeout_s

    async def _call(self, what: str, rpc: object, request: object) -> None:
        try:
            await rpc(request, timeout=self._timeout_s)  # type: ignore[operator]
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"router {what} failed: {exc.code().name}: {exc.details()}") from None

    async def register(self, url: str) -> None:
        await self._call(f"RegisterEngine({url})", self._stub.RegisterEngine,
                         router_pb2.RegisterEngineRequest(url=url))

    async def deregister(self, url: str) -> None:
        await self._call(f"DeregisterEngine({url})", self._stub.DeregisterEngine,
                         router_pb2.DeregisterEngineRequest(url=url, drain=False))

    async def set_weight_version(self, version: int) -> None:
        await self._call(f"SetWeightVersion({version})", self._stub.SetWeightVersion,
                         router_pb2.SetWeightVersionRequest(weight_version=version))


class NoRouter:
    """A RouterLink for fleets without a router (benches, single-engine tests)."""

    async def register(self, url: str) -> None:
        return None

    async def deregister(self, url: str) -> None:
        return None

    async def set_weight_version(self, version: int) -> None:
        return None
