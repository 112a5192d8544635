"""The router's lean HTTP/1.1 client against real loopback servers: keep-alive reuse, the
connection cap, a connection the server closed while idle (sent again, its slot freed),
`Connection: close`, an unread body, and the read timeout."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from aiohttp import web

from services.common.http1_client import ConnectionBroke, Http1Client, NotConnected


async def _serve(handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                 keepalive_s: float = 75.0) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/p", handler)
    runner = web.AppRunner(app, keepalive_timeout=keepalive_s)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _client(**kw: Any) -> Http1Client:
    return Http1Client(**{"connect_timeout_s": 2.0, "read_timeout_s": 5.0,
                          "max_connections": 4, **kw})


async def _call(client: Http1Client, url: str, body: bytes = b"{}") -> tuple[int, bytes]:
    response = await client.post(url, "/p", body)
    try:
        return response.status, await response.read()
    finally:
        response.release()


def test_calls_reuse_one_keep_alive_connection() -> None:
    peers: list[Any] = []

    async def echo(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(body=await request.read(), status=201)

    async def go() -> list[tuple[int, bytes]]:
        runner, url = await _serve(echo)
        client = _client()
        try:
            return [await _call(client, url, f'{{"n": {i}}}'.encode()) for i in range(5)]
        finally:
            await client.close()
            await runner.cleanup()

    assert asyncio.run(go()) == [(201, f'{{"n": {i}}}'.encode()) for i in range(5)]
    assert len(set(peers)) == 1


def test_at_most_max_connections_are_open_at_once() -> None:
    running = [0, 0]  # now, most

    async def slow(request: web.Request) -> web.Response:
        running[0] += 1
        running[1] = max(running[1], running[0])
        await asyncio.sleep(0.05)
        running[0] -= 1
        return web.Response(body=b"ok")

    async def go() -> None:
        runner, url = await _serve(slow)
        client = _client(max_connections=3)
        try:
            results = await asyncio.gather(*(_call(client, url) for _ in range(12)))
            assert results == [(200, b"ok")] * 12
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(go())
    assert running[1] == 3


def test_a_connection_closed_idle_by_the_server_is_replaced_and_frees_its_slot() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    async def go() -> None:
        runner, url = await _serve(ok, keepalive_s=0.1)  # the server closes idle connections
        client = _client(max_connections=1, keepalive_s=30.0)  # ...before the client would
        try:
            for _ in range(4):
                assert await _call(client, url) == (200, b"ok")
                await asyncio.sleep(0.3)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(go())  # with one slot, a leaked one would hang the second call


def test_connection_close_and_unread_bodies_are_not_reused() -> None:
    peers: list[Any] = []

    async def closing(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        if request.query.get("close"):
            return web.Response(body=b"bye", headers={"connection": "close"})
        return web.Response(body=b"x" * 100_000)

    async def go() -> None:
        runner, url = await _serve(closing)
        client = _client()
        try:
            response = await client.post(url, "/p?close=1", b"{}")
            assert await response.read() == b"bye"
            response.release()
            response = await client.post(url, "/p", b"{}")
            response.release()  # body not read: the connection cannot carry another call
            assert await _call(client, url) == (200, b"x" * 100_000)
        finally:
            await client.close()
            await runner.cleanup()

    asyncio.run(go())
    assert len(set(peers)) == 3


def test_no_answer_within_the_read_timeout_raises_and_nothing_listening_is_not_connected(
) -> None:
    async def never(request: web.Request) -> web.Response:
        await asyncio.sleep(1.0)  # far past the read timeout
        return web.Response()

    async def go() -> None:
        runner, url = await _serve(never)
        client = _client(read_timeout_s=0.2)
        try:
            with pytest.raises(TimeoutError):
                await _call(client, url)
        finally:
            await client.close()
            await runner.cleanup()
        with pytest.raises(NotConnected):
            await _call(_client(), url)

    asyncio.run(go())


def test_a_server_that_dies_mid_body_breaks_the_call() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()

    async def go() -> None:
        server = await asyncio.start_server(dies, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        client = _client()
        try:
            with pytest.raises(ConnectionBroke):
                await _call(client, url)
        finally:
            await client.close()
            server.close()

    asyncio.run(go())


def test_an_idle_connection_to_another_engine_makes_room_under_the_cap() -> None:
    async def ok(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    async def go() -> None:
        (runner_a, a), (runner_b, b) = await _serve(ok), await _serve(ok)
        client = _client(max_connections=1)
        try:
            for url in (a, b, a):
                assert await asyncio.wait_for(_call(client, url), 5) == (200, b"ok")
        finally:
            await client.close()
            await runner_a.cleanup()
            await runner_b.cleanup()

    asyncio.run(go())
