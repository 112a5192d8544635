"""The router's calls to an engine's `/generate`, plain and streamed, on the lean pooled
HTTP/1.1 client (http1_client.py).

This is the router's hot path, so it is not the shared httpx client (services/common/
engine_client.py, which keeps every control and fact call): httpx's own layers cost most of
the router's per-call CPU (bench/router.py's overhead bench measures the whole per-call cost,
against sglang-router in the same run).

Failures are classified for the router's retries: `EngineNotReached` when the engine
certainly never started generating (no connection, or 503), so the call may go elsewhere;
`EngineCallFailed` for any other failure after the request was sent, never retried;
`InvalidRequest` for the engine's 400/422 and `DeadlineExceeded` when no byte came for
`timeout_s`. A streamed call counts as reached once the engine answered 200.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, NoReturn

import orjson

from services.common.engine_contract import bearer, error_message
from services.common.errors import DeadlineExceeded, InvalidRequest
from services.common.http1_client import ConnectionBroke, Http1Client, NotConnected, Response

# Below the keep-alive timeout of SGLang's uvicorn (5 s), so a pooled connection is rarely
# reused just as the engine closes it (and such a request is sent again, see http1_client).
_KEEPALIVE_S = 4.0


class EngineNotReached(Exception):
    """The call never reached generation on the engine; safe to retry on another target."""


class EngineCallFailed(Exception):
    """The call failed after the engine may have started generating; not retried."""


class EngineStream:
    """An engine's 200 answer to a streamed /generate: its lines as sent, then close()."""

    def __init__(self, url: str, response: Response) -> None:
        self.url = url
        self._response = response

    async def lines(self) -> AsyncIterator[bytes]:
        """Each line without its newline (SSE's blank separator lines included)."""
        pending = b""
        try:
            async for chunk in self._response.chunks():
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.rstrip(b"\r")
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{self.url}: streamed /generate timed out") from exc
        except ConnectionBroke as exc:
            raise EngineCallFailed(f"{self.url}: stream broke: {exc}") from exc
        if pending:
            yield pending

    async def close(self) -> None:
        self._response.release()


class EngineCalls:
    """/generate to any engine; the engines' key (SGLang's --api-key) on every call."""

    def __init__(self, *, timeout_s: float, connect_timeout_s: float, max_connections: int,
                 api_key: str | None = None) -> None:
        self._http = Http1Client(connect_timeout_s=connect_timeout_s, read_timeout_s=timeout_s,
                                 max_connections=max_connections, keepalive_s=_KEEPALIVE_S,
                                 headers=bearer(api_key))

    async def close(self) -> None:
        await self._http.close()

    async def _post(self, url: str, body: dict[str, Any], what: str) -> Response:
        try:
            return await self._http.post(url, "/generate", orjson.dumps(body))
        except NotConnected as exc:
            raise EngineNotReached(f"{url}: {exc}") from exc
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{url}: {what} timed out") from exc
        except ConnectionBroke as exc:
            raise EngineCallFailed(f"{url}: {what} failed: {exc}") from exc

    async def generate(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /generate; the engine's answer, or a classified error."""
        response = await self._post(url, body, "/generate")
        try:
            raw = await response.read()
        except TimeoutError as exc:
            raise DeadlineExceeded(f"{url}: /generate timed out") from exc
        except ConnectionBroke as exc:
            raise EngineCallFailed(f"{url}: /generate broke: {exc}") from exc
        finally:
            response.release()
        data = _json(raw)
        if response.status == 200 and isinstance(data, dict) and "error" not in data:
            return data
        _raise_for(url, "/generate", response.status, error_message(data, str(data)[:500]))

    async def stream(self, url: str, body: dict[str, Any]) -> EngineStream:
        """POST /generate with `stream`; read `lines()`, then `close()`."""
        response = await self._post(url, body, "streamed /generate")
        if response.status == 200:
            return EngineStream(url, response)
        try:
            detail = (await response.read())[:500].decode(errors="replace")
        except (ConnectionBroke, TimeoutError):
            detail = "(no body)"
        finally:
            response.release()
        _raise_for(url, "streamed /generate", response.status, detail)


def _json(raw: bytes) -> Any:
    if not raw:
        return {}
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw[:500].decode(errors="replace")


def _raise_for(url: str, what: str, status: int, message: str) -> NoReturn:
    if status == 503:
        raise EngineNotReached(f"{url}: 503 {message}")
    if status in (400, 422):
        raise InvalidRequest(f"engine rejected the request: {message}")
    raise EngineCallFailed(f"{url}: {what} answered {status}: {message}")
