"""The router's SGLang-compatible HTTP front: what a client of sglang-router talks to.

`POST /generate` takes SGLang's native body (`text` or `input_ids`, `stream`, and every other
field, which goes to the engine untouched; the router only adds `routed_dp_rank` for a
DP-attention engine). The session (routing) key comes from the `X-SMG-Routing-Key` header
(sglang-router's manual policy), else `X-Session-ID`, else the body's `routing_key`. A
streamed call answers SSE `data: ...` lines exactly as the engine sends them. `/health`,
`/get_server_info`, `/get_model_info` and `/v1/models` answer from a routable engine.
`POST /end_session {"session_key": ...}` is the HTTP twin of the gRPC EndSession.
With `run.engine_api_key` set, every route but `/health*` wants `Authorization: Bearer
<key>`, as sglang-router's `--api-key` (the same key it sends its workers) and SGLang itself
do, else 401 `{"error": "Unauthorized"}`: the front spends the engines that key guards.

Served by the lean HTTP/1.1 server (services/common/http1_server.py) on the router's own event loop;
started and stopped by RouterRuntime.
"""

from __future__ import annotations

import hmac
import logging
import ssl
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from services.common.bounds import check_id
from services.common.errors import InvalidRequest, RiptideError, Unavailable
from services.common.http1_server import Handler, Http1Server, Reply, Request
from services.router.servicer import json_object

if TYPE_CHECKING:
    from services.router.server import RouterRuntime

log = logging.getLogger(__name__)
_KEY_HEADERS = ("x-smg-routing-key", "x-session-id")


def _json(payload: Any, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(payload))


def _error(exc: RiptideError) -> Reply:
    # SGLang's error shape, so its clients read the message where they expect it.
    return _json({"object": "error", "message": str(exc), "type": type(exc).__name__,
                  "code": exc.http_status}, exc.http_status)


def routing_key(headers: Any, body: dict[str, Any]) -> str:
    """The session key of a call: header, then header, then the body's `routing_key`
    (InvalidRequest when longer than an id may be)."""
    key = next((headers[name] for name in _KEY_HEADERS if headers.get(name)),
               body.get("routing_key"))
    key = str(key) if key else ""
    check_id("session key", key)
    return key


def _body(request: Request) -> dict[str, Any]:
    body = json_object(request.body, "the body")
    if body.get("text") is None and body.get("input_ids") is None:
        raise InvalidRequest("give text or input_ids")
    return body


def build_front(runtime: RouterRuntime, api_key: str | None = None) -> Handler:
    """The front's request handler: SGLang's routes, by method and path (behind `api_key`
    where one is given)."""
    expected = f"Bearer {api_key}".encode() if api_key else None

    async def generate(request: Request) -> Reply:
        try:
            body = _body(request)
            key = routing_key(request.headers, body)
            if not body.get("stream"):
                routed = await runtime.generate(key, body)
                return _json(routed.body)
            lines = runtime.stream(key, body)
            first = await anext(lines)  # routing errors still get their status code
        except RiptideError as exc:
            return _error(exc)
        return Reply(200, content_type="text/event-stream", stream=_chain(first, lines))

    async def end_session(request: Request) -> Reply:
        try:
            key = json_object(request.body, "the body").get("session_key")
            if not key or not isinstance(key, str):
                raise InvalidRequest('give {"session_key": "..."}')
            check_id("session_key", key)
        except RiptideError as exc:
            return _error(exc)
        return _json({"known": runtime.end_session(str(key))})

    async def health(request: Request) -> Reply:
        return Reply(200 if runtime.router.candidates(set()) else 503)

    async def engine_info(request: Request) -> Reply:
        try:
            return _json(await _from_engine(runtime, request.path))
        except RiptideError as exc:
            return _error(exc)

    async def models(request: Request) -> Reply:
        try:
            info = await _from_engine(runtime, "/get_model_info")
        except RiptideError as exc:
            return _error(exc)
        name = info.get("served_model_name") or info.get("model_path") or "default"
        return _json({"object": "list", "data": [
            {"id": name, "object": "model", "created": 0, "owned_by": "riptide",
             "root": info.get("model_path")}]})

    routes: dict[str, tuple[str, Handler]] = {
        "/generate": ("POST", generate), "/end_session": ("POST", end_session),
        "/health": ("GET", health), "/health_generate": ("GET", health),
        "/get_server_info": ("GET", engine_info), "/get_model_info": ("GET", engine_info),
        "/server_info": ("GET", engine_info), "/model_info": ("GET", engine_info),
        "/v1/models": ("GET", models),
    }

    async def handle(request: Request) -> Reply:
        if expected is not None and not request.path.startswith("/health") and not \
                hmac.compare_digest(request.headers.get("authorization", "").encode(), expected):
            return _json({"error": "Unauthorized"}, 401)
        route = routes.get(request.path)
        if route is None:
            return _json({"detail": "Not Found"}, 404)
        if request.method != route[0]:
            return _json({"detail": "Method Not Allowed"}, 405)
        return await route[1](request)

    return handle


async def _chain(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield first
    try:
        async for line in rest:
            yield line
    except RiptideError as exc:  # the status line is sent: the error travels in-stream
        yield b"data: " + orjson.dumps({"error": {"message": str(exc)}}) + b"\n\n"


async def _from_engine(runtime: RouterRuntime, path: str) -> dict[str, Any]:
    """Server or model info from the first routable engine, by the contract it speaks."""
    client, timeout = runtime.client, runtime.config.health_timeout_s
    for target in runtime.router.candidates(set()):
        url = target.engine.url
        try:
            if "server_info" in path:
                return await client.server_info(url, timeout)
            return await client.model_info(url, timeout)
        except (httpx.HTTPError, ValueError, RiptideError):
            continue
    raise Unavailable(f"no routable engine answered {path}")


class HttpFront:
    """The front's server, on the router's event loop."""

    def __init__(self, runtime: RouterRuntime, host: str, port: int,
                 api_key: str | None = None, ssl_context: ssl.SSLContext | None = None) -> None:
        self.server = Http1Server(build_front(runtime, api_key), host, port,
                                  idle_timeout_s=600.0, ssl_context=ssl_context)  # fmt: skip
        self.port = port

    async def start(self) -> None:
        await self.server.start()
        self.port = self.server.port
        log.info("HTTP front serving", extra={"http_port": self.port})

    async def stop(self) -> None:
        await self.server.stop()
