"""The agent gateway in a process of its own, with sessions opened up front: for the gateway's
bench, which drives it as harnesses would (the sandbox service opens sessions per episode).

    python -m services.testing.gateway_process --router HOST:PORT --sessions N \
        --keys-file F --ready-file P     (the router's gRPC token in RIPTIDE_GRPC_TOKEN)

Writes {episode: key} to the keys file, then its port to the ready file; serves until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from services._proto.riptide.v1 import common_pb2
from services.common import event_loop
from services.common.tiny_model import build_tokenizer
from services.sandbox.engine_model_client import EngineModelClient
from services.sandbox.gateway.server import AgentGateway
from services.sandbox.gateway.session import SessionLimits
from services.sandbox.model_client import ModelClient, RouterModelClient
from services.testing.child_server import ChildServer, serve_until_terminated


class GatewayProcess(ChildServer):
    """A gateway child process on a free port; `keys` maps episode ids to their keys."""

    name = "gateway"

    def __init__(self, router_address: str, grpc_token: str | None, num_sessions: int,
                 event_loop: str = "uvloop", router_http: str = "",
                 start_timeout_s: float = 60.0) -> None:
        keys_file = Path(tempfile.mkdtemp(prefix="riptide-gateway-keys-")) / "keys.json"
        env = {**os.environ, "RIPTIDE_GRPC_TOKEN": grpc_token or ""}
        super().__init__([sys.executable, "-m", "services.testing.gateway_process",
                          "--router", router_address, "--sessions", str(num_sessions),
                          "--keys-file", str(keys_file), "--event-loop", event_loop,
                          "--router-http", router_http],
                         start_timeout_s, env)
        self.keys: dict[str, str] = json.loads(keys_file.read_text())
        shutil.rmtree(keys_file.parent)

    def base_url(self, episode: str) -> str:
        return f"{self.url}/sessions/{episode}/v1"


async def _serve(args: argparse.Namespace) -> None:
    model: ModelClient
    if args.router_http:
        model = EngineModelClient(args.router_http, routed=True)
    else:
        model = RouterModelClient(args.router, os.environ.get("RIPTIDE_GRPC_TOKEN") or None)
    gateway = AgentGateway(model, build_tokenizer(), "riptide", "127.0.0.1", 0)
    await gateway.start()
    limits = SessionLimits(max_calls=1 << 30, max_context_tokens=1 << 20, max_new_tokens=16,
                           deadline=time.monotonic() + 86400)
    sampling = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=1)
    keys = {f"bench-{i}": gateway.open(f"bench-{i}", sampling, limits).key
            for i in range(args.sessions)}
    Path(args.keys_file).write_text(json.dumps(keys))
    await serve_until_terminated(args.ready_file, gateway.server.port)
    await gateway.stop()
    await model.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--router", required=True)
    p.add_argument("--router-http", default="", help="the router's HTTP front (http://...): "
                   "the gateway's transport where one is served, else gRPC to --router")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--keys-file", required=True)
    p.add_argument("--ready-file", required=True)
    p.add_argument("--event-loop", choices=("asyncio", "uvloop"), default="uvloop",
                   help="the sandbox service's [sandbox] event_loop (uvloop by default)")
    args = p.parse_args()
    event_loop.run(_serve(args), args.event_loop)


if __name__ == "__main__":
    main()
