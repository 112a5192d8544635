"""The router's Prometheus metrics (per target: engine url and dp rank)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

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
LOAD_SIGNAL = metrics.gauge(
    "riptide_router_load_signal", "1 while the engine's load reads arrive; 0: no load signal "
    "(none of its last unhealthy_after_failures reads answered while /health did)",
    ("engine",))
LOAD_READ_FAILURES = metrics.counter(
    "riptide_router_load_read_failures_total",
    "load reads (/v1/loads or /get_load) of a healthy engine that got no load", ("engine",))
ROUTABLE = metrics.gauge("riptide_router_routable", "1 when the target takes calls", _T)
ROUTING_LATENCY = metrics.histogram("riptide_router_routing_latency_seconds",
                                    "time to choose a target for a call")
CALL_LATENCY = metrics.histogram("riptide_router_call_latency_seconds",
                                 "engine-reported latency of served generate calls", _T)


def labels(target: Target) -> tuple[str, str]:
    return target.engine.url, str(target.dp_rank)


@dataclass(frozen=True)
class Series:
    """A target's series that every call touches, looked up once (a `labels()` lookup costs
    about as much as the rest of the update)."""

    in_flight: Any
    served: Any
    prompt_tokens: Any
    cached_tokens: Any
    call_latency: Any


_SERIES: weakref.WeakKeyDictionary[Target, Series] = weakref.WeakKeyDictionary()


def series(target: Target) -> Series:
    found = _SERIES.get(target)
    if found is None:
        names = labels(target)
        found = _SERIES[target] = Series(
            IN_FLIGHT.labels(*names), REQUESTS.labels(*names, "ok"),
            PROMPT_TOKENS.labels(*names), CACHED_TOKENS.labels(*names),
            CALL_LATENCY.labels(*names))
    return found


def forget(target: Target) -> None:
    """Drop a removed target's per-target series (and its engine's)."""
    _SERIES.pop(target, None)
    for metric, names in ((IN_FLIGHT, labels(target)), (ROUTABLE, labels(target)),
                          (LOAD_SIGNAL, (target.engine.url,))):
        try:
            metric.remove(*names)
        except KeyError:
            pass
