"""`riptide dashboard`: the run dashboard of a finished (or running) run, on its own.

Serves the same page and API as the rollout service's admin app, from a saved export
(`--events FILE`) or the run's streams in Redis (`--redis URL --run NAME`), behind a fresh
admin token that only the printed URL's fragment carries.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Callable

from fastapi import APIRouter

from services.common.admin import build_admin_app
from services.common.serve import listen_socket
from services.common.service import ServiceRuntime
from services.rollout.dashboard.config import DashboardConfig, dashboard_url
from services.rollout.dashboard.routes import dashboard_router
from services.rollout.dashboard.source import EventSource


class DashboardRuntime(ServiceRuntime):
    """A service whose only work is the dashboard over one event source."""

    name = "dashboard"

    def __init__(self, source: EventSource, config: DashboardConfig) -> None:
        super().__init__()
        self.source, self.config = source, config

    def page_routes(self) -> APIRouter | None:
        return dashboard_router(self.source, self.config)

    def state(self) -> dict[str, object]:
        return {"live": self.source.live}

    async def stop(self) -> None:
        await self.source.aclose()


async def serve_dashboard(source: EventSource, config: DashboardConfig, host: str, port: int,
                          say: Callable[[str], None] = print) -> None:
    """Serve until cancelled (Ctrl-C), printing the URL once listening."""
    import uvicorn

    token = secrets.token_urlsafe(24)
    sock = listen_socket(host, port)
    runtime = DashboardRuntime(source, config)
    server = uvicorn.Server(uvicorn.Config(build_admin_app(runtime, token), log_level="warning",
                                           access_log=False, lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    say(f"[dashboard] {dashboard_url(host, sock.getsockname()[1], token)}")
    try:
        await task
    finally:
        with contextlib.suppress(Exception):
            await runtime.stop()
