"""A pass-through HTTP proxy in a process of its own: one more hop and no work. The gateway's
bench puts it in front of the router's HTTP front to measure what any extra hop costs on the
machine (its sockets, its process waking up), so that the gateway's own work can be told apart
from the cost of being a separate process.

It runs on the same parts as the gateway (the lean HTTP/1.1 server and client of
services/common, on the same event loop): every request is sent on as it came, by method,
path and body, to `--target`, and the answer comes back with its status and body.

    python -m services.testing.proxy_hop_process --target http://HOST:PORT --ready-file P
"""

from __future__ import annotations

import argparse
import sys

from services.common import event_loop
from services.common.http1_client import ConnectionBroke, Http1Client, NotConnected
from services.common.http1_server import Http1Server, Reply, Request
from services.testing.child_server import ChildServer, serve_until_terminated


class ProxyHopProcess(ChildServer):
    """A pass-through proxy to `target` on a free loopback port."""

    name = "proxy-hop"

    def __init__(self, target: str, event_loop: str = "uvloop",
                 start_timeout_s: float = 30.0) -> None:
        super().__init__([sys.executable, "-m", "services.testing.proxy_hop_process",
                          "--target", target, "--event-loop", event_loop], start_timeout_s)


async def _serve(args: argparse.Namespace) -> None:
    client = Http1Client(connect_timeout_s=5.0, read_timeout_s=600.0, max_connections=512)
    target = args.target.rstrip("/")

    async def forward(request: Request) -> Reply:
        if request.method != "POST":
            return Reply(405, b'{"error": "the proxy forwards POST only"}')
        try:
            response = await client.post(target, request.path, request.body,
                                         request.headers.get("content-type",
                                                             "application/json"))
            try:
                return Reply(response.status, await response.read())
            finally:
                response.release()
        except (NotConnected, ConnectionBroke, TimeoutError) as exc:
            return Reply(502, f'{{"error": "{type(exc).__name__}"}}'.encode())

    server = Http1Server(forward, "127.0.0.1", 0)
    await server.start()
    await serve_until_terminated(args.ready_file, server.port)
    await server.stop()
    await client.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", required=True, help="where requests go on (http://HOST:PORT)")
    p.add_argument("--ready-file", required=True)
    p.add_argument("--event-loop", choices=("asyncio", "uvloop"), default="uvloop")
    args = p.parse_args()
    event_loop.run(_serve(args), args.event_loop)


if __name__ == "__main__":
    main()
