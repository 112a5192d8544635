"""Prometheus metrics under SGLang's names, in a registry of their own."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


class EngineMetrics:
    """The engine's counters, gauges (per dp rank) and latency histograms."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._children: dict[str, Any] = {}
        labels = ["model_name"]
        rank_labels = ["model_name", "dp_rank"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"sglang:{name}", doc, rank_labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"sglang:{name}", doc, labels, registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"sglang:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
            )

        self.num_running_reqs = gauge("num_running_reqs", "requests in the running batch")
        self.num_queue_reqs = gauge("num_queue_reqs", "requests waiting to be scheduled")
        self.num_used_tokens = gauge("num_used_tokens", "KV tokens held by running requests")
        self.token_usage = gauge("token_usage", "used / max_total_num_tokens")
        self.gen_throughput = gauge("gen_throughput", "generated tokens per second, recent")
        self.cache_hit_rate = gauge("cache_hit_rate", "cached / prompt tokens of the last prefill")
        self.num_retracted_reqs = gauge("num_retracted_reqs", "requests retracted, waiting")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV token capacity per rank")
        self.num_grammar_queue_reqs = gauge(
            "num_grammar_queue_reqs", "requests waiting for a grammar (none: grammars are refused)"
        )
        self.num_running_reqs_offline_batch = gauge(
            "num_running_reqs_offline_batch", "running low-priority batch requests (none here)"
        )
        self.num_paused_reqs = gauge("num_paused_reqs", "requests frozen by an in-place pause")
        self.utilization = gauge("utilization", "used / max_total_num_tokens of the batch")
        self.engine_startup_time = gauge("engine_startup_time", "seconds to load and start")
        self.engine_load_weights_time = gauge(
            "engine_load_weights_time", "seconds the newest weight load took"
        )
        self.num_retracted_requests = counter("num_retracted_requests", "requests retracted")
        self.queue_time = histogram("queue_time_seconds", "time from arrival to first prefill")
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens prefilled")
        self.generation_tokens = counter("generation_tokens", "tokens generated")
        self.cached_tokens = counter("cached_tokens", "prompt tokens served from the prefix cache")
        self.num_requests = counter("num_requests", "requests finished")
        self.num_aborted_requests = counter("num_aborted_requests", "requests aborted")
        self.ttft = histogram("time_to_first_token_seconds", "time to first token")
        self.itl = histogram("inter_token_latency_seconds", "time between output tokens")
        self.e2e = histogram("e2e_request_latency_seconds", "request latency end to end")

    def set_rank(self, dp_rank: int, **values: float) -> None:
        """Set the per-rank gauges named in `values`."""
        for name, value in values.items():
            getattr(self, name).labels(self.model_name, str(dp_rank)).set(value)

    def count(self, name: str, amount: float = 1.0) -> None:
        if amount:
            self._child(name).inc(amount)

    def observe(self, name: str, seconds: float, count: int = 1) -> None:
        """Observe `seconds` `count` times (one lock and bucket search, as SGLang does)."""
        child = self._child(name)
        if count == 1:
            child.observe(seconds)
            return
        # prometheus_client observes one value at a time; a decode step has many equal ones.
        child._sum.inc(seconds * count)
        for index, bound in enumerate(child._upper_bounds):
            if seconds <= bound:
                child._buckets[index].inc(count)
                break

    def _child(self, name: str) -> Any:
        """The model's labelled series of `name`, looked up once (decode calls it per token)."""
        child = self._children.get(name)
        if child is None:
            child = self._children[name] = getattr(self, name).labels(self.model_name)
        return child

    def render(self) -> bytes:
        return generate_latest(self.registry)
