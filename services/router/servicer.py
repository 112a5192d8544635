"""The Router gRPC servicer: protobuf in, SGLang /generate body out, and back.

Errors are RiptideError subclasses; the shared gRPC handler guard maps them to status codes.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import grpc
import orjson

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.bounds import MAX_SGLANG_FIELDS_CHARS, check_id, check_prompt_tokens
from services.common.engine_contract import weight_version_spans
from services.common.errors import InvalidRequest
from services.common.grpc_requests import require
from services.common.sampling_params import sampling_params
from services.common.service import status_message

if TYPE_CHECKING:
    from services.router.server import RouterRuntime


def json_object(raw: str | bytes, what: str) -> dict[str, Any]:
    """`raw` parsed as a JSON object, or InvalidRequest naming `what`."""
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"{what} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{what} must be a JSON object")
    return value


def sglang_fields(text: str) -> dict[str, Any]:
    """The pass-through fields of `sglang_fields_json` (a JSON object, or empty)."""
    if not text:
        return {}
    require(len(text) <= MAX_SGLANG_FIELDS_CHARS,
            f"sglang_fields_json: at most {MAX_SGLANG_FIELDS_CHARS} characters, got {len(text)}")
    fields = json_object(text, "sglang_fields_json")
    if "stream" in fields or "input_ids" in fields or "text" in fields:
        raise InvalidRequest("sglang_fields_json may not set stream, input_ids or text "
                             "(Generate takes input_ids and answers once)")
    extra = fields.get("sampling_params", {})
    if not isinstance(extra, dict):
        raise InvalidRequest("sglang_fields_json.sampling_params must be a JSON object")
    return fields


def generate_body(request: router_pb2.GenerateRequest,
                  max_input_tokens: int | None = None) -> dict[str, Any]:
    """The SGLang /generate body of a Generate request; InvalidRequest for what no engine
    should see (checked cheapest first: a huge prompt is refused before its ids are read)."""
    check_id("session_key", request.session_key)
    check_id("request_id", request.request_id)
    if not request.input_ids:
        raise InvalidRequest("input_ids is empty")
    check_prompt_tokens(len(request.input_ids), max_input_tokens)
    require(min(request.input_ids) >= 0, "input_ids: token ids are never negative")
    fields = sglang_fields(request.sglang_fields_json)
    params = sampling_params(request.sampling_params)
    params.update(fields.pop("sampling_params", {}))
    return {
        "return_logprob": request.return_logprob,
        "rid": request.request_id or uuid.uuid4().hex,
        **fields,
        "input_ids": list(request.input_ids),
        "sampling_params": params,
    }


def _finish_reason(meta: dict[str, Any]) -> str:
    finish = meta.get("finish_reason")
    if isinstance(finish, dict):
        return str(finish.get("type", ""))
    return str(finish or "")


def _weight_version(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Router RPCs over a RouterRuntime."""

    def __init__(self, runtime: RouterRuntime) -> None:
        self.runtime = runtime

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> router_pb2.GenerateResponse:
        body = generate_body(request, self.runtime.registry.max_input_tokens())
        routed = await self.runtime.generate(request.session_key, body)
        reply, meta = routed.body, routed.body.get("meta_info") or {}
        output_ids = list(reply.get("output_ids") or [])
        logprobs = [float(item[0]) for item in meta.get("output_token_logprobs") or []]
        return router_pb2.GenerateResponse(
            output_ids=output_ids, output_logprobs=logprobs,
            finish_reason=_finish_reason(meta),
            prompt_tokens=int(meta.get("prompt_tokens") or len(request.input_ids)),
            cached_tokens=int(meta.get("cached_tokens") or 0),
            weight_version=_weight_version(meta.get("weight_version")),
            engine_url=routed.target.engine.url, dp_rank=routed.target.dp_rank,
            engine_latency_s=routed.engine_latency_s,
            output_weight_versions=[_weight_version(v)
                                    for v in weight_version_spans(meta, len(output_ids))],
        )

    async def RegisterEngine(self, request: router_pb2.RegisterEngineRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext
                             ) -> router_pb2.RegisterEngineResponse:
        ranks = await self.runtime.register_engine(request.url)
        return router_pb2.RegisterEngineResponse(dp_ranks=ranks)

    async def DeregisterEngine(self, request: router_pb2.DeregisterEngineRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext
                               ) -> router_pb2.DeregisterEngineResponse:
        await self.runtime.deregister_engine(request.url, request.drain)
        return router_pb2.DeregisterEngineResponse()

    async def SetWeightVersion(self, request: router_pb2.SetWeightVersionRequest,  # noqa: N802
                               context: grpc.aio.ServicerContext
                               ) -> router_pb2.SetWeightVersionResponse:
        require(request.weight_version >= 0, "weight_version: must be 0 or more")
        await self.runtime.set_weight_version(request.weight_version)
        return router_pb2.SetWeightVersionResponse()

    async def GetStatus(self, request: common_pb2.StatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> common_pb2.ServiceStatus:
        return status_message(self.runtime)

    async def EndSession(self, request: router_pb2.EndSessionRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> router_pb2.EndSessionResponse:
        check_id("session_key", request.session_key, required=True)
        return router_pb2.EndSessionResponse(known=self.runtime.end_session(request.session_key))
