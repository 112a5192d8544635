"""Names of the causes of a missing verdict (`NoVerdictCause`), shared by every service.

Metrics labels, event attrs, drop counts and the dashboard all use the short name
(`agent_timeout`); a trajectory without a verdict and without a cause is `unspecified`.
"""

from __future__ import annotations

from services._proto.riptide.v1 import common_pb2


def cause_name(cause: int) -> str:
    """The short name of a cause (`NO_VERDICT_CAUSE_AGENT_TIMEOUT` -> `agent_timeout`)."""
    name = common_pb2.NoVerdictCause.Name(cause)  # type: ignore[arg-type]
    return name.removeprefix("NO_VERDICT_CAUSE_").lower()


#: Every cause's short name, in enum order (`unspecified` first).
CAUSE_NAMES = tuple(cause_name(v) for v in common_pb2.NoVerdictCause.values())


def trajectory_cause(trajectory: common_pb2.Trajectory) -> str | None:
    """The short cause name of a trajectory without verdict; None when it was scored."""
    if trajectory.status == common_pb2.VERDICT_STATUS_SCORED:
        return None
    return cause_name(trajectory.no_verdict_cause)
