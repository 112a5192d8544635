"""The rollout service's calls to the router: engine registration and the weight version."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from services._proto.riptide.v1 import router_pb2, router_pb2_grpc
from services.common.errors import Unavailable


@dataclass(frozen=True)
class RouterView:
    """What the router holds now: its engines' URLs and the weight version it requires."""

    engine_urls: frozenset[str]
    weight_version: int | None
    #: Each target (engine, dp rank) as the router's GetStatus shows it: health, circuit,
    #: in-flight calls, prompt and cached tokens of the calls it routed there.
    targets: tuple[dict[str, Any], ...] = ()


class RouterLink(Protocol):
    """What the fleet and the coordinator tell the router (and ask it)."""

    async def view(self) -> RouterView | None: ...

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

    async def view(self) -> RouterView | None:
        """The router's engines and version (a restarted router holds none)."""
        import json

        from google.protobuf import json_format

        from services._proto.riptide.v1 import common_pb2

        try:
            status = await self._stub.GetStatus(common_pb2.StatusRequest(),
                                                timeout=self._timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"router GetStatus failed: {exc.code().name}") from None
        details = json.loads(json_format.MessageToJson(status.details))
        urls = frozenset(str(t.get("engine_url", "")).rstrip("/")
                         for t in details.get("targets") or [] if not t.get("leaving"))
        version = details.get("weight_version")
        return RouterView(urls, int(version) if version is not None else None,
                          tuple(details.get("targets") or ()))

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

    async def view(self) -> RouterView | None:
        return None

    async def register(self, url: str) -> None:
        return None

    async def deregister(self, url: str) -> None:
        return None

    async def set_weight_version(self, version: int) -> None:
        return None
