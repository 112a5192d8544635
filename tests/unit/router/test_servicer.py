"""Protobuf <-> SGLang /generate body conversion."""

from __future__ import annotations

import pytest

from services._proto.riptide.v1 import common_pb2, router_pb2
from services.common.errors import InvalidRequest
from services.router.servicer import generate_body, sampling_params


def test_sampling_params_leave_zero_defaults_to_the_engine() -> None:
    params = common_pb2.SamplingParams(max_new_tokens=32, temperature=0.0)
    assert sampling_params(params) == {"max_new_tokens": 32, "temperature": 0.0}
    full = common_pb2.SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20,
                                     stop_token_ids=[2], stop=["\n"], ignore_eos=True,
                                     sampling_seed=0)
    out = sampling_params(full)
    assert out["top_k"] == 20 and out["stop_token_ids"] == [2] and out["stop"] == ["\n"]
    assert out["ignore_eos"] is True and out["sampling_seed"] == 0  # an explicit seed of 0
    assert out["top_p"] == pytest.approx(0.9)


def test_generate_body_forwards_ids_logprob_flag_and_request_id() -> None:
    request = router_pb2.GenerateRequest(session_key="ep-1", input_ids=[5, 6, 7],
                                         return_logprob=True, request_id="rid-1")
    body = generate_body(request)
    assert body["input_ids"] == [5, 6, 7] and body["return_logprob"] is True
    assert body["rid"] == "rid-1"
    assert generate_body(router_pb2.GenerateRequest(input_ids=[1]))["rid"]  # generated


def test_empty_input_is_rejected() -> None:
    with pytest.raises(InvalidRequest):
        generate_body(router_pb2.GenerateRequest(session_key="x"))
