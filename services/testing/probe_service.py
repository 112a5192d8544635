"""A small service on the shared bootstrap, for testing the bootstrap itself in a real process.

It serves Trainer.GetStatus (state from the runtime) and Sandbox.ListTasks / RunEpisode, which
fail on purpose so tests can see how errors reach clients, and every Router and Rollout method,
which only record that a call reached them (`calls` in the state), so tests can tell a call
refused before any handler ran from one that got through. Run:
`python -m services.testing.probe_service --config FILE` (uses the [trainer] section's ports).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field

from services._proto.riptide.v1 import (
    common_pb2,
    rollout_pb2,
    rollout_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    sandbox_pb2,
    sandbox_pb2_grpc,
    trainer_pb2_grpc,
)
from services.common import process
from services.common.config import StrictModel
from services.common.errors import InvalidRequest
from services.common.grpc_server import GuardedRegistrar
from services.common.logging import setup_logging
from services.common.ports import free_ports
from services.common.serve import serve
from services.common.service import ServiceRuntime, status_message
from services.deployment import load_config


class ProbeTunables(StrictModel):
    """Settings the probe lets PATCH /admin/config change."""

    max_widgets: int = Field(4, ge=1, description="a bounded knob")
    label: str = Field("probe", description="a free-form knob")


class ProbeRuntime(ServiceRuntime):
    name = "probe"
    tunable_fields = frozenset({"max_widgets", "label"})

    def __init__(self) -> None:
        super().__init__()
        self.knobs = ProbeTunables()
        self.tunable = self.knobs
        self.changes: list[str] = []
        self.calls: list[str] = []

    def add_to_grpc(self, server: GuardedRegistrar) -> None:
        trainer_pb2_grpc.add_TrainerServicer_to_server(_Status(self), server)
        sandbox_pb2_grpc.add_SandboxServicer_to_server(_Failing(), server)
        router_pb2_grpc.add_RouterServicer_to_server(_RecordingRouter(self.calls), server)
        rollout_pb2_grpc.add_RolloutServicer_to_server(_RecordingRollout(self.calls), server)

    def state(self) -> dict[str, Any]:
        return {"max_widgets": self.knobs.max_widgets, "changes": self.changes,
                "calls": self.calls}

    def on_config_changed(self, keys: list[str]) -> None:
        self.changes.extend(keys)


class _Status(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, runtime: ProbeRuntime) -> None:
        self.runtime = runtime

    async def GetStatus(self, request: Any, context: Any) -> common_pb2.ServiceStatus:
        return status_message(self.runtime)


class _Failing(sandbox_pb2_grpc.SandboxServicer):
    async def ListTasks(self, request: Any, context: Any) -> sandbox_pb2.ListTasksResponse:
        raise InvalidRequest("probe: ListTasks always rejects")

    async def RunEpisode(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield sandbox_pb2.EpisodeEvent(progress=sandbox_pb2.EpisodeProgress(kind="turn"))
        raise ValueError("probe: crashed after one event")


class _RecordingRouter(router_pb2_grpc.RouterServicer):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def Generate(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("Generate")
        return router_pb2.GenerateResponse()

    async def RegisterEngine(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("RegisterEngine")
        return router_pb2.RegisterEngineResponse()

    async def DeregisterEngine(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("DeregisterEngine")
        return router_pb2.DeregisterEngineResponse()

    async def SetWeightVersion(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("SetWeightVersion")
        return router_pb2.SetWeightVersionResponse()

    async def EndSession(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("EndSession")
        return router_pb2.EndSessionResponse()

    async def GetStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("Router.GetStatus")
        return common_pb2.ServiceStatus(service="probe")


class _RecordingRollout(rollout_pb2_grpc.RolloutServicer):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def UpdateWeights(self, request_iterator: Any, context: Any) -> AsyncIterator[Any]:  # noqa: N802
        async for _ in request_iterator:  # a stream's handler starts before any message
            self.calls.append("UpdateWeights")
            yield rollout_pb2.WeightUpdateEvent(bucket_loaded=0)

    async def ReleaseEngineMemory(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("ReleaseEngineMemory")
        return rollout_pb2.ReleaseEngineMemoryReply()

    async def GetStatus(self, request: Any, context: Any) -> Any:  # noqa: N802
        self.calls.append("Rollout.GetStatus")
        return common_pb2.ServiceStatus(service="probe")


@dataclass(frozen=True)
class ProbeProcess:
    """A running probe service: its addresses and log."""

    proc: Any
    grpc: str
    admin: str
    log: Path


@contextlib.contextmanager
def probe_process(folder: Path, admin_token: str, grpc_token: str | None = None,
                  timeout_s: float = 30.0) -> Iterator[ProbeProcess]:
    """Start the probe in its own process (config and log in `folder`), stop it after."""
    grpc_port, admin_port = free_ports(2)
    config = folder / "probe.toml"
    token = f'grpc_token = "{grpc_token}"\n' if grpc_token else ""
    config.write_text(f'[run]\nadmin_token = "{admin_token}"\n{token}log_format = "text"\n'
                      f"[trainer]\ngrpc_port = {grpc_port}\nadmin_port = {admin_port}\n")
    log = folder / "probe.log"
    proc = process.spawn([sys.executable, "-m", "services.testing.probe_service",
                          "--config", str(config)], log_path=log)
    try:
        admin = f"http://127.0.0.1:{admin_port}"
        deadline = time.monotonic() + timeout_s
        while not _ready(admin):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"probe service not ready: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield ProbeProcess(proc, f"127.0.0.1:{grpc_port}", admin, log)
    finally:
        process.stop(proc)


def _ready(admin: str) -> bool:
    try:
        return httpx.get(f"{admin}/readyz", timeout=0.5).status_code == 200
    except httpx.HTTPError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    config = load_config(args.config)
    setup_logging("probe", config.run.log_level, config.run.log_format)
    asyncio.run(serve(ProbeRuntime(), config.trainer, config.run, grace_s=2.0))


if __name__ == "__main__":
    main()
