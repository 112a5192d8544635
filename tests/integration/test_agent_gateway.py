"""The agent gateway against a real router and a real built-in engine, driven by OpenAI's own
Python client: what it records is exactly what the engine saw and sampled."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from services._proto.riptide.v1 import common_pb2
from services.sandbox.engine_model_client import EngineModelClient
from services.sandbox.gateway.server import AgentGateway
from services.sandbox.gateway.session import SessionLimits
from services.sandbox.model_client import RouterModelClient
from services.sandbox.token_trace import TokenTrace
from services.testing.engine_process import EngineProcess, tiny_model_path
from services.testing.router_process import RouterProcess

pytestmark = pytest.mark.slow
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_new_tokens=8)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[EngineProcess, RouterProcess]]:
    with EngineProcess(tiny_model_path()) as engine, \
            RouterProcess(grpc_token="gateway-test-token", http_front=True) as router:
        router.register(engine.url)
        yield engine, router


def run_with_gateway(router: RouterProcess, scenario: Any, transport: str = "http") -> Any:
    """`scenario(gateway)` on a gateway that reaches the router by its HTTP front (as where
    the deployment serves one) or by gRPC's Router.Generate."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path())

    async def main() -> Any:
        model: Any = (EngineModelClient(router.http_url, routed=True) if transport == "http"
                      else RouterModelClient(router.address, router.grpc_token))
        gateway = AgentGateway(model, tokenizer, "riptide", "127.0.0.1", 0)
        await gateway.start()
        try:
            return await scenario(gateway)
        finally:
            await gateway.stop()
            await model.close()

    return asyncio.run(main())


def open_session(gateway: AgentGateway, episode: str, max_context: int = 2048) -> Any:
    session = gateway.open(episode, GREEDY, SessionLimits(
        max_calls=10, max_context_tokens=max_context, max_new_tokens=8,
        deadline=time.monotonic() + 120))
    client = openai.AsyncOpenAI(base_url=gateway.base_url(episode), api_key=session.key,
                                max_retries=0, timeout=60)
    return session, client


def generated_runs(segment: TokenTrace) -> list[tuple[int, int]]:
    """(start, end) positions in segment.ids of each model turn (loss mask 1)."""
    p, runs, start = len(segment.prompt_ids), [], None
    for i, m in enumerate([*segment.loss_mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((p + start, p + i))
            start = None
    return runs


@pytest.mark.parametrize("transport", ["http", "grpc"])
def test_a_multi_turn_chat_records_exactly_what_the_engine_saw_and_sampled(
        stack: tuple[EngineProcess, RouterProcess], transport: str) -> None:
    engine, router = stack

    async def scenario(gateway: AgentGateway) -> Any:
        session, client = open_session(gateway, "ep-chat")
        models = await client.models.list()
        history: list[dict[str, Any]] = [{"role": "system", "content": "You are terse."},
                                         {"role": "user", "content": "List the files."}]
        for turn in range(3):
            reply = await client.chat.completions.create(model="riptide", messages=history,
                                                         max_tokens=6, temperature=1.3)
            assert reply.usage is not None and reply.usage.completion_tokens >= 1
            history += [{"role": "assistant", "content": reply.choices[0].message.content},
                        {"role": "user", "content": f"Output of turn {turn}: ok"}]
        stream = await client.chat.completions.create(
            model="riptide", messages=history, max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        gateway.close("ep-chat")
        return models, session, chunks

    models, session, chunks = run_with_gateway(router, scenario, transport)
    assert [m.id for m in models.data] == ["riptide"]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert session.turns[-1]["assistant"] == streamed
    (segment,) = session.trace.segments  # the history came back unchanged: one segment
    runs = generated_runs(segment)
    assert len(runs) == 4
    assert session.prompt_tokens == sum(start for start, _ in runs)  # the engine's own counts
    end_of_turn = session.renderer.tokenizer.eos_token_id
    for start, end in runs:  # the engine, given exactly our prefix, samples exactly our ids
        again = engine.generate(segment.ids[:start], return_logprob=True, sampling_params={
            "temperature": 0.0, "max_new_tokens": end - start, "stop_token_ids": [end_of_turn]})
        assert again["output_ids"] == segment.ids[start:end]
        logprobs = [lp[0] for lp in again["meta_info"]["output_token_logprobs"]]
        offset = start - len(segment.prompt_ids)
        assert logprobs == pytest.approx(segment.logprobs[offset:offset + end - start],
                                         abs=1e-5)


def test_a_rewritten_history_opens_a_segment_and_plain_completions_work(
        stack: tuple[EngineProcess, RouterProcess]) -> None:
    _, router = stack

    async def scenario(gateway: AgentGateway) -> Any:
        session, client = open_session(gateway, "ep-rewrite")
        history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
        reply = await client.chat.completions.create(model="riptide", messages=history)
        history += [{"role": "assistant", "content": "(summarized) " +
                     (reply.choices[0].message.content or "")},
                    {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="riptide", messages=history)
        text = await client.completions.create(model="riptide", prompt="echo hi", max_tokens=4)
        gateway.close("ep-rewrite")
        return session, text

    session, text = run_with_gateway(router, scenario)
    assert [s.cause for s in session.trace.segments] == ["", "history_rewritten",
                                                         "prompt_rewritten"]
    assert text.choices[0].text == session.turns[-1]["assistant"]
    for segment in session.trace.segments:
        assert sum(segment.loss_mask) >= 1 and segment.prompt_ids
    assert session.stats.segments_opened == {"history_rewritten": 1, "prompt_rewritten": 1}


def test_keys_die_with_their_episode_and_open_no_other(
        stack: tuple[EngineProcess, RouterProcess]) -> None:
    _, router = stack

    async def scenario(gateway: AgentGateway) -> list[str]:
        one, client_one = open_session(gateway, "ep-one")
        two, _ = open_session(gateway, "ep-two", max_context=64)
        outcomes = []
        hello = [{"role": "user", "content": "hi"}]
        for key, episode in (("wrong", "ep-one"), (two.key, "ep-one"), (one.key, "ep-nope")):
            client = openai.AsyncOpenAI(base_url=gateway.base_url(episode), api_key=key,
                                        max_retries=0)
            try:
                await client.chat.completions.create(model="riptide", messages=hello)
            except openai.AuthenticationError as exc:
                outcomes.append(f"401 {exc.code}")
        _, client_two = open_session(gateway, "ep-three", max_context=64)
        try:
            await client_two.chat.completions.create(
                model="riptide", messages=[{"role": "user", "content": "x" * 200}])
        except openai.BadRequestError as exc:
            outcomes.append(f"400 {exc.code}")
        gateway.close("ep-one")
        try:
            await client_one.chat.completions.create(model="riptide", messages=hello)
        except openai.AuthenticationError:
            outcomes.append("401 after close")
        outcomes.append(f"calls {one.num_calls} {two.num_calls}")
        return outcomes

    assert run_with_gateway(router, scenario) == [
        "401 invalid_api_key", "401 invalid_api_key", "401 invalid_api_key",
        "400 context_length_exceeded", "401 after close", "calls 0 0"]
