"""The router's extra admin routes (mounted under /admin/, behind the admin token)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from services.router.server import RouterRuntime


class DrainRequest(BaseModel):
    """Drain (or undrain) one target, or every dp rank of an engine."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="engine url as registered")
    dp_rank: int | None = Field(None, ge=0, description="one dp rank; unset: all of them")
    drain: bool = Field(True, description="false takes new sessions again")


class EngineRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(description="engine url, http://host:port")
    drain: bool = Field(True, description="deregister: finish in-flight calls first")


def admin_routes(runtime: RouterRuntime) -> APIRouter:
    """GET /admin/targets, POST /admin/drain, POST /admin/engines[/deregister]."""
    routes = APIRouter()

    @routes.get("/targets")
    async def targets() -> dict[str, Any]:
        return {"weight_version": runtime.registry.weight_version,
                "targets": runtime.router.state()["targets"]}

    @routes.post("/drain")
    async def drain(request: DrainRequest) -> dict[str, Any]:
        changed = runtime.registry.set_drain(request.url, request.dp_rank, request.drain)
        return {"targets": [t.id for t in changed], "draining": request.drain}

    @routes.post("/engines")
    async def register(request: EngineRequest) -> dict[str, Any]:
        return {"url": request.url, "dp_ranks": await runtime.register_engine(request.url)}

    @routes.post("/engines/deregister")
    async def deregister(request: EngineRequest) -> dict[str, Any]:
        await runtime.deregister_engine(request.url, request.drain)
        return {"url": request.url, "deregistered": True}

    return routes
