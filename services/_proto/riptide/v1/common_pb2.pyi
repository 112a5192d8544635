from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class VerdictStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VERDICT_STATUS_UNSPECIFIED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_SCORED: _ClassVar[VerdictStatus]
    VERDICT_STATUS_NO_VERDICT: _ClassVar[VerdictStatus]

class NoVerdictCause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NO_VERDICT_CAUSE_UNSPECIFIED: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_PROVIDER_CREATE_FAILED: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_SANDBOX_LOST: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_AGENT_TIMEOUT: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_AGENT_ERROR: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_CONTEXT_OVERFLOW: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_VERIFIER_ERROR: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_VERIFIER_TIMEOUT: _ClassVar[NoVerdictCause]
    NO_VERDICT_CAUSE_ENGINE_ERROR: _ClassVar[NoVerdictCause]
VERDICT_STATUS_UNSPECIFIED: VerdictStatus
VERDICT_STATUS_SCORED: VerdictStatus
VERDICT_STATUS_NO_VERDICT: VerdictStatus
NO_VERDICT_CAUSE_UNSPECIFIED: NoVerdictCause
NO_VERDICT_CAUSE_PROVIDER_CREATE_FAILED: NoVerdictCause
NO_VERDICT_CAUSE_SANDBOX_LOST: NoVerdictCause
NO_VERDICT_CAUSE_AGENT_TIMEOUT: NoVerdictCause
NO_VERDICT_CAUSE_AGENT_ERROR: NoVerdictCause
NO_VERDICT_CAUSE_CONTEXT_OVERFLOW: NoVerdictCause
NO_VERDICT_CAUSE_VERIFIER_ERROR: NoVerdictCause
NO_VERDICT_CAUSE_VERIFIER_TIMEOUT: NoVerdictCause
NO_VERDICT_CAUSE_ENGINE_ERROR: NoVerdictCause

class SamplingParams(_message.Message):
    __slots__ = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "ignore_eos", "sampling_seed")
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SEED_FIELD_NUMBER: _ClassVar[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    sampling_seed: int
    def __init__(self, max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., sampling_seed: _Optional[int] = ...) -> None: ...

class EpisodeTimings(_message.Message):
    __slots__ = ("sandbox_create_s", "generate_s", "exec_s", "verify_s", "total_s", "queued_s")
    SANDBOX_CREATE_S_FIELD_NUMBER: _ClassVar[int]
    GENERATE_S_FIELD_NUMBER: _ClassVar[int]
    EXEC_S_FIELD_NUMBER: _ClassVar[int]
    VERIFY_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    QUEUED_S_FIELD_NUMBER: _ClassVar[int]
    sandbox_create_s: float
    generate_s: float
    exec_s: float
    verify_s: float
    total_s: float
    queued_s: float
    def __init__(self, sandbox_create_s: _Optional[float] = ..., generate_s: _Optional[float] = ..., exec_s: _Optional[float] = ..., verify_s: _Optional[float] = ..., total_s: _Optional[float] = ..., queued_s: _Optional[float] = ...) -> None: ...

class Trajectory(_message.Message):
    __slots__ = ("sample_id", "group_id", "task_id", "sample_index", "prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions", "reward", "status", "status_message", "num_turns", "finish_reason", "timings", "engine_url", "dp_rank", "prompt_tokens", "cached_tokens", "no_verdict_cause", "segments")
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REWARD_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_TURNS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_URL_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NO_VERDICT_CAUSE_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    sample_id: str
    group_id: str
    task_id: str
    sample_index: int
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    reward: float
    status: VerdictStatus
    status_message: str
    num_turns: int
    finish_reason: str
    timings: EpisodeTimings
    engine_url: str
    dp_rank: int
    prompt_tokens: int
    cached_tokens: int
    no_verdict_cause: NoVerdictCause
    segments: _containers.RepeatedCompositeFieldContainer[TrajectorySegment]
    def __init__(self, sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., reward: _Optional[float] = ..., status: _Optional[_Union[VerdictStatus, str]] = ..., status_message: _Optional[str] = ..., num_turns: _Optional[int] = ..., finish_reason: _Optional[str] = ..., timings: _Optional[_Union[EpisodeTimings, _Mapping]] = ..., engine_url: _Optional[str] = ..., dp_rank: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., no_verdict_cause: _Optional[_Union[NoVerdictCause, str]] = ..., segments: _Optional[_Iterable[_Union[TrajectorySegment, _Mapping]]] = ...) -> None: ...

class TrajectorySegment(_message.Message):
    __slots__ = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "weight_versions", "cause")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_IDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_MASK_FIELD_NUMBER: _ClassVar[int]
    ROLLOUT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    response_ids: _containers.RepeatedScalarFieldContainer[int]
    loss_mask: _containers.RepeatedScalarFieldContainer[int]
    rollout_logprobs: _containers.RepeatedScalarFieldContainer[float]
    weight_versions: _containers.RepeatedScalarFieldContainer[int]
    cause: str
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., response_ids: _Optional[_Iterable[int]] = ..., loss_mask: _Optional[_Iterable[int]] = ..., rollout_logprobs: _Optional[_Iterable[float]] = ..., weight_versions: _Optional[_Iterable[int]] = ..., cause: _Optional[str] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "task_id", "samples", "created_unix_ms", "min_weight_version")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    task_id: str
    samples: _containers.RepeatedCompositeFieldContainer[Trajectory]
    created_unix_ms: int
    min_weight_version: int
    def __init__(self, group_id: _Optional[str] = ..., task_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[Trajectory, _Mapping]]] = ..., created_unix_ms: _Optional[int] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class ServiceStatus(_message.Message):
    __slots__ = ("service", "state", "uptime_s", "details")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    service: str
    state: str
    uptime_s: float
    details: _struct_pb2.Struct
    def __init__(self, service: _Optional[str] = ..., state: _Optional[str] = ..., uptime_s: _Optional[float] = ..., details: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
