"""A scripted OpenAI-compatible chat server on loopback, for testing harnesses without a model.

It speaks the part of the OpenAI API that agent harnesses use (`POST /v1/chat/completions`,
plain and streamed, `GET /v1/models`), checks the bearer key and the model name as the agent
gateway does, and answers each call with the next reply of a script (or what a function of
the request returns). Every request is recorded, so a test can check what the harness sent.
It runs in a thread of its own: harnesses that call the model synchronously (from worker
threads) and asynchronously (from the event loop) both reach it.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class StandInError:
    """A reply that is an HTTP error instead: its status and raw body."""

    status: int
    body: bytes


#: A reply: the assistant's text for this request (the request's JSON body is given).
ReplyFn = Callable[[dict[str, Any]], "str | StandInError"]


class OpenAIStandIn:
    """`with OpenAIStandIn(replies, api_key=..., model=...) as server:` then `server.base_url`."""

    def __init__(self, replies: Sequence[str | StandInError] | ReplyFn,
                 api_key: str = "test-key",
                 model: str = "riptide-test-model") -> None:
        self.api_key = api_key
        self.model = model
        self.requests: list[dict[str, Any]] = []
        self.refused: list[tuple[int, str]] = []
        self._script = list(replies) if not callable(replies) else None
        self._reply_fn = replies if callable(replies) else None
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="openai-standin")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}/v1"

    def __enter__(self) -> OpenAIStandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def next_reply(self, request: dict[str, Any]) -> str | StandInError | None:
        """The reply to `request` (None once a script is used up), recording the request."""
        with self._lock:
            self.requests.append(request)
            if self._reply_fn is not None:
                return self._reply_fn(request)
            assert self._script is not None
            return self._script.pop(0) if self._script else None


def _error(status: int, message: str, kind: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


def _completion(model: str, text: str, prompt_chars: int) -> dict[str, Any]:
    usage = {"prompt_tokens": max(1, prompt_chars // 4),
             "completion_tokens": max(1, len(text) // 4)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
        "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                     "message": {"role": "assistant", "content": text}}],
        "usage": usage,
    }


def _chunks(model: str, text: str) -> list[dict[str, Any]]:
    base = {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": model}
    pieces = [text[i:i + 16] for i in range(0, len(text), 16)] or [""]
    chunks = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": p},
                                    "finish_reason": None}]} for p in pieces]
    chunks.append({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return chunks


def _handler_for(server: OpenAIStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
            return

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if self.headers.get("authorization", "") == f"Bearer {server.api_key}":
                return True
            server.refused.append((401, self.path))
            self._send(401, _error(401, "invalid API key for this session",
                                   "authentication_error"))
            return False

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if not self._authorized():
                return
            if self.path.rstrip("/") != "/v1/models":
                self._send(404, _error(404, f"no route {self.path}", "not_found_error"))
                return
            self._send(200, {"object": "list", "data": [
                {"id": server.model, "object": "model", "created": 0, "owned_by": "riptide"}]})

        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            length = int(self.headers.get("content-length", "0"))
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return
            if self.path.rstrip("/") != "/v1/chat/completions":
                self._send(404, _error(404, f"no route {self.path}", "not_found_error"))
                return
            request = json.loads(raw or b"{}")
            if request.get("model") != server.model:
                server.refused.append((404, str(request.get("model"))))
                self._send(404, _error(404, f"model {request.get('model')!r} not served here; "
                                       f"use {server.model!r}", "not_found_error"))
                return
            text = server.next_reply(request)
            if text is None:
                self._send(503, _error(503, "the stand-in's script is used up", "server_error"))
                return
            if isinstance(text, StandInError):
                self.send_response(text.status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(text.body)))
                self.end_headers()
                self.wfile.write(text.body)
                return
            if not request.get("stream"):
                self._send(200, _completion(server.model, text, len(raw)))
                return
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("connection", "close")
            self.end_headers()
            for chunk in _chunks(server.model, text):
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

    return Handler
