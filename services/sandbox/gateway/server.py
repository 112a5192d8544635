"""The agent gateway: an OpenAI-compatible endpoint per episode, served by the sandbox service.

Routes, for each live episode (session) and its key (`Authorization: Bearer <key>`):
`POST /sessions/<episode>/v1/chat/completions`, `POST /sessions/<episode>/v1/completions`,
`GET /sessions/<episode>/v1/models`; and `GET /health`. A wrong key, or an episode that is
unknown or has ended, is 401: a key dies with its episode and one episode's key opens no
other. Errors are OpenAI's envelope. Generation goes through the router's Generate with the
episode as session key (sticky, dp-aware), as the built-in agent's turns do.

It lives in the sandbox service because episodes do: the service knows when one starts and
ends, holds its sampling parameters and limits, and turns its tokens into the trajectory. One
event loop (the service's), the lean HTTP/1.1 server of services/common.
"""

from __future__ import annotations

import logging
from typing import Any

import orjson

from services._proto.riptide.v1 import common_pb2
from services.common.errors import Conflict, InvalidRequest, RiptideError
from services.common.http1_server import Http1Server, Reply, Request
from services.sandbox.chat_format import CHATML_TEMPLATE
from services.sandbox.gateway.chat_render import ChatRenderer
from services.sandbox.gateway.openai_shapes import (
    chat_chunks,
    chat_completion,
    completion_chunks,
    error_body,
    text_completion,
)
from services.sandbox.gateway.session import (
    GatewayLimit,
    GatewaySession,
    GatewayStats,
    SessionLimits,
    check_messages,
)
from services.sandbox.gateway.tool_calls import template_has_tool_calls
from services.sandbox.model_client import ModelClient

log = logging.getLogger(__name__)
_PREFIX = "/sessions/"


class AgentGateway:
    """The gateway's HTTP server and its live sessions."""

    def __init__(self, model: ModelClient, tokenizer: Any, model_name: str, host: str,
                 port: int, max_body_bytes: int = 16 << 20, owns_model: bool = False) -> None:
        """`owns_model`: the gateway has a model client of its own, closed with it."""
        self.model = model
        self.owns_model = owns_model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.template = getattr(tokenizer, "chat_template", None) or CHATML_TEMPLATE
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_of_turn_ids = {int(eos)} if eos is not None else set()
        self.parse_tools = template_has_tool_calls(self.template)
        self.stats = GatewayStats()
        self.sessions: dict[str, GatewaySession] = {}
        self.server = Http1Server(self.handle, host, port, max_body_bytes=max_body_bytes)

    async def start(self) -> None:
        await self.server.start()

    async def stop(self) -> None:
        await self.server.stop()
        if self.owns_model:
            await self.model.close()

    def base_url(self, episode_id: str) -> str:
        """The OpenAI base URL of an episode (ends in /v1)."""
        host = self.server.host if self.server.host not in ("0.0.0.0", "::") else "127.0.0.1"
        return f"http://{host}:{self.server.port}{_PREFIX}{episode_id}/v1"

    def open(self, episode_id: str, sampling: common_pb2.SamplingParams,
             limits: SessionLimits, chat_template: str | None = None,
             route_shape: tuple[int, int] | None = None) -> GatewaySession:
        """A session for a starting episode; its key is `session.key`. With `route_shape`
        (MoE layers, top-k) every call asks for the engine's routed experts."""
        if episode_id in self.sessions:
            raise Conflict(f"episode {episode_id!r} already has a gateway session")
        renderer = ChatRenderer(self.tokenizer, chat_template or self.template,
                                self.end_of_turn_ids)
        session = GatewaySession(episode_id, self.model, renderer, sampling, limits,
                                 self.stats, self.parse_tools, route_shape)
        self.sessions[episode_id] = session
        return session

    def close(self, episode_id: str) -> GatewaySession | None:
        """End an episode's session: its key stops working at once, and the router stops
        counting it as live."""
        session = self.sessions.pop(episode_id, None)
        # A client shared with the service is told by the service when the episode ends.
        forget = getattr(self.model, "forget", None) if self.owns_model else None
        if session is not None and session.num_calls and forget is not None:
            forget(episode_id)
        return session

    async def handle(self, request: Request) -> Reply:
        path = request.path.split("?", 1)[0]
        if path == "/health":
            return Reply(200, b"{}")
        if not path.startswith(_PREFIX):
            return _error(404, f"no route {path[:80]!r}", "not_found_error")
        episode_id, _, route = path[len(_PREFIX):].partition("/")
        session = self.sessions.get(episode_id)
        key = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if session is None or not key or not session.authorized(key):
            self.stats.refusal("invalid_api_key")
            return _error(401, "invalid API key for this episode (unknown or ended episode, "
                               "or a wrong key)", "authentication_error", "invalid_api_key")
        try:
            if route == "v1/models" and request.method == "GET":
                return Reply(200, orjson.dumps({"object": "list", "data": [
                    {"id": self.model_name, "object": "model", "created": 0,
                     "owned_by": "riptide"}]}))
            if route == "v1/chat/completions" and request.method == "POST":
                return await self._chat(session, _body(request.body))
            if route == "v1/completions" and request.method == "POST":
                return await self._complete(session, _body(request.body))
        except GatewayLimit as exc:
            return _error(exc.http_status, str(exc), "invalid_request_error", exc.code)
        except InvalidRequest as exc:
            return _error(400, str(exc), "invalid_request_error")
        except RiptideError as exc:
            log.warning("gateway call of %s failed: %s", episode_id, exc)
            return _error(exc.http_status, str(exc), "server_error", type(exc).__name__)
        return _error(404, f"no route {request.method} {route[:80]!r}", "not_found_error")

    async def _chat(self, session: GatewaySession, body: dict[str, Any]) -> Reply:
        _check_common(body)
        messages = check_messages(body.get("messages"))
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequest("'tools' must be an array")
        if body.get("tool_choice") == "none":
            tools = None
        outcome = await session.chat(messages, tools or None, body)
        if body.get("stream"):
            return Reply(200, content_type="text/event-stream",
                         stream=chat_chunks(outcome, self.model_name, _include_usage(body)))
        return Reply(200, chat_completion(outcome, self.model_name))

    async def _complete(self, session: GatewaySession, body: dict[str, Any]) -> Reply:
        _check_common(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompt))):
            raise InvalidRequest("'prompt' must be a string or an array of token ids")
        outcome = await session.complete(prompt, body)
        if body.get("stream"):
            return Reply(200, content_type="text/event-stream",
                         stream=completion_chunks(outcome, self.model_name,
                                                  _include_usage(body)))
        return Reply(200, text_completion(outcome, self.model_name))


def _error(status: int, message: str, kind: str, code: str | None = None) -> Reply:
    return Reply(status, error_body(message, kind, code))


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    return body


def _check_common(body: dict[str, Any]) -> None:
    n = body.get("n", 1)
    if n not in (1, None):
        raise InvalidRequest("'n' must be 1: an episode is one sequence of calls")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise InvalidRequest(f"'{name}' must be a positive integer")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and len(stop) <= 16 and all(isinstance(s, str) for s in stop)):
        raise InvalidRequest("'stop' must be a string or an array of at most 16 strings")


def _include_usage(body: dict[str, Any]) -> bool:
    options = body.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))
