"""A lean HTTP/1.1 server on asyncio and httptools' C parser, for the hot HTTP paths: the
router's SGLang-compatible front and the sandbox service's agent gateway.

uvicorn and Starlette spent about a quarter of the router front's per-call CPU in their own
layers; both need only this: keep-alive, requests read whole (Content-Length or chunked, up to
`max_body_bytes`), answers with a body or streamed in chunks (SSE), `Expect: 100-continue`,
pipelined requests answered in order, and precise errors for what it refuses (400 bad HTTP,
413 body too large, 431 headers too large). A connection idle for `idle_timeout_s` is closed.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import cast

import httptools
import orjson

log = logging.getLogger(__name__)
_MAX_HEADER_BYTES = 64 * 1024


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]  # names lower-case
    body: bytes


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    stream: AsyncIterator[bytes] | None = field(default=None)  # sent chunked when set


Handler = Callable[[Request], Awaitable[Reply]]


def _error(status: int, message: str) -> Reply:
    return Reply(status, orjson.dumps({"object": "error", "message": message,
                                       "type": HTTPStatus(status).phrase, "code": status}))


def _head(status: int, content_type: str, length: int | None, keep_alive: bool) -> bytes:
    size = f"content-length: {length}" if length is not None else "transfer-encoding: chunked"
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: {content_type}\r\n"
            f"{size}\r\nconnection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n").encode()


class _Connection(asyncio.Protocol):
    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[Request | Reply, bool]] = deque()  # request, or a refusal
        self.worker: asyncio.Task[None] | None = None
        self.writable = asyncio.Event()
        self.writable.set()
        self.idle_timer: asyncio.TimerHandle | None = None
        self.refused = False
        self._begin()

    def _begin(self) -> None:
        self.url = b""
        self.headers: dict[str, str] = {}
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.body_bytes = 0

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass
        self.server.connections.add(self)
        self._arm_idle_timer()

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(_error(400, "protocol upgrades are not supported"))
        except httptools.HttpParserError as exc:
            self._refuse(_error(400, f"bad HTTP request: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.worker is not None:
            self.worker.cancel()
        self.writable.set()

    def pause_writing(self) -> None:
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()

    # -- httptools callbacks ---------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._begin()
        if self.idle_timer is not None:
            self.idle_timer.cancel()

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        if self.refused:
            return
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        if self.refused:
            return
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.server.max_body_bytes:
            self._refuse(_error(413, f"body over {self.server.max_body_bytes} bytes"))
            return
        if self.headers.get("expect", "").lower() == "100-continue" and self.transport:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.refused:
            return
        self.body_bytes += len(body)
        if self.body_bytes > self.server.max_body_bytes:
            self._refuse(_error(413, f"body over {self.server.max_body_bytes} bytes"))
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.refused:
            return
        method = self.parser.get_method().decode("latin-1")
        path = httptools.parse_url(self.url).path.decode("latin-1")
        request = Request(method, path, self.headers, b"".join(self.body))
        self._enqueue(request, self.parser.should_keep_alive())  # valid only in here

    # -- answering -----------------------------------------------------------------------
    def _count_header_bytes(self, n: int) -> None:
        self.header_bytes += n
        if self.header_bytes > _MAX_HEADER_BYTES and not self.refused:
            self._refuse(_error(431, f"request line and headers over {_MAX_HEADER_BYTES} "
                                     "bytes"))

    def _refuse(self, reply: Reply) -> None:
        """Answer `reply` after what is queued, then close: the stream cannot be trusted."""
        if not self.refused:
            self.refused = True
            self._enqueue(reply, False)

    def _enqueue(self, item: Request | Reply, keep_alive: bool) -> None:
        self.queue.append((item, keep_alive))
        if self.worker is None or self.worker.done():
            self.worker = asyncio.get_running_loop().create_task(self._answer_queued())

    async def _answer_queued(self) -> None:
        while self.queue and self.transport is not None and not self.transport.is_closing():
            item, keep_alive = self.queue.popleft()
            if isinstance(item, Request):
                try:
                    reply = await self.server.handler(item)
                except Exception:  # noqa: BLE001 - a handler bug answers 500, not a hang
                    log.exception("HTTP front handler failed", extra={"path": item.path})
                    reply = _error(500, "internal error")
            else:
                reply = item
            try:
                await self._send(reply, keep_alive)
            except Exception:  # noqa: BLE001 - e.g. a stream's source failed: end the answer
                log.exception("HTTP front answer failed")
                self.transport.close()
                return
            if not keep_alive:
                self.transport.close()
                return
        self._arm_idle_timer()

    async def _send(self, reply: Reply, keep_alive: bool) -> None:
        assert self.transport is not None
        if reply.stream is None:
            self.transport.write(_head(reply.status, reply.content_type, len(reply.body),
                                       keep_alive) + reply.body)
            return
        self.transport.write(_head(reply.status, reply.content_type, None, keep_alive))
        async for chunk in reply.stream:
            if self.transport.is_closing():
                return
            if chunk:
                self.transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            await self.writable.wait()
        self.transport.write(b"0\r\n\r\n")

    def _arm_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
        if self.transport is not None and not self.queue:
            self.idle_timer = asyncio.get_running_loop().call_later(
                self.server.idle_timeout_s, self.transport.close)


class Http1Server:
    """Serves `handler` on host:port (0: a free port) on the running event loop."""

    def __init__(self, handler: Handler, host: str, port: int, *,
                 max_body_bytes: int = 64 << 20, idle_timeout_s: float = 600.0,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.handler = handler
        self.ssl_context = ssl_context  # TLS on every connection where set
        self.host, self.port = host, port
        self.max_body_bytes = max_body_bytes
        self.idle_timeout_s = idle_timeout_s
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), self.host,
                                                self.port, backlog=1024, ssl=self.ssl_context)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
