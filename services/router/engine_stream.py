"""Streaming /generate to an engine: the SSE lines pass through as the engine sends them.

Classified like the router's non-streaming calls: `EngineNotReached` until the engine has
answered 200 (retried elsewhere), `EngineCallFailed` once generation may have started.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from services.common.engine_client import EngineCallFailed, EngineNotReached
from services.common.errors import DeadlineExceeded, InvalidRequest

_JSON = {"content-type": "application/json"}


async def open_stream(http: httpx.AsyncClient, url: str, body: dict[str, Any]
                      ) -> httpx.Response:
    """POST /generate with `stream`; the caller reads `aiter_lines()` and closes it."""
    request = http.build_request("POST", f"{url}/generate", content=orjson.dumps(body),
                                 headers=_JSON)
    try:
        response = await http.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise EngineNotReached(f"{url}: cannot connect ({type(exc).__name__})") from exc
    except httpx.TimeoutException as exc:
        raise DeadlineExceeded(f"{url}: streamed /generate timed out") from exc
    except httpx.HTTPError as exc:
        raise EngineCallFailed(f"{url}: streamed /generate failed: {exc!r}") from exc
    if response.status_code == 200:
        return response
    detail = (await response.aread())[:500].decode(errors="replace")
    await response.aclose()
    if response.status_code == 503:
        raise EngineNotReached(f"{url}: 503 {detail}")
    if response.status_code in (400, 422):
        raise InvalidRequest(f"engine rejected the request: {detail}")
    raise EngineCallFailed(f"{url}: streamed /generate answered {response.status_code}: "
                           f"{detail}")
