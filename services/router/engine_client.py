"""The router's pooled HTTP client to engines, and how engine failures are classified.

A failure is `EngineNotReached` when the engine certainly never started generating (no
connection, or 503 before generation): the router may retry it elsewhere. Any other failure
after the request was sent is `EngineCallFailed` and is never retried.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from services.common.errors import DeadlineExceeded, InvalidRequest

_JSON = {"content-type": "application/json"}


class EngineNotReached(Exception):
    """The call never reached generation on the engine; safe to retry on another target."""


class EngineCallFailed(Exception):
    """The call failed after the engine may have started generating; not retried."""


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message", body))
        return str(body.get("message", body))
    return str(body)[:500]


class EngineClient:
    """One httpx.AsyncClient shared by every call to every engine."""

    def __init__(self, connect_timeout_s: float, generate_timeout_s: float,
                 max_connections: int) -> None:
        self.generate_timeout = httpx.Timeout(generate_timeout_s, connect=connect_timeout_s)
        self.http = httpx.AsyncClient(
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            timeout=self.generate_timeout,
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def generate(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST /generate; returns the SGLang response or raises a classified error."""
        try:
            response = await self.http.post(f"{url}/generate", content=orjson.dumps(body),
                                            headers=_JSON)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
            raise EngineNotReached(f"{url}: cannot connect ({type(exc).__name__})") from exc
        except httpx.TimeoutException as exc:
            raise DeadlineExceeded(f"{url}: /generate timed out ({type(exc).__name__})") from exc
        except httpx.HTTPError as exc:
            raise EngineCallFailed(f"{url}: /generate failed: {type(exc).__name__}: {exc}") \
                from exc
        if response.status_code == 200:
            return dict(orjson.loads(response.content))
        if response.status_code == 503:
            raise EngineNotReached(f"{url}: 503 {_message(response)}")
        if response.status_code in (400, 422):
            raise InvalidRequest(f"engine rejected the request: {_message(response)}")
        raise EngineCallFailed(f"{url}: /generate answered {response.status_code}: "
                               f"{_message(response)}")

    async def get_json(self, url: str, path: str, timeout_s: float) -> Any:
        """GET a control endpoint; raises httpx.HTTPError on any failure."""
        response = await self.http.get(f"{url}{path}", timeout=timeout_s)
        response.raise_for_status()
        return response.json()

    async def healthy(self, url: str, timeout_s: float) -> bool:
        try:
            response = await self.http.get(f"{url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def weight_version(self, url: str, timeout_s: float) -> str | None:
        """The engine's weight version (/get_weight_version, else /get_model_info)."""
        for path in ("/get_weight_version", "/get_model_info"):
            try:
                body = await self.get_json(url, path, timeout_s)
            except httpx.HTTPError:
                continue
            if isinstance(body, dict) and body.get("weight_version") is not None:
                return str(body["weight_version"])
            if isinstance(body, str):
                return body
        return None

    async def load(self, url: str, timeout_s: float) -> dict[int, int]:
        """Tokens per dp rank from /get_load ({} when the engine does not report it)."""
        try:
            body = await self.get_json(url, "/get_load", timeout_s)
        except (httpx.HTTPError, ValueError):
            return {}
        if isinstance(body, dict):
            body = [body]
        return {int(item.get("dp_rank", 0)): int(item.get("num_tokens", 0))
                for item in body if isinstance(item, dict)}
