"""The colocated sync's poster: one kept-alive connection per engine, a stale one replaced
once, a dead engine or a slow one `Unavailable`."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from services.common.errors import Unavailable
from services.common.ports import free_port
from services.trainer.weights.engine_poster import EnginePoster


class _Engine(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive
    connections: list[int] = []
    delay_s = 0.0

    def setup(self) -> None:
        super().setup()
        _Engine.connections.append(self.client_address[1])

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(_Engine.delay_s)
        answer = b'{"success": true, "echo": %d, "auth": "%s"}' % (
            len(body), self.headers.get("Authorization", "").encode())
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # the slow answer's write to a client that gave up


@pytest.fixture
def engine() -> Iterator[ThreadingHTTPServer]:
    _Engine.connections, _Engine.delay_s = [], 0.0
    server = _Server(("127.0.0.1", 0), _Engine)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _url(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


def test_calls_share_one_connection_and_carry_the_headers(engine: ThreadingHTTPServer) -> None:
    poster = EnginePoster(5.0, {"Authorization": "Bearer k1"})
    for size in (3, 10, 0):
        status, body = poster.post(_url(engine), "/update_weights_from_tensor", b"x" * size)
        assert status == 200 and f'"echo": {size}'.encode() in body and b"Bearer k1" in body
    assert len(_Engine.connections) == 1
    poster.close()


def test_a_connection_the_engine_closed_is_replaced_once(engine: ThreadingHTTPServer) -> None:
    poster = EnginePoster(5.0, {})
    assert poster.post(_url(engine), "/x", b"{}")[0] == 200
    for connection in list(poster._connections.values()):  # as if the engine timed it out
        assert connection.sock is not None
        connection.sock.close()
    assert poster.post(_url(engine), "/x", b"{}")[0] == 200
    assert len(_Engine.connections) == 2
    poster.close()


def test_no_engine_or_a_slow_one_is_unavailable(engine: ThreadingHTTPServer) -> None:
    with pytest.raises(Unavailable, match="/update"):
        EnginePoster(2.0, {}).post(f"http://127.0.0.1:{free_port()}", "/update", b"{}")
    _Engine.delay_s = 0.5
    poster = EnginePoster(0.2, {})
    started = time.monotonic()
    with pytest.raises(Unavailable, match="Timeout"):
        poster.post(_url(engine), "/x", b"{}")
    assert time.monotonic() - started < 0.45  # not tried a second time
    poster.close()
