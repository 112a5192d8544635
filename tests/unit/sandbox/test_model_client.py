"""RouterModelClient over real gRPC, against an in-process Router servicer."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common.errors import InvalidRequest
from services.common.tiny_model import build_tokenizer
from services.sandbox.agent import TerminalAgent
from services.sandbox.chat_format import ChatFormat
from services.sandbox.config import AgentConfig
from services.sandbox.model_client import COMPLETE_TURN, RouterModelClient

from .test_agent import HANDLE, FakeProvider

CHAT = ChatFormat(build_tokenizer())


class Router(router_pb2_grpc.RouterServicer):
    """Answers every call with the completion turn; fails the first `failures` calls."""

    def __init__(self, failures: int = 0, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        self.requests: list[router_pb2.GenerateRequest] = []
        self.failures, self.code = failures, code

    async def Generate(self, request: router_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> router_pb2.GenerateResponse:
        self.requests.append(request)
        if self.failures:
            self.failures -= 1
            await context.abort(self.code, "engine busy")
        ids = CHAT.encode(COMPLETE_TURN) + [CHAT.end_of_turn_id]
        return router_pb2.GenerateResponse(output_ids=ids, output_logprobs=[-0.5] * len(ids),
                                           finish_reason="stop", weight_version=7)


async def _serve(router: Router) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(router, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def test_agent_turns_go_through_router_generate() -> None:
    router = Router(failures=1)

    async def run() -> object:
        server, address = await _serve(router)
        client = RouterModelClient(address, timeout_s=5)
        try:
            agent = TerminalAgent(client, CHAT, FakeProvider(), AgentConfig())
            return await agent.run(HANDLE, "task", "sample-42",
                                   common_pb2.SamplingParams(temperature=1.0), 30)
        finally:
            await client.close()
            await server.stop(0)

    run_ = asyncio.run(run())
    assert len(router.requests) == 2  # one UNAVAILABLE, retried
    request = router.requests[-1]
    assert request.session_key == "sample-42" and request.return_logprob
    assert list(request.input_ids) == run_.trace.prompt_ids  # type: ignore[attr-defined]
    assert CHAT.end_of_turn_id in request.sampling_params.stop_token_ids
    assert request.sampling_params.max_new_tokens == AgentConfig().max_new_tokens
    assert set(run_.trace.weight_versions) == {7}  # type: ignore[attr-defined]
    assert set(run_.trace.logprobs) == {-0.5}  # type: ignore[attr-defined]


def test_a_rejected_request_is_not_retried() -> None:
    router = Router(failures=5, code=grpc.StatusCode.INVALID_ARGUMENT)

    async def run() -> None:
        server, address = await _serve(router)
        client = RouterModelClient(address, timeout_s=5)
        try:
            await client.generate("s", [1, 2], common_pb2.SamplingParams(max_new_tokens=4))
        finally:
            await client.close()
            await server.stop(0)

    with pytest.raises(InvalidRequest, match="engine busy"):
        asyncio.run(run())
    assert len(router.requests) == 1
