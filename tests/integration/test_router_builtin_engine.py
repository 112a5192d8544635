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



def test_http_front_serves_an_sglang_router_client(builtin_engines: list[EngineProcess]) -> None:
    """What a client of sglang-router sends: X-SMG-Routing-Key, text and ids, streaming."""
    import httpx
    import orjson

    with RouterProcess(engine_urls=[e.url for e in builtin_engines], http_front=True) as router:
        base = router.http_url
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        assert model and httpx.get(f"{base}/get_server_info", timeout=10).json()["dp_size"]
        params = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        headers = {"X-SMG-Routing-Key": "client-1"}
        text = "the quick brown fox jumps over the lazy dog " * 4
        first = httpx.post(f"{base}/generate", headers=headers, timeout=120,
                           json={"text": text, "sampling_params": params}).json()
        assert first["text"] and len(first["output_ids"]) == 6
        again = httpx.post(f"{base}/generate", headers=headers, timeout=120,
                           json={"text": text + first["text"], "sampling_params": params}).json()
        prompt = first["meta_info"]["prompt_tokens"]
        assert again["meta_info"]["cached_tokens"] >= prompt - 2  # sticky: the prefix is cached

        ids = [(5 * i) % 200 + 3 for i in range(30)]
        chunks = []
        with httpx.stream("POST", f"{base}/generate", timeout=120,
                          headers={"X-Session-ID": "client-2"},
                          json={"input_ids": ids, "sampling_params": params, "stream": True,
                                "return_logprob": True}) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in streamed.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        chunks = [orjson.loads(line[len("data: "):]) for line in lines[:-1]]
        assert all(line.startswith("data: ") for line in lines) and len(chunks) >= 2
        last = chunks[-1]
        assert len(last["output_ids"]) == 6 and last["meta_info"]["finish_reason"]
        assert len(last["meta_info"]["output_token_logprobs"]) == 6
        served = sum(t["requests"] for t in router.targets())
        assert served == 3  # the streamed call was counted when its stream ended
