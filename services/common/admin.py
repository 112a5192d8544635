"""The admin REST app every service serves: health, readiness, metrics, state and tuning.

Every route under /admin/ (and a page's API, /dashboard/api/) sits behind the bearer token,
checked (with the body size cap and strict JSON) by AdminGuard before anything else runs
(services/common/admin_guard.py).
Every error, whatever raised it, is answered in one envelope: {"error": {"type", "message"}}.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from services.common import metrics
from services.common.admin_guard import AdminGuard, error_body
from services.common.errors import RiptideError, Unauthenticated, quote
from services.common.service import ServiceRuntime

log = logging.getLogger(__name__)


def build_admin_app(runtime: ServiceRuntime, admin_token: str,
                    max_body_bytes: int = 1 << 20) -> AdminGuard:
    """The ASGI app with /healthz, /readyz, /metrics and the token-guarded /admin/ routes."""
    app = FastAPI(title=f"riptide {runtime.name} admin", docs_url=None, redoc_url=None)

    @app.exception_handler(RiptideError)
    async def riptide_error(request: Request, exc: RiptideError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthenticated) else None
        return JSONResponse(error_body(type(exc).__name__, quote(str(exc), 2000)),
                            status_code=exc.http_status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(quote(p, 40) for p in e['loc'])}: {quote(e['msg'], 200)}"
            for e in exc.errors()[:5])
        return JSONResponse(error_body("InvalidRequest", problems), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        kind = {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code, "HTTPError")
        return JSONResponse(error_body(kind, quote(exc.detail, 200)),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error in admin route %s", request.url.path)
        return JSONResponse(error_body("InternalError", f"{type(exc).__name__}: "
                                        f"{quote(str(exc), 200)}"), status_code=500)

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

    @app.get("/admin/state")
    async def state() -> dict[str, Any]:
        return runtime.status()

    @app.post("/admin/pause")
    async def pause() -> dict[str, Any]:
        await runtime.pause()
        return runtime.status()

    @app.post("/admin/resume")
    async def resume() -> dict[str, Any]:
        await runtime.resume()
        return runtime.status()

    @app.patch("/admin/config")
    async def patch_config(patch: dict[str, Any]) -> dict[str, Any]:
        return {"config": runtime.apply_config_patch(patch)}

    extra = runtime.admin_routes()
    if extra is not None:
        app.include_router(extra, prefix="/admin")
    pages = runtime.page_routes()
    if pages is not None:
        app.include_router(pages)
    return AdminGuard(app, admin_token, max_body_bytes)
