"""The engine's HTTP key, as SGLang's `--api-key`: every request but the health probes and
CORS preflights must carry `Authorization: Bearer <key>`, else 401 `{"error": "Unauthorized"}`.

SGLang exempts `/health*` (so a load balancer's probe needs no secret) and `/metrics` (so a
Prometheus scrape needs none); so does the built-in engine. The key is compared in constant
time and checked from the headers alone, before any body is read.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

_OPEN_PREFIXES = ("/health", "/metrics")


class ApiKeyGuard:
    """ASGI middleware that refuses a request without the engine's bearer key."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._open(scope):
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
            return
        await self.app(scope, receive, send)

    @staticmethod
    def _open(scope: Scope) -> bool:
        path = str(scope.get("path", ""))
        return scope.get("method") == "OPTIONS" or path.startswith(_OPEN_PREFIXES)
