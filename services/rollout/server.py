"""`riptide serve rollout`: the Rollout gRPC servicer and the runtime factory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from services._proto.riptide.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc
from services.common.service import status_message
from services.rollout.service import RolloutRuntime


class RolloutServicer(rollout_pb2_grpc.RolloutServicer):
    """Rollout RPCs over a RolloutRuntime."""

    def __init__(self, runtime: RolloutRuntime) -> None:
        self.runtime = runtime

    async def UpdateWeights(  # noqa: N802
        self, request_iterator: AsyncIterator[rollout_pb2.WeightUpdateRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rollout_pb2.WeightUpdateEvent]:
        async for event in self.runtime.coordinator.run(request_iterator):
            yield event

    async def ReleaseEngineMemory(  # noqa: N802
        self, request: rollout_pb2.ReleaseEngineMemoryRequest, context: grpc.aio.ServicerContext,
    ) -> rollout_pb2.ReleaseEngineMemoryReply:
        return await self.runtime.coordinator.release_memory(list(request.tags))

    async def GetStatus(self, request: common_pb2.StatusRequest,  # noqa: N802
                        context: grpc.aio.ServicerContext) -> common_pb2.ServiceStatus:
        return status_message(self.runtime)


def build_runtime(deployment_config: Any) -> RolloutRuntime:
    """The rollout runtime for the deployment's [rollout] section (peers from theirs)."""
    cfg = deployment_config.rollout
    return RolloutRuntime(
        cfg, deployment_config.redis, deployment_config.run.name,
        sandbox_address=cfg.sandbox_address or deployment_config.sandbox.grpc_address,
        router_address=cfg.router_address or deployment_config.router.grpc_address,
        grpc_token=deployment_config.run.grpc_token, events=deployment_config.run.events,
        grpc_tls=deployment_config.run.grpc_tls,
        engine_api_key=deployment_config.run.engine_api_key,
    )
