"""What the scheduler talks to: where episodes run and where finished groups go.

The scheduler (scheduler.py) depends only on these small interfaces. The service wires the
real ones (sandbox_runner.py over Sandbox gRPC, the Redis SampleBuffer); the overlap bench and
unit tests wire simulated ones.
"""

from __future__ import annotations

from typing import Protocol

from services._proto.riptide.v1 import common_pb2, sandbox_pb2
from services.common.errors import DeadlineExceeded


class EpisodeRunner(Protocol):
    """Runs one episode to its end and returns its trajectory.

    An exception means the episode produced nothing usable; the scheduler records the sample
    as no_verdict (and drops its group). Cancellation must stop the episode.
    """

    async def run(self, request: sandbox_pb2.RunEpisodeRequest) -> common_pb2.Trajectory: ...


class GroupSink(Protocol):
    """Where complete groups go (the Redis sample buffer). `put` is idempotent by group id
    and may wait while the sink is full; an exception makes the scheduler retry."""

    async def put(self, group: common_pb2.Group) -> object: ...


def no_verdict_trajectory(request: sandbox_pb2.RunEpisodeRequest,
                          message: str,
                          cause: common_pb2.NoVerdictCause
                          = common_pb2.NO_VERDICT_CAUSE_SANDBOX_LOST) -> common_pb2.Trajectory:
    """The trajectory that stands for an episode whose RunEpisode call failed: the sandbox
    service (and with it the episode's sandbox) was lost, unless `cause` says otherwise."""
    return common_pb2.Trajectory(
        sample_id=request.sample_id, group_id=request.group_id, task_id=request.task_id,
        sample_index=request.sample_index, status=common_pb2.VERDICT_STATUS_NO_VERDICT,
        status_message=message, no_verdict_cause=cause,
    )


def call_failure_cause(exc: BaseException) -> common_pb2.NoVerdictCause:
    """The cause of a RunEpisode call that failed: past its deadline the agent timed out;
    anything else lost the sandbox service."""
    if isinstance(exc, DeadlineExceeded):
        return common_pb2.NO_VERDICT_CAUSE_AGENT_TIMEOUT
    return common_pb2.NO_VERDICT_CAUSE_SANDBOX_LOST


def generated_versions(trajectory: common_pb2.Trajectory) -> set[int]:
    """The distinct weight versions of the model-generated tokens of a trajectory (all of
    its segments)."""
    versions = {int(v) for v in trajectory.weight_versions if v >= 0}
    for segment in trajectory.segments:
        versions.update(int(v) for v in segment.weight_versions if v >= 0)
    return versions
