"""A small service on the shared bootstrap, for testing the bootstrap itself in a real process.

It serves Trainer.GetStatus (state from the runtime) and Sandbox.ListTasks / RunEpisode, which
fail on purpose so tests can see how errors reach clients. Run:
`python -m services.testing.probe_service --config FILE` (uses the [trainer] section's ports).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
from pydantic import Field

from services._proto.riptide.v1 import (
    common_pb2,
    sandbox_pb2,
    sandbox_pb2_grpc,
    trainer_pb2_grpc,
)
from services.common.config import StrictModel
from services.common.errors import InvalidRequest
from services.common.logging import setup_logging
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

    def add_to_grpc(self, server: grpc.aio.Server) -> None:
        trainer_pb2_grpc.add_TrainerServicer_to_server(_Status(self), server)
        sandbox_pb2_grpc.add_SandboxServicer_to_server(_Failing(), server)

    def state(self) -> dict[str, Any]:
        return {"max_widgets": self.knobs.max_widgets, "changes": self.changes}

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    config = load_config(args.config)
    setup_logging("probe", config.run.log_level, config.run.log_format)
    asyncio.run(serve(ProbeRuntime(), config.trainer, config.run, grace_s=2.0))


if __name__ == "__main__":
    main()
