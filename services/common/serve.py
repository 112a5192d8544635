"""Run one ServiceRuntime: gRPC server, admin REST app, readiness, graceful SIGTERM shutdown.

Called by `riptide serve <service>`; owns the process's event loop. Shutdown order: stop
reporting ready, stop accepting gRPC calls and finish in-flight ones within the grace period,
stop the runtime (which reaps its children), then stop the admin server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any

import uvicorn

from services.common.admin import build_admin_app
from services.common.config import ServiceConfig
from services.common.errors import Unavailable
from services.common.grpc_server import GrpcServer
from services.common.service import ServiceRuntime

log = logging.getLogger(__name__)


def listen_socket(host: str, port: int) -> socket.socket:
    """A non-blocking listening socket for an HTTP server (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise Unavailable(f"cannot listen for admin REST on {host}:{port}: {exc}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


async def serve(runtime: ServiceRuntime, section: ServiceConfig, run: Any,
                grace_s: float = 10.0) -> int:
    """Serve `runtime` until SIGTERM, SIGINT or its `request_exit`, then shut down in order;
    returns the process's exit code (the runtime's, 0 after a signal)."""
    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)

    def exit_requested() -> None:  # from any thread (the trainer's loop runs in its own)
        loop.call_soon_threadsafe(stop_requested.set)

    runtime.bind_exit(exit_requested)

    admin_socket = listen_socket(section.listen_host, section.admin_port)
    admin_port = admin_socket.getsockname()[1]
    grpc_server = GrpcServer(runtime.name, token=run.grpc_token, tls=run.grpc_tls)
    runtime.add_to_grpc(grpc_server.registrar)
    try:
        grpc_port = await grpc_server.start(section.listen_host, section.grpc_port)
    except BaseException:
        admin_socket.close()
        await grpc_server.server.stop(None)
        raise
    app = build_admin_app(runtime, run.admin_token, run.admin_max_body_kb * 1024)
    tls = run.http_tls
    admin = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", access_log=False, lifespan="off",
        ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None))
    # Signals are ours: the admin server must be the last thing to stop, not the first.
    admin.capture_signals = contextlib.nullcontext  # type: ignore[method-assign,assignment]
    admin_task = asyncio.create_task(admin.serve(sockets=[admin_socket]))

    try:
        await runtime.start()
        watcher = asyncio.create_task(_track_readiness(runtime, grpc_server))
        log.info("serving", extra={"grpc_port": grpc_port, "admin_port": admin_port})
        await stop_requested.wait()
        log.info("stopping")
        watcher.cancel()
    finally:
        await grpc_server.stop(grace_s)
        try:
            await runtime.stop()
        finally:
            admin.should_exit = True
            await admin_task
    log.info("stopped")
    return runtime.exit_code or 0


async def _track_readiness(runtime: ServiceRuntime, grpc_server: GrpcServer) -> None:
    """Mirror runtime.ready() into the gRPC health status."""
    serving: bool | None = None
    while True:
        ready = runtime.ready()
        if ready != serving:
            await grpc_server.set_serving(ready)
            serving = ready
        await asyncio.sleep(0.2)
