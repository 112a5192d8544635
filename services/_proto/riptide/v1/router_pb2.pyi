from services._proto.riptide.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("session_key", "input_ids", "sampling_params", "return_logprob", "request_id", "sglang_fields_json")
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SGLANG_FIELDS_JSON_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    input_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _common_pb2.SamplingParams
    return_logprob: bool
    request_id: str
    sglang_fields_json: str
    def __init__(self, session_key: _Optional[str] = ..., input_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., return_logprob: _Optional[bool] = ..., request_id: _Optional[str] = ..., sglang_fields_json: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("output_ids", "output_logprobs", "finish_reason", "prompt_tokens", "cached_tokens", "weight_version", "engine_url", "dp_rank", "engine_latency_s", "output_weight_versions", "routed_experts")
    OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    output_ids: _containers.RepeatedScalarFieldContainer[int]
    output_logprobs: _containers.RepeatedScalarFieldContainer[float]
    finish_reason: str
    prompt_tokens: int
    cached_tokens: int
    weight_version: int
    engine_url: str
    dp_rank: int
    engine_latency_s: float
    output_weight_versions: _containers.RepeatedScalarFieldContainer[int]
    routed_experts: bytes
    def __init__(self, output_ids: _Optional[_Iterable[int]] = ..., output_logprobs: _Optional[_Iterable[float]] = ..., finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., weight_version: _Optional[int] = ..., engine_url: _Optional[str] = ..., dp_rank: _Optional[int] = ..., engine_latency_s: _Optional[float] = ..., output_weight_versions: _Optional[_Iterable[int]] = ..., routed_experts: _Optional[bytes] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("url",)
    URL_FIELD_NUMBER: _ClassVar[int]
    url: str
    def __init__(self, url: _Optional[str] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("dp_ranks",)
    DP_RANKS_FIELD_NUMBER: _ClassVar[int]
    dp_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dp_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class DeregisterEngineRequest(_message.Message):
    __slots__ = ("url", "drain")
    URL_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    url: str
    drain: bool
    def __init__(self, url: _Optional[str] = ..., drain: _Optional[bool] = ...) -> None: ...

class DeregisterEngineResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SetWeightVersionRequest(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    def __init__(self, weight_version: _Optional[int] = ...) -> None: ...

class SetWeightVersionResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EndSessionRequest(_message.Message):
    __slots__ = ("session_key",)
    SESSION_KEY_FIELD_NUMBER: _ClassVar[int]
    session_key: str
    def __init__(self, session_key: _Optional[str] = ...) -> None: ...

class EndSessionResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...
