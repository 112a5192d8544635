"""The gateway's client to the router's HTTP front: the request it sends and the result it reads
(token ids, log-probs and each token's weight version), without a server."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest

from services._proto.riptide.v1 import common_pb2
from services.common.errors import InvalidRequest
from services.sandbox.engine_model_client import EngineModelClient
from services.sandbox.model_client import GenerateResult


class CannedFront(EngineModelClient):
    """Answers every /generate with `meta_info` and one output token per log-prob."""

    def __init__(self, output_ids: list[int], meta: dict[str, Any]) -> None:
        super().__init__("http://127.0.0.1:1", routed=True)
        logprobs = [[-0.5 * (i + 1), t, None] for i, t in enumerate(output_ids)]
        meta_info: dict[str, Any] = {"output_token_logprobs": logprobs, **meta}
        self.reply = {"output_ids": output_ids, "meta_info": meta_info}
        self.bodies: list[dict[str, Any]] = []

    async def _post(self, path: str, payload: bytes) -> tuple[int, bytes]:
        self.bodies.append(orjson.loads(payload))
        return 200, orjson.dumps(self.reply)


def generate(client: EngineModelClient, sampling: common_pb2.SamplingParams) -> GenerateResult:
    return asyncio.run(client.generate("ep-1", [1, 2, 3], sampling))


def test_each_token_gets_the_version_of_the_span_it_was_generated_in() -> None:
    spans = [{"version": "7", "start": 0, "end": 2}, {"version": "8", "start": 2, "end": 2}]
    client = CannedFront([5, 6, 7, 8], {"weight_version": "8", "weight_versions": spans,
                                        "finish_reason": {"type": "stop"}, "prompt_tokens": 3})
    result = generate(client, common_pb2.SamplingParams(max_new_tokens=4))
    assert result.output_ids == [5, 6, 7, 8] and result.finish_reason == "stop"
    assert result.output_logprobs == pytest.approx([-0.5, -1.0, -1.5, -2.0])
    assert result.weight_version == 8 and result.token_versions() == [7, 7, 8, 8]


@pytest.mark.parametrize(("version", "expected"), [("4", 4), ("default", 0), (None, 0)])
def test_one_version_covers_the_whole_reply(version: str | None, expected: int) -> None:
    client = CannedFront([5, 6, 7], {"weight_version": version, "finish_reason": "length"})
    result = generate(client, common_pb2.SamplingParams(max_new_tokens=3))
    assert result.weight_versions == [expected] * 3 and result.finish_reason == "length"
    assert generate(CannedFront([], {"weight_version": version}),
                    common_pb2.SamplingParams()).weight_versions == []


def test_every_call_sends_its_own_sampling_params() -> None:
    client = CannedFront([5], {})
    asks = [common_pb2.SamplingParams(temperature=0.5, max_new_tokens=n, stop=stop)
            for n, stop in ((4, ["x"]), (4, ["x"]), (2, []), (4, ["x"]))]
    for sampling in asks:
        generate(client, sampling)
    sent = [body["sampling_params"] for body in client.bodies]
    assert sent == [{"temperature": 0.5, "max_new_tokens": 4, "stop": ["x"]}] * 2 + [
        {"temperature": 0.5, "max_new_tokens": 2}, {"temperature": 0.5, "max_new_tokens": 4,
                                                     "stop": ["x"]}]
    assert all(body["routing_key"] == "ep-1" for body in client.bodies)
    bad = common_pb2.SamplingParams(temperature=500)
    for _ in range(2):  # refused every time, not remembered as valid
        with pytest.raises(InvalidRequest):
            generate(client, bad)
