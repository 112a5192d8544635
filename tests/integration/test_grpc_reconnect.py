"""A peer that is away is tried again every few seconds however long it has been away:
gRPC's own backoff would stretch the gaps toward two minutes."""

from __future__ import annotations

import socket
import threading
import time

import grpc

from services.common.grpc_client import MAX_RECONNECT_BACKOFF_MS, sync_channel


def _connect_attempts(window_s: tuple[float, float]) -> int:
    """Connections a caller that retries every quarter of a second opens within `window_s`
    seconds, to a peer that closes each one at once (a server that is not up yet)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    seen: list[float] = []
    start = time.monotonic()
    done = threading.Event()

    def accept_and_close() -> None:
        while not done.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            seen.append(time.monotonic() - start)
            conn.close()

    thread = threading.Thread(target=accept_and_close, daemon=True)
    thread.start()
    channel = sync_channel(f"127.0.0.1:{listener.getsockname()[1]}")
    call = channel.unary_unary("/riptide.test.Nobody/Call")
    try:
        while time.monotonic() - start < window_s[1]:
            try:
                call(b"", timeout=0.25)
            except grpc.RpcError as exc:
                assert exc.code() in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED), exc
            time.sleep(0.25)
    finally:
        done.set()
        thread.join()
        channel.close()
        listener.close()
    return sum(window_s[0] <= t <= window_s[1] for t in seen)


def test_a_peer_away_for_long_is_tried_every_few_seconds() -> None:
    # gRPC's default (1 s, x1.6 each time, +-20%) tries twice between 8 s and 24 s of an
    # outage (near 9 s and 16 s, then 26 s); a 2 s cap, plus up to half a second until the
    # caller's next try, at least five times.
    assert MAX_RECONNECT_BACKOFF_MS <= 2500
    attempts = _connect_attempts((8.0, 24.0))
    assert attempts >= 5, f"{attempts} connection attempts between 8 s and 24 s of an outage"
