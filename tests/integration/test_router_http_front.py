"""The router's SGLang-compatible HTTP front with simulated engines: routing keys from the
headers sglang-router clients send, SGLang fields passed through untouched (HTTP and gRPC),
errors with SGLang's shape and status codes."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import httpx
import pytest

from services._proto.riptide.v1 import common_pb2, router_pb2
from services.testing.router_process import RouterProcess
from services.testing.sim_engine_process import SimEngineProcess, start_sim_engines

pytestmark = pytest.mark.slow

# Fields the gRPC API has no field for; the engine must receive them as sent.
PASS_THROUGH = {"logprob_start_len": 3, "top_logprobs_num": 2, "lora_path": "adapter-a",
                "return_text_in_logprobs": True, "custom_labels": {"team": "rl"},
                "bootstrap_room": 7}
SAMPLING_EXTRA = {"frequency_penalty": 0.5, "presence_penalty": 0.25, "min_new_tokens": 2,
                  "regex": "[a-z]+", "json_schema": None, "stop_regex": ["x+"]}


@pytest.fixture(scope="module")
def engines() -> Iterator[list[SimEngineProcess]]:
    started = start_sim_engines(3, decode_s_per_token=0.0005)
    try:
        yield started
    finally:
        for engine in started:
            engine.stop()


@pytest.fixture(scope="module")
def router(engines: list[SimEngineProcess]) -> Iterator[RouterProcess]:
    with RouterProcess(engine_urls=[e.url for e in engines], http_front=True) as proc:
        yield proc


def ids(n: int = 120) -> list[int]:
    return [random.randrange(32000) for _ in range(n)]


def received(engines: list[SimEngineProcess], rid: str) -> dict:  # type: ignore[type-arg]
    """The /generate body with this rid, as the engine that served it last received one."""
    return next(b for b in (e.last_request() for e in engines) if b.get("rid") == rid)


@pytest.mark.parametrize("how", ["x-smg-routing-key", "x-session-id", "routing_key"])
def test_every_routing_key_source_keeps_a_session_on_one_engine(
        router: RouterProcess, how: str) -> None:
    prompt, cached = ids(), []
    for _ in range(4):
        body: dict[str, object] = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 8}}
        headers = {}
        if how == "routing_key":
            body["routing_key"] = f"json-{how}"
        else:
            headers[how] = f"header-{how}"
        reply = httpx.post(f"{router.http_url}/generate", json=body, headers=headers, timeout=30)
        assert reply.status_code == 200, reply.text
        meta = reply.json()["meta_info"]
        cached.append(meta["cached_tokens"] >= len(prompt) - 10)
        prompt = prompt + reply.json()["output_ids"] + ids(10)
    assert all(cached[1:])  # three engines: only stickiness hits on every later turn


def test_sglang_fields_reach_the_engine_untouched(
        router: RouterProcess, engines: list[SimEngineProcess]) -> None:
    body = {"input_ids": ids(), "rid": "marker-http", **PASS_THROUGH,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, **SAMPLING_EXTRA}}
    reply = httpx.post(f"{router.http_url}/generate", json=body,
                       headers={"X-SMG-Routing-Key": "pass"}, timeout=30)
    assert reply.status_code == 200, reply.text
    assert received(engines, "marker-http") == body

    fields = {**PASS_THROUGH, "sampling_params": SAMPLING_EXTRA}
    request = router_pb2.GenerateRequest(
        session_key="pass-grpc", input_ids=body["input_ids"], request_id="marker-grpc",
        sampling_params=common_pb2.SamplingParams(max_new_tokens=4, temperature=0.5),
        sglang_fields_json=json.dumps(fields))
    router.stub().Generate(request, timeout=30)
    seen = received(engines, "marker-grpc")
    assert {k: seen[k] for k in PASS_THROUGH} == PASS_THROUGH
    assert seen["sampling_params"] == {"temperature": 0.5, "max_new_tokens": 4, **SAMPLING_EXTRA}


def test_info_routes_and_precise_errors(router: RouterProcess) -> None:
    base = router.http_url
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/get_model_info").json()["model_path"] == "sim"
    assert httpx.get(f"{base}/get_server_info").json()["dp_size"] == 1
    models = httpx.get(f"{base}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "sim"
    bad = httpx.post(f"{base}/generate", content=b"{not json")
    assert bad.status_code == 400 and "not JSON" in bad.json()["message"]
    empty = httpx.post(f"{base}/generate", json={"sampling_params": {}})
    assert empty.status_code == 400 and "text or input_ids" in empty.json()["message"]
    rejected = httpx.post(f"{base}/generate", json={"input_ids": []})
    assert rejected.status_code == 400 and "input_ids" in rejected.json()["message"]
    ended = httpx.post(f"{base}/end_session", json={"session_key": "header-x-session-id"})
    assert ended.json() == {"known": True}


@pytest.mark.parametrize("stream", [False, True])
def test_oversized_keys_and_prompts_are_refused_before_routing(
        router: RouterProcess, stream: bool) -> None:
    """The same bounds as gRPC Generate: a session key of at most 256 printable characters
    from any source, and no prompt longer than the engines' max_req_input_len (the sim's
    2^20), refused at once with 400 and a message that quotes a prefix at most."""
    base, body = router.http_url, {"input_ids": [1, 2], "stream": stream}
    for headers, extra in (({"X-SMG-Routing-Key": "k" * 10_000}, {}),
                           ({"X-Session-ID": "k" * 300}, {}),
                           ({}, {"routing_key": "k" * 100_000})):
        refused = httpx.post(f"{base}/generate", json={**body, **extra}, headers=headers)
        assert refused.status_code == 400, refused.text[:200]
        assert "session key: at most 256 printable characters" in refused.json()["message"]
        assert len(refused.text) < 400
    huge = {**body, "input_ids": [5] * ((1 << 20) + 1)}
    refused = httpx.post(f"{base}/generate", json=huge, timeout=30)
    assert refused.status_code == 400 and refused.json()["message"] == (
        "input_ids: 1048577 tokens, more than the model's context takes (1048576 prompt "
        "tokens at most, as the engines report)")
    long_end = httpx.post(f"{base}/end_session", json={"session_key": "k" * 5000})
    assert long_end.status_code == 400 and len(long_end.text) < 400


def test_front_wants_the_api_key_where_one_is_set(engines: list[SimEngineProcess]) -> None:
    key = "front-key-1234"
    with RouterProcess(engine_urls=[e.url for e in engines], http_front=True,
                       engine_api_key=key) as keyed:
        base = keyed.http_url
        body = {"input_ids": ids(20), "sampling_params": {"max_new_tokens": 2}}
        assert httpx.get(f"{base}/health").status_code == 200  # probes need no secret
        for headers in ({}, {"Authorization": "Bearer wrong-key-99"}, {"Authorization": key}):
            refused = httpx.post(f"{base}/generate", json=body, headers=headers, timeout=30)
            assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
            assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 401
        auth = {"Authorization": f"Bearer {key}"}
        served = httpx.post(f"{base}/generate", json=body, headers=auth, timeout=30)
        assert served.status_code == 200, served.text
        assert httpx.get(f"{base}/v1/models", headers=auth).json()["data"][0]["id"] == "sim"


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_front_serves_plain_and_streamed_calls_on_either_event_loop(
        engines: list[SimEngineProcess], event_loop: str) -> None:
    # uvloop's transports are no subclasses of asyncio's: the front and the engine client
    # must not care (they refused every connection on uvloop when they checked the type).
    with RouterProcess(engine_urls=[e.url for e in engines], http_front=True,
                       event_loop=event_loop) as proc:
        assert proc.admin.get("/admin/state").json()["details"]["event_loop"] == event_loop
        body = {"input_ids": ids(40), "sampling_params": {"max_new_tokens": 3}}
        plain = httpx.post(f"{proc.http_url}/generate", json=body, timeout=30)
        assert plain.status_code == 200 and len(plain.json()["output_ids"]) == 3, plain.text
        with httpx.stream("POST", f"{proc.http_url}/generate", json={**body, "stream": True},
                          headers={"X-SMG-Routing-Key": "s"}, timeout=30) as streamed:
            lines = [line for line in streamed.iter_lines() if line]
        # The simulated engine answers a streamed call in one JSON body; the front relays it.
        assert streamed.status_code == 200 and streamed.headers["content-type"].startswith(
            "text/event-stream")
        assert json.loads(lines[-1].removeprefix("data: "))["meta_info"]["completion_tokens"] == 3


def test_router_defaults_to_uvloop(router: RouterProcess) -> None:
    assert router.admin.get("/admin/state").json()["details"]["event_loop"] == "uvloop"
