"""Run `riptide serve router` as a child process on free ports, for tests and benches.

Writes a minimal deployment config with the given [router] settings, waits for /readyz, and
offers an admin client; gRPC stubs come from `channel()` / `aio_channel()`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import ssl
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import httpx

from services._proto.riptide.v1 import common_pb2, router_pb2, router_pb2_grpc
from services.common import process
from services.common.config import GrpcTlsConfig, HttpTlsConfig
from services.common.grpc_client import aio_channel, sync_channel
from services.common.ports import free_ports
from services.common.tls import client_context
from services.testing.sim_engine_process import SimEngineProcess

ADMIN_TOKEN = "router-test-admin-token"


class RouterProcess:
    """A router service process; `settings` are [router] keys (policy, session_idle_s...).

    `http_front` also serves the SGLang-compatible HTTP front, at `http_url`.
    """

    def __init__(self, start_timeout_s: float = 30.0, http_front: bool = False,
                 grpc_token: str | None = None, engine_api_key: str | None = None,
                 grpc_tls: GrpcTlsConfig | None = None, http_tls: HttpTlsConfig | None = None,
                 **settings: Any) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="riptide-router-"))
        grpc_port, admin_port, http_port = free_ports(3)
        router = {"grpc_port": grpc_port, "admin_port": admin_port, **settings}
        if http_front:
            router["http_port"] = http_port
        scheme = "https" if http_tls else "http"
        self.http_url = f"{scheme}://127.0.0.1:{http_port}" if http_front else ""
        lines = ["[run]", f'admin_token = "{ADMIN_TOKEN}"', 'log_format = "text"',
                 'log_level = "warning"']
        if grpc_token:
            lines.append(f'grpc_token = "{grpc_token}"')
        if engine_api_key:
            lines.append(f'engine_api_key = "{engine_api_key}"')
        if grpc_tls is not None:
            lines.append("[run.grpc_tls]")
            lines += [f"{key} = {json.dumps(value)}"
                      for key, value in grpc_tls.model_dump().items()]
        if http_tls is not None:
            lines.append("[run.http_tls]")
            lines += [f"{key} = {json.dumps(value)}"
                      for key, value in http_tls.model_dump().items()]
        lines.append("[router]")
        self.grpc_token, self.grpc_tls, self.http_tls = grpc_token, grpc_tls, http_tls
        # JSON scalars and lists of strings are valid TOML values.
        lines += [f"{key} = {json.dumps(value)}" for key, value in router.items()]
        config = self._dir / "router.toml"
        config.write_text("\n".join(lines) + "\n")
        self.address = f"127.0.0.1:{grpc_port}"
        self._channel: grpc.Channel | None = None
        self._stub: router_pb2_grpc.RouterStub | None = None
        self.admin_url = f"{scheme}://127.0.0.1:{admin_port}"
        self.verify: ssl.SSLContext | bool = client_context(http_tls) if http_tls else True
        self.admin = httpx.Client(base_url=self.admin_url, timeout=30, verify=self.verify,
                                  headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
        self.proc = process.spawn(
            [sys.executable, "-m", "services.cli", "serve", "router", "--config", str(config)],
            log_path=self._dir / "router.log", cwd=Path(__file__).resolve().parents[2])
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if httpx.get(f"{self.admin_url}/readyz", timeout=0.5,
                             verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        tail = self.log_tail()
        self.stop()
        raise RuntimeError(f"router did not become ready: {tail}")

    def log_tail(self) -> str:
        try:
            return (self._dir / "router.log").read_text()[-4000:]
        except OSError:
            return "(no log)"

    def channel(self) -> grpc.Channel:
        return sync_channel(self.address, self.grpc_token, tls=self.grpc_tls)

    def aio_channel(self) -> grpc.aio.Channel:
        return aio_channel(self.address, self.grpc_token, tls=self.grpc_tls)

    def stub(self) -> router_pb2_grpc.RouterStub:
        """A blocking Router stub on a channel kept for this process's lifetime."""
        if self._stub is None:
            self._channel = self.channel()
            self._stub = router_pb2_grpc.RouterStub(self._channel)
        return self._stub

    def register(self, url: str) -> list[int]:
        reply = self.stub().RegisterEngine(router_pb2.RegisterEngineRequest(url=url), timeout=30)
        return list(reply.dp_ranks)

    def generate(self, session_key: str, input_ids: list[int], max_new_tokens: int = 8,
                 timeout_s: float = 60, return_logprob: bool = False,
                 **params: Any) -> router_pb2.GenerateResponse:
        """Router.Generate; `params` are further SamplingParams fields."""
        sampling = common_pb2.SamplingParams(max_new_tokens=max_new_tokens, **params)
        request = router_pb2.GenerateRequest(session_key=session_key, input_ids=input_ids,
                                             sampling_params=sampling,
                                             return_logprob=return_logprob)
        return self.stub().Generate(request, timeout=timeout_s)

    def end_session(self, session_key: str) -> bool:
        request = router_pb2.EndSessionRequest(session_key=session_key)
        return bool(self.stub().EndSession(request, timeout=10).known)

    def targets(self) -> list[dict[str, Any]]:
        return list(self.admin.get("/admin/targets").raise_for_status().json()["targets"])

    def state(self) -> dict[str, Any]:
        return dict(self.admin.get("/admin/state").raise_for_status().json()["details"])

    def patch_config(self, **patch: Any) -> dict[str, Any]:
        return dict(self.admin.patch("/admin/config", json=patch).raise_for_status().json())

    def stop(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self.admin.close()
        process.stop(self.proc, grace_s=5)
        shutil.rmtree(self._dir, ignore_errors=True)  # its config and log

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@contextlib.contextmanager
def router_with_engine(grpc_token: str | None = None,
                       engine_settings: dict[str, Any] | None = None,
                       **settings: Any) -> Iterator[tuple[RouterProcess, SimEngineProcess]]:
    """A router process with one fast simulated engine (of `engine_settings`) registered;
    both stopped after."""
    engine = SimEngineProcess(**{"decode_s_per_token": 0.0005, **(engine_settings or {})})
    try:
        router = RouterProcess(grpc_token=grpc_token, **settings)
        try:
            router.register(engine.url)
            yield router, engine
        finally:
            router.stop()
    finally:
        engine.stop()
