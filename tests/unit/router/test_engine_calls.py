"""The router's /generate client against a real loopback HTTP server: SGLang's recorded error
shapes classified for retries, the engines' key, streamed lines passed as sent (split anywhere
by the network, longer than aiohttp's line limit), and a stream that breaks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from services.common.errors import InvalidRequest
from services.common.ports import free_port
from services.router.engine_calls import EngineCallFailed, EngineCalls, EngineNotReached

FIXTURES = json.loads(
    (Path(__file__).parents[1] / "common" / "fixtures" / "sglang_0_5_23.json").read_text())
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def _serve(handler: Handler) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/generate", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


def _calls(api_key: str | None = None) -> EngineCalls:
    return EngineCalls(timeout_s=10, connect_timeout_s=2, max_connections=8, api_key=api_key)


async def _with_engine(handler: Handler, go: Callable[[EngineCalls, str], Awaitable[Any]],
                       api_key: str | None = None) -> Any:
    runner, url = await _serve(handler)
    calls = _calls(api_key)
    try:
        return await go(calls, url)
    finally:
        await calls.close()
        await runner.cleanup()


@pytest.mark.parametrize("name,raised,text", [
    ("context", InvalidRequest, "Requested token count exceeds"),
    ("duplicate_rid", InvalidRequest, "Duplicate request ID"),
    ("schema", InvalidRequest, "valid list"),
    ("starting", EngineNotReached, "503"),
    ("internal", EngineCallFailed, "illegal memory access"),
])
@pytest.mark.parametrize("streamed", [False, True])
def test_sglang_errors_are_classified(name: str, raised: type, text: str,
                                      streamed: bool) -> None:
    status, body = FIXTURES["errors"][name]

    async def answer(request: web.Request) -> web.Response:
        return web.json_response(body, status=status)

    async def go(calls: EngineCalls, url: str) -> None:
        if streamed:
            await calls.stream(url, {"input_ids": [1], "stream": True})
        else:
            await calls.generate(url, {"input_ids": [1]})

    with pytest.raises(raised, match=text):
        asyncio.run(_with_engine(answer, go))


def test_no_engine_listening_is_not_reached() -> None:
    async def go() -> None:
        calls = _calls()
        try:
            await calls.generate(f"http://127.0.0.1:{free_port()}", {"input_ids": [1]})
        finally:
            await calls.close()

    with pytest.raises(EngineNotReached, match="cannot connect"):
        asyncio.run(go())


def test_the_body_and_the_engines_key_reach_the_engine() -> None:
    seen: list[tuple[str | None, Any]] = []

    async def answer(request: web.Request) -> web.Response:
        seen.append((request.headers.get("authorization"), await request.json()))
        return web.json_response({"output_ids": [7], "meta_info": {"prompt_tokens": 1}})

    async def go(calls: EngineCalls, url: str) -> Any:
        return await calls.generate(url, {"input_ids": [1], "lora_path": "a"})

    reply = asyncio.run(_with_engine(answer, go, api_key="k1"))
    assert reply["output_ids"] == [7]
    assert seen == [("Bearer k1", {"input_ids": [1], "lora_path": "a"})]
    seen.clear()
    asyncio.run(_with_engine(answer, go))
    assert seen[0][0] is None


def _sse(chunks: list[bytes], then_break: bool = False) -> Handler:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await response.write(chunk)
            await asyncio.sleep(0.01)  # each write its own TCP segment
        if then_break:
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response

    return answer


async def _read(calls: EngineCalls, url: str) -> list[bytes]:
    stream = await calls.stream(url, {"input_ids": [1], "stream": True})
    try:
        return [line async for line in stream.lines()]
    finally:
        await stream.close()


def test_streamed_lines_pass_as_sent_wherever_the_network_splits_them() -> None:
    long = b"data: " + json.dumps({"text": "x" * 300_000}).encode()
    sent = b"data: {\"a\": 1}\n\ndata: {\"b\": 2}\r\n\r\n" + long + b"\n\ndata: [DONE]\n\n"
    chunks = [sent[i:i + 7000] for i in range(0, len(sent), 7000)]
    lines = asyncio.run(_with_engine(_sse(chunks), _read))
    assert lines == [b'data: {"a": 1}', b"", b'data: {"b": 2}', b"", long, b"",
                     b"data: [DONE]", b""]


def test_a_stream_that_breaks_after_it_started_is_not_retried() -> None:
    async def go(calls: EngineCalls, url: str) -> list[bytes]:
        return await _read(calls, url)

    handler = _sse([b"data: {\"a\": 1}\n\n", b"data: {\"b\""], then_break=True)
    with pytest.raises(EngineCallFailed, match="stream broke"):
        asyncio.run(_with_engine(handler, go))
