"""A ModelClient that calls one engine's SGLang-native `/generate` directly, without a router.

For `riptide eval`, which scores tasks against a single engine it started itself; training
episodes go through the router (model_client.RouterModelClient) instead.
"""

from __future__ import annotations

import httpx

from services._proto.riptide.v1 import common_pb2
from services.common.engine_contract import bearer
from services.common.errors import Unavailable
from services.common.routed_experts import decode_sglang_routes
from services.common.sampling_params import sampling_params
from services.sandbox.model_client import GenerateResult


class EngineModelClient:
    """`POST {url}/generate` with the episode's token ids; log-probs requested."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None) -> None:
        self._client = httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                         headers=bearer(api_key))

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        body = {"input_ids": input_ids, "sampling_params": sampling_params(sampling),
                "return_logprob": True, "rid": session_key}
        if routed_experts_start is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routed_experts_start)
        try:
            resp = await self._client.post("/generate", json=body)
        except httpx.HTTPError as exc:
            raise Unavailable(f"engine /generate failed: {exc}") from None
        if resp.status_code != 200:
            raise Unavailable(f"engine /generate answered {resp.status_code}: {resp.text[:300]}")
        reply = resp.json()
        meta = reply.get("meta_info") or {}
        finish = meta.get("finish_reason")
        reason = str(finish.get("type", "")) if isinstance(finish, dict) else str(finish or "")
        ids = [int(t) for t in reply.get("output_ids") or []]
        logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
        version = str(meta.get("weight_version", ""))  # SGLang starts at "default"
        routes = meta.get("routed_experts")
        return GenerateResult(ids, logprobs, reason, int(version) if version.isdigit() else 0,
                              routed_experts=decode_sglang_routes(routes) if routes else b"")

    async def close(self) -> None:
        await self._client.aclose()
