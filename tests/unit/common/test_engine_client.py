"""The engine client against recorded SGLang response shapes (fixtures/sglang_0_5_23.json):
contract detection, weight version, load, server info, errors and weight-version spans, as
the rollout service and the router read them."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from services._proto.riptide.v1 import router_pb2
from services.common.engine_client import EngineCallError, EngineClient
from services.common.engine_contract import weight_version_spans
from services.rollout.config import FleetConfig
from services.rollout.fleet import EngineFleet
from services.rollout.router_link import NoRouter
from services.router.config import RouterConfig
from services.router.health import HealthChecker
from services.router.registry import EngineRegistry
from services.router.servicer import RouterServicer
from services.sandbox.model_client import GenerateResult
from services.sandbox.token_trace import TokenTrace

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "sglang_0_5_23.json").read_text())
URL = "http://engine:30000"


class Recorded(httpx.AsyncBaseTransport):
    """Answers from one fixture section; anything else is a 404, as FastAPI answers it."""

    def __init__(self, routes: dict[str, Any], status: dict[str, int] | None = None) -> None:
        self.routes, self.status = routes, status or {}
        self.seen: list[tuple[str, str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        key = f"{request.method} {request.url.path}"
        body = json.loads(request.content) if request.content else None
        self.seen.append((request.method, request.url.path, body))
        if key not in self.routes:
            return httpx.Response(404, json={"detail": "Not Found"})
        answer = self.routes[key]
        if answer is None:
            return httpx.Response(self.status.get(key, 200))
        return httpx.Response(self.status.get(key, 200), json=answer)


def client(section: str, **extra: Any) -> tuple[EngineClient, Recorded]:
    transport = Recorded({**FIXTURES[section], **extra.pop("routes", {})}, **extra)
    return EngineClient(transport=transport), transport


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_current_contract_facts() -> None:
    engines, seen = client("current")

    async def go() -> Any:
        contract = await engines.detect(URL)
        return (contract, await engines.server_info(URL), await engines.weight_version(URL),
                await engines.load(URL))

    contract, info, version, loads = run(go())
    assert (contract.mode, contract.sglang_version) == ("current", "0.5.23")
    assert contract.load_path == "/v1/loads" and info["tp_size"] == 2
    assert version == "7"
    assert [(x.dp_rank, x.num_reqs, x.num_waiting_reqs, x.num_tokens) for x in loads] == \
        [(0, 4, 1, 5120), (1, 0, 0, 0)]
    assert not any(path.startswith("/get_") for _, path, _ in seen.seen)


@pytest.mark.parametrize("section,version,load", [
    ("deprecated", "3", (0, 4, 2, 777)),
    ("oldest", "2", (0, 1, 0, 10)),
])
def test_deprecated_routes_are_the_fallback(section: str, version: str, load: tuple) -> None:
    engines, seen = client(section)

    async def go() -> Any:
        return (await engines.detect(URL), await engines.weight_version(URL),
                await engines.load(URL))

    contract, got_version, loads = run(go())
    assert contract.mode == "deprecated" and contract.load_path == "/get_load"
    assert got_version == version
    assert [(x.dp_rank, x.num_reqs, x.num_waiting_reqs, x.num_tokens) for x in loads] == [load]
    assert seen.seen[0][1] == "/model_info"  # the current route is tried first


@pytest.mark.parametrize("name", ["validation", "weights", "context"])
def test_control_errors_carry_the_engine_message(name: str) -> None:
    status, body = FIXTURES["errors"][name]
    route = "POST /update_weights_from_distributed"
    engines, _ = client("current", routes={route: body}, status={route: status})
    with pytest.raises(EngineCallError) as info:
        run(engines.update_weights(URL, names=["w"], dtypes=["bfloat16"], shapes=[[1]],
                                   group_name="g"))
    want = body["error"]["message"] if "error" in body else body["message"]
    assert want in str(info.value) and info.value.status == status


def test_control_calls_send_sglang_bodies() -> None:
    engines, seen = client("current")

    async def go() -> None:
        await engines.abort(URL, "s1-t0")  # an empty 200, as 0.5.23 answers
        await engines.pause(URL, "in_place")
        await engines.set_weight_version(URL, 8)
        await engines.resume(URL)

    run(go())
    bodies = {path: body for _, path, body in seen.seen}
    assert bodies["/abort_request"] == {"rid": "s1-t0"}
    # 0.5.23 aborts every request on a version bump unless told not to
    assert bodies["/update_weight_version"] == {"new_version": "8", "abort_all_requests": False}


def test_spans_give_per_token_versions_to_router_and_trajectory() -> None:
    reply = FIXTURES["current"]["POST /generate"]
    meta = reply["meta_info"]
    assert weight_version_spans(meta, 5) == ["7", "7", "7", "8", "8"]
    assert weight_version_spans({"weight_version": "4"}, 3) == ["4", "4", "4"]
    target = SimpleNamespace(engine=SimpleNamespace(url=URL), dp_rank=1)

    async def generate(session_key: str, body: dict[str, Any]) -> Any:
        return SimpleNamespace(body=reply, target=target, engine_latency_s=0.2)

    runtime = SimpleNamespace(generate=generate,
                              registry=SimpleNamespace(max_input_tokens=lambda: None))
    servicer = RouterServicer(runtime)  # type: ignore[arg-type]
    request = router_pb2.GenerateRequest(session_key="s1", input_ids=[1, 2], return_logprob=True)
    routed = run(servicer.Generate(request, None))  # type: ignore[arg-type]
    assert list(routed.output_weight_versions) == [7, 7, 7, 8, 8] and routed.weight_version == 8
    result = GenerateResult(list(routed.output_ids), list(routed.output_logprobs),
                            routed.finish_reason, routed.weight_version,
                            list(routed.output_weight_versions))
    trace = TokenTrace(prompt_ids=[1, 2])
    trace.add_model(result)
    trace.add_context([3])
    assert trace.weight_versions == [7, 7, 7, 8, 8, -1]
    single = GenerateResult([1, 2], [0.0, 0.0], "stop", 5)
    assert single.token_versions() == [5, 5]


def test_router_registry_and_health_read_the_current_contract() -> None:
    engines, _ = client("current")
    config = RouterConfig(engine_urls=[])
    registry = EngineRegistry(engines, weight_version=7, probe_timeout_s=1.0)
    health = HealthChecker(registry, config)

    async def go() -> Any:
        engine = await registry.register(URL)
        await health.check(engine)
        return engine

    engine = run(go())
    assert engine.dp_aware and [t.dp_rank for t in engine.targets] == [0, 1]
    assert engine.weight_version == "7"
    assert [t.reported_tokens for t in engine.targets] == [5120, 0]


def polled_fleet_member(engines: Any) -> Any:
    """The one member of an attach fleet over `engines`, after one health poll."""
    fleet = EngineFleet(FleetConfig(kind="attach", attach_urls=[URL], health_interval_s=60),
                        engines, NoRouter(), weight_version=7)

    async def go() -> Any:
        await fleet.start()
        await fleet._poll(fleet.members[0])
        await fleet.stop()
        return fleet.members[0]

    return run(go())


def test_rollout_fleet_reads_the_current_contract() -> None:
    engines, _ = client("current")
    member = polled_fleet_member(engines)
    assert member.ranks == 2 and member.state == "ready"
    assert [rank["num_reqs"] for rank in member.load] == [4, 0]


def test_an_engine_that_comes_back_older_is_learned_again() -> None:
    engines, seen = client("current")

    async def go() -> Any:
        assert (await engines.detect(URL)).mode == "current"
        seen.routes = FIXTURES["deprecated"]  # restarted at the same address, older
        return await engines.weight_version(URL), engines.contracts[URL].mode

    assert run(go()) == ("3", "deprecated")


def test_every_call_carries_the_engines_key() -> None:
    headers: list[str | None] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        headers.append(request.headers.get("authorization"))
        return httpx.Response(200, json={"text": "", "meta_info": {}})

    async def go(api_key: str | None) -> None:
        engines = EngineClient(transport=httpx.MockTransport(answer), api_key=api_key)
        await engines.pause(URL, "retract")
        await engines.abort(URL)
        await engines.healthy(URL)
        await engines.close()

    run(go("the-engine-key"))
    assert headers == ["Bearer the-engine-key"] * 3
    headers.clear()
    run(go(None))
    assert headers == [None] * 3


def test_an_engine_without_v1_loads_is_polled_on_get_load() -> None:
    """Current info routes do not promise /v1/loads: the load falls back on its own route,
    and the fallback is remembered (one 404 in all, then /get_load directly)."""
    routes = {k: v for k, v in FIXTURES["current"].items() if k != "GET /v1/loads"}
    routes["GET /get_load"] = FIXTURES["deprecated"]["GET /get_load"]
    engines, seen = client("current")
    seen.routes = routes

    async def go() -> Any:
        first = await engines.load(URL)
        return first, await engines.load(URL), await engines.weight_version(URL)

    first, second, version = run(go())
    assert [(x.dp_rank, x.num_reqs, x.num_tokens) for x in first] == [(0, 4, 777)]
    assert second == first and version == "7"
    contract = engines.contracts[URL]
    assert (contract.mode, contract.model_info_path, contract.load_path) == \
        ("current", "/model_info", "/get_load")
    loads = [path for _, path, _ in seen.seen if path in ("/v1/loads", "/get_load")]
    assert loads == ["/v1/loads", "/v1/loads", "/get_load", "/get_load"]


def test_an_engine_serving_no_load_route_says_so() -> None:
    routes = {k: v for k, v in FIXTURES["current"].items() if k != "GET /v1/loads"}
    engines, seen = client("current")
    seen.routes = routes
    with pytest.raises(EngineCallError) as info:
        run(engines.load(URL))
    assert info.value.status == 404
    assert "serves none of /v1/loads, /get_load" in str(info.value)
    assert engines.contracts[URL].load_path == "/v1/loads"  # nothing wrong learned


def test_rollout_fleet_keeps_an_engine_that_serves_no_load_route() -> None:
    """An engine that answers /health but no load route is up (the router reports its
    missing load signal); the fleet neither marks it unreachable nor restarts it."""
    routes = {k: v for k, v in FIXTURES["current"].items() if k != "GET /v1/loads"}
    engines, seen = client("current")
    seen.routes = routes
    member = polled_fleet_member(engines)
    assert member.state == "ready" and member.load is None
