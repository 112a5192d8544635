"""The router's Prometheus metrics (per target: engine url and dp rank)."""

from __future__ import annotations

from services.common import metrics
from services.router.targets import Target

_T = ("engine", "dp_rank")

IN_FLIGHT = metrics.gauge("riptide_router_in_flight", "generate calls in flight", _T)
REQUESTS = metrics.counter("riptide_router_requests_total", "generate calls by outcome",
                           (*_T, "outcome"))
PROMPT_TOKENS = metrics.counter("riptide_router_prompt_tokens_total",
                                "prompt tokens of served calls", _T)
CACHED_TOKENS = metrics.counter("riptide_router_cached_tokens_total",
                                "prompt tokens served from the engine's prefix cache", _T)
SPILLS = metrics.counter("riptide_router_spills_total",
                         "sessions moved off their sticky target because queueing cost more", _T)
RETRIES = metrics.counter("riptide_router_retries_total",
                          "calls retried on another target after this one was not reached", _T)
EJECTIONS = metrics.counter("riptide_router_ejections_total",
                            "times an engine was ejected by failed health checks", ("engine",))
CIRCUIT_OPENS = metrics.counter("riptide_router_circuit_opens_total",
                                "times a target's circuit breaker opened", _T)
ROUTABLE = metrics.gauge("riptide_router_routable", "1 when the target takes calls", _T)
ROUTING_LATENCY = metrics.histogram("riptide_router_routing_latency_seconds",
                                    "time to choose a target for a call")
CALL_LATENCY = metrics.histogram("riptide_router_call_latency_seconds",
                                 "engine-reported latency of served generate calls", _T)


def labels(target: Target) -> tuple[str, str]:
    return target.engine.url, str(target.dp_rank)


def forget(target: Target) -> None:
    """Drop a removed target's per-target series."""
    for metric in (IN_FLIGHT, ROUTABLE):
        try:
            metric.remove(*labels(target))
        except KeyError:
            pass
