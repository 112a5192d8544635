"""The router in front of real built-in engine processes (tiny model): sticky sessions hit the
engine's radix cache, dp ranks are honoured, log-probs and weight versions come through."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.router_process import RouterProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def builtin_engines() -> Iterator[list[EngineProcess]]:
    model = tiny_model_path()
    engines = [EngineProcess(model)]
    try:
        engines.append(EngineProcess(model, dp_size=2))
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def test_router_serves_multi_turn_sessions_from_builtin_engines(
        builtin_engines: list[EngineProcess]) -> None:
    with RouterProcess() as router:
        assert [router.register(e.url) for e in builtin_engines] == [[0], [0, 1]]
        homes = set()
        for s in range(3):
            ids = [(7 * s + i) % 200 + 3 for i in range(40)]
            first = None
            for turn in range(3):
                reply = router.generate(f"b-{s}", ids, max_new_tokens=6, timeout_s=120,
                                        return_logprob=True, temperature=1.0, ignore_eos=True)
                target = (reply.engine_url, reply.dp_rank)
                first = first or target
                assert target == first
                assert len(reply.output_logprobs) == len(reply.output_ids) == 6
                assert all(lp <= 0 for lp in reply.output_logprobs)
                if turn:
                    assert reply.cached_tokens >= len(ids) - 5
                ids = ids + list(reply.output_ids) + [5, 6, 7]
            homes.add(first)
        assert len(homes) == 3  # three sessions, three least-loaded targets

