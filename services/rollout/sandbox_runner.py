"""The real EpisodeRunner: one `Sandbox.RunEpisode` stream per episode."""

from __future__ import annotations

import asyncio
import logging

import grpc

from services._proto.riptide.v1 import common_pb2, sandbox_pb2, sandbox_pb2_grpc
from services.common.bounds import MAX_ID_CHARS
from services.common.errors import DeadlineExceeded, Unavailable

log = logging.getLogger(__name__)

# Codes meaning the call never reached a running episode: safe to submit again.
_NOT_STARTED = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}


class SandboxEpisodeRunner:
    """Runs episodes on the sandbox service; retries calls that were refused before starting."""

    def __init__(self, channel: grpc.aio.Channel, episode_timeout_s: float | None = None,
                 max_attempts: int = 5, retry_s: float = 1.0) -> None:
        self._stub = sandbox_pb2_grpc.SandboxStub(channel)
        self._timeout_s = episode_timeout_s
        self._max_attempts = max_attempts
        self._retry_s = retry_s

    async def list_tasks(self) -> list[str]:
        """The sandbox service's task ids; one no RunEpisode would take (longer than an id
        may be, or unprintable) is left out with a warning, never stored or scheduled."""
        reply = await self._stub.ListTasks(sandbox_pb2.ListTasksRequest(), timeout=30.0)
        kept = [t for t in reply.task_ids if t and len(t) <= MAX_ID_CHARS and t.isprintable()]
        if len(kept) < len(reply.task_ids):
            log.warning("the sandbox service listed %d task ids that are empty, longer than "
                        "%d characters or unprintable: left out",
                        len(reply.task_ids) - len(kept), MAX_ID_CHARS)
        return kept

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory:
        for attempt in range(1, self._max_attempts + 1):
            started = False
            try:
                call = self._stub.RunEpisode(request, timeout=self._timeout_s)
                async for event in call:
                    started = True
                    if event.WhichOneof("event") == "trajectory":
                        call.cancel()
                        return event.trajectory
                raise Unavailable(f"episode {request.sample_id}: the stream ended without a "
                                  "trajectory")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise DeadlineExceeded(f"episode {request.sample_id}: RunEpisode ran past "
                                           f"{self._timeout_s} s") from None
                if started or exc.code() not in _NOT_STARTED or attempt == self._max_attempts:
                    raise Unavailable(f"episode {request.sample_id}: RunEpisode failed: "
                                      f"{exc.code().name}: {exc.details()}") from None
                log.info("episode %s refused (%s); retrying", request.sample_id, exc.code().name)
            await asyncio.sleep(self._retry_s * attempt)
        raise AssertionError("unreachable")
