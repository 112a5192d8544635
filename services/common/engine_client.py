"""The one HTTP client to SGLang engines (and the built-in engine) for control and facts, for
the rollout service and the router. (The router's /generate calls, its hot path, have their
own client: services/router/engine_calls.py.)

It learns at registration which contract an engine speaks (engine_contract.py) and reads the
weight version, the load and the server facts the same way for both services. A control
call that fails raises `EngineCallError` naming the engine and the step.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import orjson

from services.common.engine_contract import (
    MODEL_INFO,
    OLD_WEIGHT_VERSION,
    EngineContract,
    EngineLoad,
    RouteName,
    bearer,
    error_message,
    parse_loads,
    sglang_version_of,
    weight_version_of,
)
from services.common.errors import Unavailable

log = logging.getLogger(__name__)
_JSON = {"content-type": "application/json"}
_NOT_SERVED = (404, 405)  # statuses of a route the engine does not have


class EngineCallError(Unavailable):
    """An engine control call failed; the message names the engine and the step."""

    def __init__(self, url: str, step: str, detail: str, status: int | None = None) -> None:
        super().__init__(f"engine {url}: {step} failed: {detail}")
        self.url, self.step, self.status = url, step, status


def _body(response: httpx.Response) -> Any:
    if not response.content:
        return {}
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return response.text[:500]


class EngineClient:
    """One pooled httpx.AsyncClient for every call to every engine."""

    def __init__(self, timeout_s: float = 600.0, connect_timeout_s: float = 5.0,
                 max_connections: int = 100,
                 transport: httpx.AsyncBaseTransport | None = None,
                 api_key: str | None = None) -> None:
        # The engines' key (SGLang's --api-key) on every call, generation and control alike.
        self.http = httpx.AsyncClient(
            transport=transport, headers=bearer(api_key),
            limits=httpx.Limits(max_connections=max_connections,
                                max_keepalive_connections=max_connections),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s))
        self.contracts: dict[str, EngineContract] = {}

    async def close(self) -> None:
        await self.http.aclose()

    aclose = close

    # -- plumbing ----------------------------------------------------------------------
    async def _call(self, method: str, url: str, path: str, body: dict[str, Any] | None = None,
                    timeout_s: float | None = None) -> Any:
        step = path.lstrip("/")
        kwargs: dict[str, Any] = {"json": body} if body is not None else {}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            reply = await self.http.request(method, f"{url}{path}", **kwargs)
        except httpx.HTTPError as exc:
            raise EngineCallError(url, step, f"{type(exc).__name__}: {exc}") from None
        data = _body(reply)
        if reply.status_code != 200 or (isinstance(data, dict) and data.get("success") is False):
            raise EngineCallError(url, step, f"HTTP {reply.status_code}: {error_message(data)}",
                                  reply.status_code)
        return data

    async def _first(self, url: str, paths: tuple[str, ...],
                     timeout_s: float | None) -> tuple[str, Any]:
        """GET the first of `paths` the engine serves (404/405 means: try the next)."""
        for path in paths:
            try:
                return path, await self._call("GET", url, path, timeout_s=timeout_s)
            except EngineCallError as exc:
                if exc.status not in _NOT_SERVED:
                    raise
        raise EngineCallError(url, paths[0].lstrip("/"),
                              f"the engine serves none of {', '.join(paths)}", 404)

    # -- the contract ------------------------------------------------------------------
    async def detect(self, url: str, timeout_s: float | None = None) -> EngineContract:
        """Learn (again) which routes `url` serves: current first, deprecated as fallback."""
        return (await self._detect(url, timeout_s))[0]

    async def _detect(self, url: str, timeout_s: float | None) -> tuple[EngineContract, Any]:
        path, _ = await self._first(url, MODEL_INFO, timeout_s)
        contract = EngineContract.of("current" if path == MODEL_INFO[0] else "deprecated")
        info = await self._call("GET", url, contract.server_info_path, timeout_s=timeout_s)
        contract = EngineContract.of(contract.mode, sglang_version_of(info))
        known = self.contracts.get(url)
        if known is None or (known.mode, known.sglang_version) != (contract.mode,
                                                                   contract.sglang_version):
            log.info("engine %s speaks the %s SGLang contract (version %s)", url,
                     contract.mode, contract.sglang_version or "unknown")
        self.contracts[url] = contract
        return contract, info

    async def contract(self, url: str, timeout_s: float | None = None) -> EngineContract:
        known = self.contracts.get(url)
        return known if known is not None else await self.detect(url, timeout_s)

    # -- facts -------------------------------------------------------------------------
    async def healthy(self, url: str, timeout_s: float = 5.0) -> bool:
        try:
            reply = await self.http.get(f"{url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return reply.status_code == 200

    async def server_info(self, url: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Server args, scheduler facts and `version`; (re)learns the contract, as at
        registration."""
        _, info = await self._detect(url, timeout_s)
        return dict(info) if isinstance(info, dict) else {}

    async def _read(self, url: str, route: RouteName, timeout_s: float | None) -> Any:
        """GET the path the engine serves for `route`. A 404 on the path in use means the
        engine changed (a restart as another version): learn its contract again, then try
        the route's paths in order and keep the one that answers (each route falls back on
        its own: current info routes do not promise /v1/loads)."""
        contract = await self.contract(url, timeout_s)
        try:
            return await self._call("GET", url, getattr(contract, route), timeout_s=timeout_s)
        except EngineCallError as exc:
            if exc.status not in _NOT_SERVED:
                raise
        contract = await self.detect(url, timeout_s)
        path, body = await self._first(url, contract.candidates(route), timeout_s)
        if path != getattr(contract, route):
            log.info("engine %s serves %s on %s", url, route.removesuffix("_path"), path)
            self.contracts[url] = contract.serving(route, path)
        return body

    async def model_info(self, url: str, timeout_s: float | None = None) -> dict[str, Any]:
        info = await self._read(url, "model_info_path", timeout_s)
        return dict(info) if isinstance(info, dict) else {}

    async def weight_version(self, url: str, timeout_s: float | None = None) -> str:
        """The engine's weight version (model info; `/get_weight_version` on the oldest)."""
        version = weight_version_of(await self.model_info(url, timeout_s))
        if version is None:
            version = weight_version_of(await self._call("GET", url, OLD_WEIGHT_VERSION,
                                                         timeout_s=timeout_s))
        if version is None:
            raise EngineCallError(url, "weight_version", "the engine reports no weight version")
        return version

    async def load(self, url: str, timeout_s: float | None = 5.0) -> list[EngineLoad]:
        """The load of every dp rank."""
        return parse_loads(await self._read(url, "load_path", timeout_s))

    # -- generation --------------------------------------------------------------------
    async def abort(self, url: str, rid: str | None = None) -> None:
        """Abort one request by rid, or every request when `rid` is None."""
        body = {"abort_all": True} if rid is None else {"rid": rid}
        await self._call("POST", url, "/abort_request", body)

    # -- control -----------------------------------------------------------------------
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

    async def update_weights_from_tensor(self, url: str, payload: str) -> None:
        """Colocated mode: load tensors the caller shares (SGLang's IPC payload)."""
        await self._call("POST", url, "/update_weights_from_tensor", {
            "serialized_named_tensors": [payload], "flush_cache": True,
            "abort_all_requests": False})

    async def memory_occupation(self, url: str, action: str, tags: list[str] | None) -> int:
        """`action` release or resume: SGLang's /{action}_memory_occupation of `tags`; the
        bytes freed when the engine says (the built-in engine does, SGLang does not)."""
        body = await self._call("POST", url, f"/{action}_memory_occupation", {"tags": tags})
        return int(body.get("freed_bytes", 0)) if isinstance(body, dict) else 0

    async def set_weight_version(self, url: str, version: int) -> None:
        # 0.5.23 aborts every request unless told otherwise; the fleet is paused here and its
        # requests must survive the bump.
        await self._call("POST", url, "/update_weight_version",
                         {"new_version": str(version), "abort_all_requests": False})
