"""The dashboard's HTTP routes: the page and its assets at /dashboard, JSON at /dashboard/api.

The page itself holds no data and is served openly; everything under /dashboard/api needs
the admin bearer token (checked by AdminGuard before a route runs). The page reads the token
from the URL fragment (`#token=...`, which browsers never send) and sends it as a header.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from services.common.bounds import check_id
from services.common.errors import NotFound, quote
from services.rollout.dashboard.config import DashboardConfig
from services.rollout.dashboard.samples import sample_view
from services.rollout.dashboard.source import EventSource
from services.rollout.dashboard.summary import summary

ASSETS = {"dashboard.js": "text/javascript", "charts.js": "text/javascript",
          "dashboard.css": "text/css"}


def _asset(name: str) -> bytes:
    return resources.files("services.rollout.dashboard").joinpath("static", name).read_bytes()


def dashboard_router(source: EventSource, config: DashboardConfig) -> APIRouter:
    """Routes of the page and its API over one event source."""
    router = APIRouter()
    lock = asyncio.Lock()  # one refresh at a time; the record is not shared across threads

    @router.get("/dashboard", include_in_schema=False)
    async def page() -> Response:
        return Response(_asset("index.html"), media_type="text/html",
                        headers={"Cache-Control": "no-store"})

    @router.get("/dashboard/static/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in ASSETS:
            raise NotFound(f"no dashboard asset {quote(name, 40)}")
        return Response(_asset(name), media_type=ASSETS[name])

    @router.get("/dashboard/api/summary")
    async def api_summary() -> dict[str, Any]:
        """Every panel and the advisories, computed from the run's events now."""
        async with lock:
            record = await source.refresh()
            # Off the event loop: the rollout service's scheduler shares it.
            body = await asyncio.to_thread(summary, record, config, source.live)
        body["follows"] = source.follows
        return body

    @router.get("/dashboard/api/samples/{sample_id}")
    async def api_sample(sample_id: str) -> dict[str, Any]:
        """One sample's turns, commands, observations, reward and tokens."""
        check_id("sample_id", sample_id, required=True)
        episode = await source.episode(sample_id)
        if episode is None:
            raise NotFound(f"no episode detail kept for sample {quote(sample_id, 80)}")
        return sample_view(episode)

    return router
