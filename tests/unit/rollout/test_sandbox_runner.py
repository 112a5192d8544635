"""The rollout service's client of the sandbox service, against a real gRPC server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services._proto.riptide.v1 import sandbox_pb2, sandbox_pb2_grpc
from services.rollout.sandbox_runner import SandboxEpisodeRunner


class _Listing(sandbox_pb2_grpc.SandboxServicer):
    def __init__(self, task_ids: list[str]) -> None:
        self.task_ids = task_ids

    async def ListTasks(self, request: sandbox_pb2.ListTasksRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> sandbox_pb2.ListTasksResponse:
        return sandbox_pb2.ListTasksResponse(task_ids=self.task_ids)


def test_task_ids_no_episode_could_run_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    listed = ["csv-revenue", "t" * 257, "bad\nid", "", "u" * 256]

    async def go() -> list[str]:
        server = grpc.aio.server()
        sandbox_pb2_grpc.add_SandboxServicer_to_server(_Listing(listed), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                return await SandboxEpisodeRunner(channel).list_tasks()
        finally:
            await server.stop(None)

    assert asyncio.run(go()) == ["csv-revenue", "u" * 256]
    assert "listed 3 task ids that are empty, longer than 256 characters" in caplog.text
