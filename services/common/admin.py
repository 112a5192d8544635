"""The admin REST app every service serves: health, readiness, metrics, state and tuning."""

from __future__ import annotations

import hmac
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from services.common import metrics
from services.common.errors import RiptideError, Unauthenticated
from services.common.service import ServiceRuntime


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"type": kind, "message": message}}


def build_admin_app(runtime: ServiceRuntime, admin_token: str) -> FastAPI:
    """FastAPI app with /healthz, /readyz, /metrics and the token-guarded /admin/ routes."""
    app = FastAPI(title=f"riptide {runtime.name} admin", docs_url=None, redoc_url=None)
    expected = f"Bearer {admin_token}".encode()

    def require_token(request: Request) -> None:
        sent = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(sent, expected):
            raise Unauthenticated("missing or wrong bearer token for /admin/")

    @app.exception_handler(RiptideError)
    async def riptide_error(request: Request, exc: RiptideError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
        return JSONResponse(_error_body(type(exc).__name__, str(exc)),
                            status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse(_error_body("InvalidRequest", problems), status_code=400)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "service": runtime.name}

    @app.get("/readyz")
    async def readyz() -> JSONResponse:
        ready = runtime.ready()
        return JSONResponse({"ready": ready, "service": runtime.name},
                            status_code=200 if ready else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    guard = [Depends(require_token)]

    @app.get("/admin/state", dependencies=guard)
    async def state() -> dict[str, Any]:
        return runtime.status()

    @app.post("/admin/pause", dependencies=guard)
    async def pause() -> dict[str, Any]:
        await runtime.pause()
        return runtime.status()

    @app.post("/admin/resume", dependencies=guard)
    async def resume() -> dict[str, Any]:
        await runtime.resume()
        return runtime.status()

    @app.patch("/admin/config", dependencies=guard)
    async def patch_config(patch: dict[str, Any]) -> dict[str, Any]:
        return {"config": runtime.apply_config_patch(patch)}

    extra = runtime.admin_routes()
    if extra is not None:
        app.include_router(extra, prefix="/admin", dependencies=guard)
    return app
