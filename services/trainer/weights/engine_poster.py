"""POSTs to the engines of a colocated sync, each over one kept-alive connection.

A colocated sync's fixed cost is a few HTTP round trips to engines on the same host, and a
general client's own layers are a large part of each: on a 2-core host a keep-alive POST to a
built-in engine took 498-614 µs through `httpx.Client` and 310-362 µs through the standard
library's `http.client`. So plain-HTTP engines get an `http.client` connection each; an
`https://` engine goes through httpx, whose certificate handling the deployment's TLS
settings rely on.

A request on a reused connection that fails before any answer is sent once more on a fresh
connection (the engine may have closed it while idle); a fresh connection that fails, or a call
that times out, is `Unavailable`. One call per engine at a time (the sender posts to each
engine from one thread).
"""

from __future__ import annotations

import http.client
from urllib.parse import urlsplit

import httpx

from services.common.errors import Unavailable


class EnginePoster:
    """POST `body` to `url + path`; returns (status, body). `headers` go with every call."""

    def __init__(self, timeout_s: float, headers: dict[str, str]) -> None:
        self.timeout_s = timeout_s
        self.headers = {**headers, "Content-Type": "application/json"}
        self._connections: dict[str, http.client.HTTPConnection] = {}
        self._https = httpx.Client(timeout=timeout_s, headers=headers)

    def post(self, url: str, path: str, body: bytes) -> tuple[int, bytes]:
        if url.startswith("https://"):
            try:
                reply = self._https.post(f"{url}{path}", content=body, headers=self.headers)
            except httpx.HTTPError as exc:
                raise Unavailable(f"{url}{path}: {exc}") from exc
            return reply.status_code, reply.content
        reused = url in self._connections
        try:
            return self._post(url, path, body)
        except (http.client.HTTPException, OSError) as exc:
            self._drop(url)
            if not reused or isinstance(exc, TimeoutError):  # a slow engine is no stale socket
                raise Unavailable(f"{url}{path}: {exc!r}") from exc
        try:  # the kept connection had gone stale: once more on a fresh one
            return self._post(url, path, body)
        except (http.client.HTTPException, OSError) as exc:
            self._drop(url)
            raise Unavailable(f"{url}{path}: {exc!r}") from exc

    def _post(self, url: str, path: str, body: bytes) -> tuple[int, bytes]:
        connection = self._connections.get(url)
        if connection is None:
            parts = urlsplit(url)
            connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1",
                                                    parts.port or 80, timeout=self.timeout_s)
            self._connections[url] = connection
        connection.request("POST", path, body=body, headers=self.headers)
        reply = connection.getresponse()
        content = reply.read()
        if reply.will_close:
            self._drop(url)
        return reply.status, content

    def _drop(self, url: str) -> None:
        connection = self._connections.pop(url, None)
        if connection is not None:
            connection.close()

    def close(self) -> None:
        for url in list(self._connections):
            self._drop(url)
        self._https.close()
