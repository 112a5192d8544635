"""The [router] section of the deployment config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from services.common.config import ServiceConfig
from services.common.event_loop import EventLoopName

PolicyName = Literal["sticky_min_load", "manual", "consistent_hash", "min_load", "round_robin"]


class RouterConfig(ServiceConfig):
    """Settings of the router service."""

    grpc_port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    admin_port: int = Field(8051, ge=0, le=65535, description="admin REST port (0: a free one)")
    http_port: int | None = Field(
        None, ge=0, le=65535, description="port of the SGLang-compatible HTTP front (POST "
        "/generate, /health, /v1/models ...); 0 picks a free one; unset: no HTTP front")
    event_loop: EventLoopName = Field(
        "uvloop", description="uvloop (default): less CPU per call on the hot path than "
        "asyncio's loop (bench/router.py's overhead bench); asyncio: the standard library's")
    engine_urls: list[str] = Field(
        default_factory=list, description="engines to register at start (rollout adds more)")

    policy: PolicyName = Field("sticky_min_load", description="routing policy (live-tunable)")
    reprefill_s_per_1k_tokens: float = Field(
        0.05, ge=0, le=3600,
        description="sticky_min_load: engines' time to prefill 1k uncached tokens; a session "
        "moves for load only when queueing at home costs more than this for its cached context")
    min_calls_between_moves: int = Field(
        8, ge=1, le=1_000_000,
        description="sticky_min_load: a session moves for load at most once per this many of "
        "its calls")
    session_idle_s: float = Field(
        300.0, gt=0, le=86_400,
        description="sticky_min_load counts a session as live on its target until EndSession "
        "or until it has made no call for this long (a safety net: set above the longest "
        "tool time)")
    max_sticky_sessions: int = Field(
        200_000, ge=1, le=100_000_000,
        description="sessions remembered by sticky_min_load (least recent go)")
    num_virtual_nodes: int = Field(
        160, ge=1, le=10_000, description="consistent_hash: points on the ring per target")

    health_interval_s: float = Field(
        2.0, gt=0, le=3600, description="period of /health checks")
    health_timeout_s: float = Field(
        2.0, gt=0, le=3600, description="timeout of one health check")
    readmit_probe_interval_s: float = Field(
        0.1, gt=0, le=3600, description="period of the health checks of an ejected engine "
        "(so one that is back takes calls again within a fraction of health_interval_s)")
    unhealthy_after_failures: int = Field(
        3, ge=1, le=10_000, description="consecutive failed health checks that eject a target")
    healthy_after_successes: int = Field(
        2, ge=1, le=10_000,
        description="consecutive passed health checks that re-admit an ejected one")
    circuit_open_after_failures: int = Field(
        5, ge=1, le=10_000,
        description="consecutive failed calls that open a target's circuit breaker")
    circuit_open_s: float = Field(
        10.0, gt=0, le=86_400,
        description="how long an open circuit takes no calls before one trial call")

    connect_timeout_s: float = Field(2.0, gt=0, description="connecting to an engine")
    generate_timeout_s: float = Field(
        900.0, gt=0, description="one /generate call, from sending to the last byte")
    max_retries: int = Field(
        2, ge=0, le=100,
        description="retries on other targets of calls that never reached an engine")
    wait_for_target_s: float = Field(
        30.0, ge=0, le=86_400,
        description="how long a call waits for a routable target before failing")
    max_connections: int = Field(
        2048, ge=1, le=1_000_000, description="pooled HTTP connections to all engines together")
    drain_timeout_s: float = Field(
        600.0, gt=0, description="deregister with drain: longest wait for in-flight calls")
    initial_weight_version: int | None = Field(
        None, description="weight version engines must report before they are routable; "
        "unset: any, until the first SetWeightVersion")

    @model_validator(mode="after")
    def _check_timeouts(self) -> RouterConfig:
        if self.health_timeout_s > self.health_interval_s * 4:
            raise ValueError(
                "health_timeout_s is more than 4x health_interval_s: lower the timeout "
                "or raise the interval")
        return self


#: Fields `PATCH /admin/config` may change while the router runs.
TUNABLE_FIELDS = frozenset({
    "policy", "reprefill_s_per_1k_tokens", "min_calls_between_moves", "session_idle_s",
    "num_virtual_nodes",
    "health_interval_s", "health_timeout_s", "readmit_probe_interval_s",
    "unhealthy_after_failures",
    "healthy_after_successes", "circuit_open_after_failures", "circuit_open_s", "max_retries",
    "wait_for_target_s",
})
