"""What the admin REST app checks before a route runs: the token, the body's size and JSON.

A pure ASGI middleware in front of the app (services/common/admin.py), so it acts on the
headers alone: a request under /admin/ (or /dashboard/api/) without the bearer token is
refused with 401 before one byte of its body is read, and no body grows past
`max_body_bytes` in memory (413, from Content-Length when sent, else while reading). A JSON
body must parse strictly: no NaN or Infinity, nesting bounded. Every refusal uses the
project's error envelope.
"""

from __future__ import annotations

import hmac
import json
import math
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from services.common.errors import (
    InvalidRequest,
    PayloadTooLarge,
    RiptideError,
    Unauthenticated,
    quote,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MAX_JSON_DEPTH = 32
#: Paths that need the token: the admin routes and the dashboard's data (its page is open).
GUARDED_PREFIXES = ("/admin", "/dashboard/api")


def error_body(kind: str, message: str) -> dict[str, Any]:
    """The one error envelope of every admin response that is not a success."""
    return {"error": {"type": kind, "message": message}}


def strict_json(body: bytes) -> Any:
    """Parse a request body as JSON: NaN and Infinity are refused, nesting is bounded."""

    def no_constant(name: str) -> Any:
        raise InvalidRequest(f"body: {name} is not a JSON number; send a finite number")

    def finite(text: str) -> float:
        number = float(text)
        if not math.isfinite(number):
            raise InvalidRequest(f"body: {quote(text, 40)} is beyond the range of a float")
        return number

    try:
        value = json.loads(body, parse_constant=no_constant, parse_float=finite)
    except RecursionError:
        raise InvalidRequest(f"body: nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise InvalidRequest(f"body: not valid JSON ({reason})") from None
    if _depth(value) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"body: nested deeper than {MAX_JSON_DEPTH} levels")
    return value


def _depth(value: Any) -> int:
    depth, level = 0, [value]
    while level:
        depth += 1
        nested: list[Any] = []
        for item in level:
            if isinstance(item, dict):
                nested.extend(item.values())
            elif isinstance(item, list):
                nested.extend(item)
        level = nested
    return depth - 1


class AdminGuard:
    """ASGI middleware: token first, then a capped body, then strict JSON."""

    def __init__(self, app: ASGIApp, admin_token: str, max_body_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {admin_token}".encode()
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            body = await self._checked_body(scope, receive)
        except RiptideError as exc:
            await _refuse(send, exc)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _checked_body(self, scope: Scope, receive: Receive) -> bytes:
        headers = dict(scope["headers"])
        path = scope["path"]
        if any(path == p or path.startswith(p + "/") for p in GUARDED_PREFIXES):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected):
                raise Unauthenticated("missing or wrong bearer token for /admin/")
        length = headers.get(b"content-length", b"0")
        if not length.isdigit():
            raise InvalidRequest("Content-Length is not a number")
        if int(length) > self.max_body_bytes:
            raise PayloadTooLarge(f"body of {int(length)} bytes; at most "
                                  f"{self.max_body_bytes} are accepted")
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise PayloadTooLarge(f"body over {self.max_body_bytes} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip()
        if body and content_type in (b"application/json", b""):
            strict_json(body)
        return body


async def _refuse(send: Send, exc: RiptideError) -> None:
    payload = json.dumps(error_body(type(exc).__name__, str(exc))).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
    if isinstance(exc, Unauthenticated):
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": exc.http_status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
