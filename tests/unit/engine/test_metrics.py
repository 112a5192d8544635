"""The engine's metrics: a bulk observation counts as that many single ones."""

from __future__ import annotations

from services.engine.metrics import EngineMetrics


def sample(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name))
    return float(line.rsplit(" ", 1)[1])


def test_bulk_observation_equals_single_ones() -> None:
    bulk, single = EngineMetrics("m"), EngineMetrics("m")
    bulk.observe("itl", 0.003, 5)
    bulk.observe("itl", 0.04)
    for _ in range(5):
        single.observe("itl", 0.003)
    single.observe("itl", 0.04)
    prefix = "sglang:inter_token_latency_seconds"
    for metrics in (bulk, single):
        text = metrics.render().decode()
        assert sample(text, f'{prefix}_count{{model_name="m"}}') == 6
        assert abs(sample(text, f'{prefix}_sum{{model_name="m"}}') - 0.055) < 1e-9
        assert sample(text, f'{prefix}_bucket{{le="0.0025",model_name="m"}}') == 0
        assert sample(text, f'{prefix}_bucket{{le="0.005",model_name="m"}}') == 5
        assert sample(text, f'{prefix}_bucket{{le="+Inf",model_name="m"}}') == 6
