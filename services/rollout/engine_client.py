"""The control calls the rollout service makes to an engine over SGLang's native HTTP API."""

from __future__ import annotations

from typing import Any

import httpx

from services.common.errors import Unavailable


class EngineCallError(Unavailable):
    """An engine control call failed; the message names the engine and the step."""

    def __init__(self, url: str, step: str, detail: str) -> None:
        super().__init__(f"engine {url}: {step} failed: {detail}")
        self.url, self.step = url, step


class EngineClient:
    """SGLang control endpoints of the engines, over one pooled async HTTP client."""

    def __init__(self, timeout_s: float = 600.0) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> Any:
        step = path.lstrip("/")
        kwargs: dict[str, Any] = {"json": body} if body is not None else {}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            reply = await self._http.request(method, f"{url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise EngineCallError(url, step, f"{type(exc).__name__}: {exc}") from None
        try:
            data = reply.json() if reply.content else {}
        except ValueError:
            data = {"text": reply.text[:300]}
        if reply.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            message = data.get("message", data) if isinstance(data, dict) else data
            raise EngineCallError(url, step, f"HTTP {reply.status_code}: {message}")
        return data

    async def healthy(self, url: str) -> bool:
        try:
            reply = await self._http.get(f"{url}/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def server_info(self, url: str) -> dict[str, Any]:
        return dict(await self._call("GET", url, "/get_server_info"))

    async def load(self, url: str) -> list[dict[str, Any]]:
        data = await self._call("GET", url, "/get_load", timeout_s=5.0)
        return list(data) if isinstance(data, list) else [data]

    async def weight_version(self, url: str) -> str:
        return str((await self._call("GET", url, "/get_weight_version"))["weight_version"])

    async def pause(self, url: str, mode: str) -> None:
        await self._call("POST", url, "/pause_generation", {"mode": mode})

    async def resume(self, url: str) -> None:
        await self._call("POST", url, "/continue_generation", {})

    async def init_group(self, url: str, *, master_address: str, master_port: int,
                         rank_offset: int, world_size: int, group_name: str,
                         backend: str) -> None:
        await self._call("POST", url, "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})

    async def destroy_group(self, url: str, group_name: str) -> None:
        await self._call("POST", url, "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights(self, url: str, *, names: list[str], dtypes: list[str],
                             shapes: list[list[int]], group_name: str) -> None:
        await self._call("POST", url, "/update_weights_from_distributed", {
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "flush_cache": True, "abort_all_requests": False})

    async def set_weight_version(self, url: str, version: int) -> None:
        await self._call("POST", url, "/update_weight_version",
                         {"new_version": str(version), "abort_all_requests": False})
