"""A ModelClient over SGLang's native `/generate`: one engine, or the router's HTTP front.

`riptide eval` scores tasks against a single engine it started itself (no router). The agent
gateway calls the router's SGLang-compatible HTTP front where the deployment serves one: the
same routing as `Router.Generate` (the episode as routing key, sticky and dp-aware, the session
ended with `/end_session`), at less cost per call than gRPC. Training episodes of the built-in
agent go through `Router.Generate` (model_client.RouterModelClient).
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from operator import itemgetter

import orjson

from services._proto.riptide.v1 import common_pb2
from services.common.engine_contract import bearer, weight_version_spans
from services.common.errors import InvalidRequest, RiptideError, Unavailable
from services.common.http1_client import ConnectionBroke, Http1Client, NotConnected
from services.common.routed_experts import decode_sglang_routes
from services.common.sampling_params import sampling_params
from services.sandbox.model_client import GenerateResult

log = logging.getLogger(__name__)
_CACHED_SAMPLINGS = 256


class EngineModelClient:
    """`POST {url}/generate` with the episode's token ids; log-probs requested. `routed`: the
    URL is the router's HTTP front, which takes the session key as `routing_key`."""

    def __init__(self, url: str, timeout_s: float = 600.0, api_key: str | None = None,
                 routed: bool = False, num_retries: int = 3, max_connections: int = 512,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.url = url.rstrip("/")
        self.routed = routed
        self._num_retries = num_retries
        self._client = Http1Client(connect_timeout_s=5.0, read_timeout_s=timeout_s,
                                   max_connections=max_connections, headers=bearer(api_key),
                                   ssl_context=ssl_context)
        self._endings: set[asyncio.Task[None]] = set()
        # An episode's calls differ in their sampling parameters by max_new_tokens and stop
        # strings at most: their JSON form is made once per distinct value.
        self._samplings: dict[bytes, dict[str, object]] = {}

    async def generate(self, session_key: str, input_ids: list[int],
                       sampling: common_pb2.SamplingParams,
                       routed_experts_start: int | None = None) -> GenerateResult:
        body: dict[str, object] = {
            "input_ids": input_ids, "sampling_params": self._sampling_params(sampling),
            "return_logprob": True, "rid": f"{session_key}-{os.urandom(4).hex()}"}
        if routed_experts_start is not None:
            body.update(return_routed_experts=True, routed_experts_start_len=routed_experts_start)
        if self.routed:
            body["routing_key"] = session_key
        payload = orjson.dumps(body)
        for attempt in range(self._num_retries + 1):
            status, raw = await self._post("/generate", payload)
            if status == 200:
                return _result(orjson.loads(raw), len(input_ids))
            if status in (429, 502, 503) and attempt < self._num_retries:
                await asyncio.sleep(0.5 * 2**attempt)
                continue
            message = f"{'router' if self.routed else 'engine'} /generate answered {status}: " \
                      f"{raw[:300].decode(errors='replace')}"
            raise InvalidRequest(message) if status == 400 else Unavailable(message)
        raise Unavailable("unreachable")  # the loop returns or raises

    def _sampling_params(self, sampling: common_pb2.SamplingParams) -> dict[str, object]:
        key = sampling.SerializeToString()
        params = self._samplings.get(key)
        if params is None:
            params = sampling_params(sampling)
            if len(self._samplings) >= _CACHED_SAMPLINGS:
                self._samplings.clear()
            self._samplings[key] = params
        return params

    async def _post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        try:
            response = await self._client.post(self.url, path, payload)
            try:
                return response.status, await response.read()
            finally:
                response.release()
        except (NotConnected, ConnectionBroke, TimeoutError) as exc:
            raise Unavailable(f"{self.url}{path} failed: {type(exc).__name__}: {exc}") from None

    def forget(self, session_key: str) -> None:
        """The episode ended: the router's front stops counting it as live (in the background;
        the router also expires idle sessions)."""
        if not self.routed:
            return
        task = asyncio.get_running_loop().create_task(self._end_session(session_key))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    async def _end_session(self, session_key: str) -> None:
        try:
            await self._post("/end_session", orjson.dumps({"session_key": session_key}))
        except RiptideError as exc:
            log.warning("end_session failed; the router expires the session when idle",
                        extra={"session_key": session_key, "error": str(exc)})

    async def close(self) -> None:
        await asyncio.gather(*self._endings, return_exceptions=True)
        await self._client.close()


def _result(reply: dict[str, object], num_prompt: int) -> GenerateResult:
    meta = reply.get("meta_info") or {}
    assert isinstance(meta, dict)
    finish = meta.get("finish_reason")
    reason = str(finish.get("type", "")) if isinstance(finish, dict) else str(finish or "")
    # map() keeps these per-token conversions in C: a reply has hundreds of tokens.
    ids = list(map(int, reply.get("output_ids") or []))  # type: ignore[call-overload]
    logprobs = list(map(float, map(itemgetter(0), meta.get("output_token_logprobs") or [])))
    version = _version(meta.get("weight_version"))
    routes = meta.get("routed_experts")
    return GenerateResult(ids, logprobs, reason, version, _token_versions(meta, len(ids)),
                          prompt_tokens=int(meta.get("prompt_tokens") or num_prompt),
                          cached_tokens=int(meta.get("cached_tokens") or 0),
                          routed_experts=decode_sglang_routes(str(routes)) if routes else b"")


def _token_versions(meta: dict[str, object], num_tokens: int) -> list[int]:
    """Each output token's weight version, each distinct version parsed once (a reply has one
    or two, over hundreds of tokens)."""
    spans = weight_version_spans(meta, num_tokens)
    distinct = set(spans)
    if len(distinct) == 1:
        return [_version(spans[0])] * num_tokens
    parsed = {text: _version(text) for text in distinct}
    return list(map(parsed.__getitem__, spans))


def _version(value: object) -> int:
    text = str(value if value is not None else "")
    return int(text) if text.isdigit() else 0  # SGLang starts at "default"
