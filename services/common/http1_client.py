"""A lean pooled HTTP/1.1 client on asyncio and httptools' C parser, for hot paths: the
router's calls to engines, and the agent gateway's calls to the router's HTTP front.

A general client (httpx, aiohttp) spends most of such a proxy's per-call CPU in its own layers;
this one does what a call to an engine needs and nothing else: keep-alive connections per
host (at most `max_connections` in all), a request with a body, and a response read whole
or streamed (Content-Length or chunked, as SGLang's uvicorn sends them).

Failures are exceptions the caller classifies: `NotConnected` when no connection could be
made (refused, or the connect timeout), `ConnectionBroke` when one broke after the request
was sent, `TimeoutError` when no byte came for `read_timeout_s`. A request on a reused
keep-alive connection that the server closed before answering a byte is sent once more on a
fresh connection (the server closed it idle, so it never read the request).
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

_PAUSE_AT = 1 << 20  # buffered response bytes above which reading pauses (a slow reader)

_Key = tuple[str, int, bool]  # host, port, TLS


class NotConnected(Exception):
    """No connection to the server: the request was never sent."""


class ConnectionBroke(Exception):
    """The connection broke after the request was sent; the server may have acted on it."""


class _Connection(asyncio.Protocol):
    """One keep-alive connection; one request at a time."""

    def __init__(self, on_lost: Callable[[_Connection], None]) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self._on_lost = on_lost
        self._reset()

    def _reset(self) -> None:
        loop = asyncio.get_running_loop()
        self.head: asyncio.Future[int] = loop.create_future()
        self.chunks: deque[bytes] = deque()
        self.buffered = 0
        self.complete = False
        self.keep_alive = False
        self.error: Exception | None = None
        self.wake = asyncio.Event()
        self.got_bytes = False
        self.paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionBroke(f"bad HTTP response: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._on_lost(self)
        if not self.complete:
            self._fail(ConnectionBroke(f"connection closed before the response ended: "
                                       f"{exc!r}" if exc else "connection closed by the server"))

    # -- httptools callbacks ---------------------------------------------------------------
    def on_headers_complete(self) -> None:
        if not self.head.done():
            self.head.set_result(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)
        self.wake.set()
        if self.buffered > _PAUSE_AT and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()  # only valid inside the callback
        self.wake.set()

    # -- the caller's side -------------------------------------------------------------------
    def _fail(self, error: Exception) -> None:
        self.error = error
        if not self.head.done():
            self.head.set_exception(error)
        self.wake.set()
        if self.transport is not None:
            self.transport.close()

    def send(self, data: bytes) -> None:
        self._reset()
        assert self.transport is not None
        self.transport.write(data)

    async def next_chunk(self, timeout_s: float) -> bytes | None:
        """The next body bytes; None at the end of the body."""
        while not self.chunks:
            if self.complete:
                return None
            if self.error is not None:
                raise self.error
            self.wake.clear()
            async with asyncio.timeout(timeout_s):  # no task per wait, as wait_for makes
                await self.wake.wait()
        chunk = self.chunks.popleft()
        self.buffered -= len(chunk)
        if self.paused and self.buffered < _PAUSE_AT // 2 and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return chunk

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Response:
    """A response whose body is read with `read()` or `chunks()`, then `release()`d."""

    def __init__(self, pool: Http1Client, key: _Key, conn: _Connection,
                 status: int, read_timeout_s: float) -> None:
        self.status = status
        self._pool, self._key, self._conn = pool, key, conn
        self._timeout = read_timeout_s
        self._released = False

    async def chunks(self) -> AsyncIterator[bytes]:
        while (chunk := await self._conn.next_chunk(self._timeout)) is not None:
            yield chunk

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def release(self) -> None:
        """Back to the pool if the whole body was read, else the connection is closed."""
        if not self._released:
            self._released = True
            self._pool._give_back(self._key, self._conn)


class Http1Client:
    """Keep-alive connections per (host, port), at most `max_connections` open at once."""

    def __init__(self, *, connect_timeout_s: float, read_timeout_s: float,
                 max_connections: int, keepalive_s: float = 4.0,
                 headers: dict[str, str] | None = None,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.keepalive_s = keepalive_s
        self.ssl_context = ssl_context  # what https:// URLs are verified with
        self._extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        self._idle: dict[_Key, deque[tuple[float, _Connection]]] = {}
        self._max = max_connections
        self._open: set[_Connection] = set()
        self._connecting = 0
        self._freed: asyncio.Event | None = None  # set when a connection goes idle or away

    def _freed_event(self) -> asyncio.Event:
        if self._freed is None:  # made on the running loop
            self._freed = asyncio.Event()
        return self._freed

    async def post(self, url: str, path: str, body: bytes,
                   content_type: str = "application/json") -> Response:
        """POST `body`; returns once the status line and headers arrived."""
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        if secure and self.ssl_context is None:
            raise NotConnected(f"{url}: https needs the deployment's CA (run.http_tls)")
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80)
        head = (f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: {content_type}"
                f"\r\ncontent-length: {len(body)}\r\n").encode()
        data = head + self._extra + b"\r\n" + body
        key = (host, port, secure)
        for _ in range(2):
            conn = await self._connection(key)
            conn.send(data)
            try:
                async with asyncio.timeout(self.read_timeout_s):
                    status = await conn.head
            except ConnectionBroke:
                self._discard(conn)
                if conn.reused and not conn.got_bytes:
                    continue  # closed idle by the server just now: it never read the request
                raise
            except BaseException:
                self._discard(conn)
                raise
            return Response(self, key, conn, status, self.read_timeout_s)
        raise ConnectionBroke(f"{host}:{port} closed two connections without answering")

    async def _connection(self, key: _Key) -> _Connection:
        """An idle connection to `key`, else a new one once fewer than the cap are open
        (closing an idle one to another host if that is what holds the cap)."""
        while True:
            conn = self._take_idle(key)
            if conn is not None:
                return conn
            if len(self._open) + self._connecting < self._max:
                return await self._connect(key)
            if not self._close_an_idle_one():
                freed = self._freed_event()
                freed.clear()
                await freed.wait()

    def _take_idle(self, key: _Key) -> _Connection | None:
        now = asyncio.get_running_loop().time()
        idle = self._idle.get(key)
        while idle:
            since, conn = idle.pop()
            if not conn.closed and now - since < self.keepalive_s:
                conn.reused = True
                return conn
            self._discard(conn)
        return None

    def _close_an_idle_one(self) -> bool:
        for idle in self._idle.values():
            if idle:
                self._discard(idle.popleft()[1])
                return True
        return False

    async def _connect(self, key: _Key) -> _Connection:
        loop = asyncio.get_running_loop()
        self._connecting += 1
        try:
            _, conn = await asyncio.wait_for(loop.create_connection(
                lambda: _Connection(self._discard), key[0], key[1],
                ssl=self.ssl_context if key[2] else None), self.connect_timeout_s)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            raise NotConnected(f"cannot connect to {key[0]}:{key[1]}: "
                               f"{type(exc).__name__}: {exc}") from exc
        finally:
            self._connecting -= 1
            self._freed_event().set()
        self._open.add(conn)
        return conn

    def _give_back(self, key: _Key, conn: _Connection) -> None:
        if conn.reusable() and not conn.chunks:
            self._idle.setdefault(key, deque()).append((asyncio.get_running_loop().time(), conn))
            self._freed_event().set()
        else:
            self._discard(conn)

    def _discard(self, conn: _Connection) -> None:
        """Close it and free its place (also called when the server closed it)."""
        conn.close()
        if conn in self._open:
            self._open.discard(conn)
            self._freed_event().set()

    async def close(self) -> None:
        for conn in list(self._open):
            self._discard(conn)
        self._idle.clear()
