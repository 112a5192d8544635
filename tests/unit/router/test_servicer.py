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


def test_sglang_fields_pass_through_and_add_to_sampling_params() -> None:
    request = router_pb2.GenerateRequest(
        input_ids=[1, 2], sampling_params=common_pb2.SamplingParams(max_new_tokens=4),
        sglang_fields_json='{"logprob_start_len": 0, "top_logprobs_num": 3, '
                           '"lora_path": "a", "sampling_params": {"frequency_penalty": 0.5, '
                           '"json_schema": "{}"}}')
    body = generate_body(request)
    assert body["logprob_start_len"] == 0 and body["top_logprobs_num"] == 3
    assert body["lora_path"] == "a" and body["input_ids"] == [1, 2]
    assert body["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 4,
                                       "frequency_penalty": 0.5, "json_schema": "{}"}


@pytest.mark.parametrize("fields", ["not json", "[1]", '{"stream": true}',
                                    '{"sampling_params": 3}'])
def test_bad_sglang_fields_are_rejected(fields: str) -> None:
    with pytest.raises(InvalidRequest):
        generate_body(router_pb2.GenerateRequest(input_ids=[1], sglang_fields_json=fields))


def test_unset_max_new_tokens_is_the_engine_default_and_an_explicit_zero_is_refused() -> None:
    assert "max_new_tokens" not in sampling_params(common_pb2.SamplingParams(temperature=1.0))
    assert sampling_params(common_pb2.SamplingParams(max_new_tokens=1))["max_new_tokens"] == 1
    with pytest.raises(InvalidRequest, match="max_new_tokens: 0 generates nothing"):
        sampling_params(common_pb2.SamplingParams(max_new_tokens=0))


@pytest.mark.parametrize(("fields", "message"), [
    ({"session_key": "k" * 1_000_000}, "session_key: at most 256 printable characters"),
    ({"session_key": "tab\there"}, "session_key: at most 256 printable characters"),
    ({"request_id": "r" * 257}, "request_id: at most 256 printable characters"),
    ({"sglang_fields_json": '{"lora_path": "' + "a" * 70_000 + '"}'},
     "sglang_fields_json: at most 65536 characters, got 70017"),
    ({"input_ids": [1] * 101}, "input_ids: 101 tokens, more than the model's context takes "
                               "(100 prompt tokens at most"),
])
def test_oversized_fields_are_refused_with_a_short_message(fields: dict[str, object],
                                                           message: str) -> None:
    request = router_pb2.GenerateRequest(**{"input_ids": [1], **fields})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as info:
        generate_body(request, max_input_tokens=100)
    assert message in str(info.value) and len(str(info.value)) < 200, str(info.value)[:300]


def test_bounds_admit_what_fits() -> None:
    request = router_pb2.GenerateRequest(session_key="k" * 256, request_id="r" * 256,
                                         input_ids=[1] * 100)
    assert len(generate_body(request, max_input_tokens=100)["input_ids"]) == 100
    assert generate_body(router_pb2.GenerateRequest(input_ids=[1] * 5000))  # no limit known
