"""Prometheus helpers: metrics created once per process, rendered for /metrics."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest
from prometheus_client.registry import CollectorRegistry

_Metric = TypeVar("_Metric", Counter, Gauge, Histogram)
_lock = threading.Lock()
_created: dict[str, object] = {}

#: Buckets for latencies from sub-millisecond routing to minute-long episodes.
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                     2.5, 5, 10, 30, 60, 120, 300, 600)


def _get_or_create(kind: type[_Metric], name: str, make: Callable[[], _Metric]) -> _Metric:
    with _lock:
        existing = _created.get(name)
        if existing is None:
            existing = make()
            _created[name] = existing
        if not isinstance(existing, kind):
            raise TypeError(f"metric {name} already exists as {type(existing).__name__}")
        return existing


def counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    """A process-wide counter; asking twice for the same name returns the same metric."""
    return _get_or_create(Counter, name, lambda: Counter(name, doc, list(labels)))


def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
    """A process-wide gauge."""
    return _get_or_create(Gauge, name, lambda: Gauge(name, doc, list(labels)))


def histogram(name: str, doc: str, labels: Sequence[str] = (),
              buckets: Sequence[float] = LATENCY_BUCKETS_S) -> Histogram:
    """A process-wide histogram (latency buckets by default)."""
    return _get_or_create(
        Histogram, name, lambda: Histogram(name, doc, list(labels), buckets=tuple(buckets)))


def render(registry: CollectorRegistry = REGISTRY) -> bytes:
    """The Prometheus text exposition of every metric of this process."""
    return generate_latest(registry)
