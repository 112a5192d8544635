from services._proto.riptide.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReleaseEngineMemoryRequest(_message.Message):
    __slots__ = ("tags",)
    TAGS_FIELD_NUMBER: _ClassVar[int]
    tags: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, tags: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseEngineMemoryReply(_message.Message):
    __slots__ = ("num_engines", "freed_bytes")
    NUM_ENGINES_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    num_engines: int
    freed_bytes: int
    def __init__(self, num_engines: _Optional[int] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class WeightUpdateBegin(_message.Message):
    __slots__ = ("weight_version", "master_address", "master_port", "group_name", "backend", "colocated")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    GROUP_NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    COLOCATED_FIELD_NUMBER: _ClassVar[int]
    weight_version: int
    master_address: str
    master_port: int
    group_name: str
    backend: str
    colocated: bool
    def __init__(self, weight_version: _Optional[int] = ..., master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., group_name: _Optional[str] = ..., backend: _Optional[str] = ..., colocated: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class WeightBucket(_message.Message):
    __slots__ = ("bucket_index", "tensors", "serialized_named_tensors")
    BUCKET_INDEX_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SERIALIZED_NAMED_TENSORS_FIELD_NUMBER: _ClassVar[int]
    bucket_index: int
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    serialized_named_tensors: str
    def __init__(self, bucket_index: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., serialized_named_tensors: _Optional[str] = ...) -> None: ...

class WeightUpdateCommit(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightUpdateJoining(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WeightUpdateRequest(_message.Message):
    __slots__ = ("begin", "bucket", "commit", "joining")
    BEGIN_FIELD_NUMBER: _ClassVar[int]
    BUCKET_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    begin: WeightUpdateBegin
    bucket: WeightBucket
    commit: WeightUpdateCommit
    joining: WeightUpdateJoining
    def __init__(self, begin: _Optional[_Union[WeightUpdateBegin, _Mapping]] = ..., bucket: _Optional[_Union[WeightBucket, _Mapping]] = ..., commit: _Optional[_Union[WeightUpdateCommit, _Mapping]] = ..., joining: _Optional[_Union[WeightUpdateJoining, _Mapping]] = ...) -> None: ...

class WeightUpdateGroup(_message.Message):
    __slots__ = ("world_size", "trainer_must_join")
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINER_MUST_JOIN_FIELD_NUMBER: _ClassVar[int]
    world_size: int
    trainer_must_join: bool
    def __init__(self, world_size: _Optional[int] = ..., trainer_must_join: _Optional[bool] = ...) -> None: ...

class WeightUpdateEvent(_message.Message):
    __slots__ = ("group", "bucket_loaded", "committed")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    BUCKET_LOADED_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    group: WeightUpdateGroup
    bucket_loaded: int
    committed: int
    def __init__(self, group: _Optional[_Union[WeightUpdateGroup, _Mapping]] = ..., bucket_loaded: _Optional[int] = ..., committed: _Optional[int] = ...) -> None: ...
