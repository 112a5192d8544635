from services._proto.riptide.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RunEpisodeRequest(_message.Message):
    __slots__ = ("task_id", "sample_id", "group_id", "sample_index", "sampling_params", "routed_experts_num_layers", "routed_experts_top_k")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_TOP_K_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    sample_id: str
    group_id: str
    sample_index: int
    sampling_params: _common_pb2.SamplingParams
    routed_experts_num_layers: int
    routed_experts_top_k: int
    def __init__(self, task_id: _Optional[str] = ..., sample_id: _Optional[str] = ..., group_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., sampling_params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., routed_experts_num_layers: _Optional[int] = ..., routed_experts_top_k: _Optional[int] = ...) -> None: ...

class EpisodeProgress(_message.Message):
    __slots__ = ("kind", "turn", "detail", "elapsed_s")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_S_FIELD_NUMBER: _ClassVar[int]
    kind: str
    turn: int
    detail: str
    elapsed_s: float
    def __init__(self, kind: _Optional[str] = ..., turn: _Optional[int] = ..., detail: _Optional[str] = ..., elapsed_s: _Optional[float] = ...) -> None: ...

class EpisodeEvent(_message.Message):
    __slots__ = ("progress", "trajectory")
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    TRAJECTORY_FIELD_NUMBER: _ClassVar[int]
    progress: EpisodeProgress
    trajectory: _common_pb2.Trajectory
    def __init__(self, progress: _Optional[_Union[EpisodeProgress, _Mapping]] = ..., trajectory: _Optional[_Union[_common_pb2.Trajectory, _Mapping]] = ...) -> None: ...

class ListTasksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTasksResponse(_message.Message):
    __slots__ = ("task_ids",)
    TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, task_ids: _Optional[_Iterable[str]] = ...) -> None: ...
