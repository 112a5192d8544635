"""A small HTTP/1.1 JSON server on asyncio streams (keep-alive, Content-Length bodies).

Test servers use it instead of a web framework so that many of them fit on a small machine:
a handler takes (method, path, json body) and returns (status, json-able body or text).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

Handler = Callable[[str, str, Any], Awaitable[tuple[int, Any]]]
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
            503: "Service Unavailable"}


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            key, value = line.split(":", 1)
            headers[key.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    body = await reader.readexactly(length) if length else b""
    return method, target.split("?", 1)[0], headers, body


def _encode(status: int, payload: Any, keep_alive: bool) -> bytes:
    if isinstance(payload, str):
        body, kind = payload.encode(), "text/plain; version=0.0.4"
    else:
        body, kind = orjson.dumps(payload), "application/json"
    head = (f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n"
            f"content-type: {kind}\r\ncontent-length: {len(body)}\r\n"
            f"connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n")
    return head.encode() + body


async def _serve_connection(handler: Handler, reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            try:
                method, path, headers, raw = await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                return
            try:
                body = orjson.loads(raw) if raw else None
            except orjson.JSONDecodeError as exc:
                status, payload = 400, {"object": "error", "message": f"bad JSON: {exc}",
                                        "type": "BadRequestError", "code": 400}
            else:
                status, payload = await handler(method, path, body)
            keep_alive = headers.get("connection", "").lower() != "close"
            writer.write(_encode(status, payload, keep_alive))
            await writer.drain()
            if not keep_alive:
                return
    except ConnectionError:
        return
    finally:
        writer.close()


async def start_json_server(handler: Handler, host: str, port: int) -> asyncio.Server:
    """Listen on host:port (0: a free port) and serve `handler` on every connection."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _serve_connection(handler, reader, writer)

    return await asyncio.start_server(on_connect, host, port, limit=1 << 24, backlog=1024)
