"""The router front's lean HTTP/1.1 server, spoken to by a real client (httpx) and by raw
sockets for what clients rarely send: keep-alive, pipelining, chunked request bodies,
`Expect: 100-continue`, streamed answers, HTTP/1.0, and the refusals (400, 413, 431)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson

from services.common.http1_server import Http1Server, Reply, Request


async def _echo(request: Request) -> Reply:
    if request.path == "/stream":
        async def parts() -> AsyncIterator[bytes]:
            for i in range(3):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0)
        return Reply(200, content_type="text/event-stream", stream=parts())
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    return Reply(200, orjson.dumps({"method": request.method, "path": request.path,
                                    "key": request.headers.get("x-smg-routing-key"),
                                    "body": request.body.decode()}))


def _with_server(go: Callable[[int], Awaitable[Any]], **kw: Any) -> Any:
    async def main() -> Any:
        server = Http1Server(_echo, "127.0.0.1", 0, **kw)
        await server.start()
        try:
            return await go(server.port)
        finally:
            await server.stop()

    return asyncio.run(main())


async def _raw(port: int, data: bytes, until: bytes = b"", timeout_s: float = 5.0) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    out = b""
    try:
        while until not in out or not until:
            chunk = await asyncio.wait_for(reader.read(65536), timeout_s)
            if not chunk:
                break
            out += chunk
    finally:
        writer.close()
    return out


def test_a_real_client_keeps_one_connection_for_many_calls() -> None:
    async def go(port: int) -> list[Any]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            replies = [await http.post("/generate", content=b'{"a": 1}',
                                       headers={"X-SMG-Routing-Key": "s1"}) for _ in range(3)]
            streamed = await http.post("/stream")
        return [r.json() for r in replies] + [streamed.text, streamed.headers]

    *replies, text, headers = _with_server(go)
    assert replies == [{"method": "POST", "path": "/generate", "key": "s1",
                        "body": '{"a": 1}'}] * 3
    assert text == "data: 0\n\ndata: 1\n\ndata: 2\n\n"
    assert headers["transfer-encoding"] == "chunked"


def test_pipelined_requests_are_answered_in_order() -> None:
    requests = b"".join(f"POST /r{i} HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\n\r\n{i}"
                        .encode() for i in range(3))

    out = _with_server(lambda port: _raw(port, requests, b'"body":"2"'))
    assert [out.index(f'"path":"/r{i}"'.encode()) for i in range(3)] == sorted(
        out.index(f'"path":"/r{i}"'.encode()) for i in range(3))


def test_chunked_bodies_and_expect_100_continue() -> None:
    chunked = (b"POST /c HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n")
    out = _with_server(lambda port: _raw(port, chunked, b"}"))
    assert b'"body":"abcde"' in out

    async def expect(port: int) -> tuple[bytes, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
                     b"content-length: 2\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"hi")
        final = await asyncio.wait_for(reader.readuntil(b"}"), 5)
        writer.close()
        return interim, final

    interim, final = _with_server(expect)
    assert interim.startswith(b"HTTP/1.1 100 Continue") and b'"body":"hi"' in final


def test_http_1_0_gets_its_answer_and_the_connection_closes() -> None:
    out = _with_server(lambda port: _raw(port, b"GET /x HTTP/1.0\r\n\r\n"))
    assert out.startswith(b"HTTP/1.1 200 OK") and b"connection: close" in out
    assert out.endswith(b"}")  # read to EOF: the server closed it


def test_refusals_name_their_cause_and_close() -> None:
    garbage = _with_server(lambda port: _raw(port, b"NOT HTTP AT ALL\r\n\r\n"))
    assert garbage.startswith(b"HTTP/1.1 400 Bad Request") and b"bad HTTP request" in garbage

    big = b"POST /g HTTP/1.1\r\nhost: x\r\ncontent-length: 2000\r\n\r\n" + b"x" * 2000
    too_large = _with_server(lambda port: _raw(port, big), max_body_bytes=1000)
    assert too_large.startswith(b"HTTP/1.1 413") and b"body over 1000 bytes" in too_large

    chunked = (b"POST /g HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
               + (b"400\r\n" + b"y" * 1024 + b"\r\n") * 2)
    too_large = _with_server(lambda port: _raw(port, chunked), max_body_bytes=1500)
    assert too_large.startswith(b"HTTP/1.1 413")

    headers = b"GET /h HTTP/1.1\r\nhost: x\r\nx-big: " + b"z" * 70_000 + b"\r\n\r\n"
    too_many = _with_server(lambda port: _raw(port, headers))
    assert too_many.startswith(b"HTTP/1.1 431")


def test_a_failing_handler_answers_500_and_the_server_keeps_serving() -> None:
    async def go(port: int) -> list[int]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            return [(await http.post(path)).status_code for path in ("/boom", "/fine")]

    assert _with_server(go) == [500, 200]


def test_an_idle_connection_is_closed_after_the_idle_timeout() -> None:
    async def go(port: int) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(reader.read(), 5)  # b"" once the server closes
        finally:
            writer.close()

    assert _with_server(go, idle_timeout_s=0.2) == b""
