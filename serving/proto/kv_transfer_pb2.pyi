from serving.proto import pagedjax_pb2 as _pagedjax_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVArray(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class KVHeader(_message.Message):
    __slots__ = ("meta_json", "arrays", "total_bytes", "prefill_s", "jax_address", "jax_uuid")
    META_JSON_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    JAX_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    JAX_UUID_FIELD_NUMBER: _ClassVar[int]
    meta_json: bytes
    arrays: _containers.RepeatedCompositeFieldContainer[KVArray]
    total_bytes: int
    prefill_s: float
    jax_address: str
    jax_uuid: int
    def __init__(self, meta_json: _Optional[bytes] = ..., arrays: _Optional[_Iterable[_Union[KVArray, _Mapping]]] = ..., total_bytes: _Optional[int] = ..., prefill_s: _Optional[float] = ..., jax_address: _Optional[str] = ..., jax_uuid: _Optional[int] = ...) -> None: ...

class KVTrailer(_message.Message):
    __slots__ = ("sha256", "device_digest")
    SHA256_FIELD_NUMBER: _ClassVar[int]
    DEVICE_DIGEST_FIELD_NUMBER: _ClassVar[int]
    sha256: str
    device_digest: str
    def __init__(self, sha256: _Optional[str] = ..., device_digest: _Optional[str] = ...) -> None: ...

class KVChunk(_message.Message):
    __slots__ = ("header", "data", "trailer")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TRAILER_FIELD_NUMBER: _ClassVar[int]
    header: KVHeader
    data: bytes
    trailer: KVTrailer
    def __init__(self, header: _Optional[_Union[KVHeader, _Mapping]] = ..., data: _Optional[bytes] = ..., trailer: _Optional[_Union[KVTrailer, _Mapping]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("request", "kv_source")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    KV_SOURCE_FIELD_NUMBER: _ClassVar[int]
    request: _pagedjax_pb2.GenerateRequest
    kv_source: str
    def __init__(self, request: _Optional[_Union[_pagedjax_pb2.GenerateRequest, _Mapping]] = ..., kv_source: _Optional[str] = ...) -> None: ...

class WorkerInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfoResponse(_message.Message):
    __slots__ = ("role", "versions", "kv_dtype", "page_size", "stats", "adapters")
    class StatsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    class AdaptersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROLE_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    role: str
    versions: _pagedjax_pb2.ModelVersions
    kv_dtype: str
    page_size: int
    stats: _containers.ScalarMap[str, float]
    adapters: _containers.ScalarMap[str, str]
    def __init__(self, role: _Optional[str] = ..., versions: _Optional[_Union[_pagedjax_pb2.ModelVersions, _Mapping]] = ..., kv_dtype: _Optional[str] = ..., page_size: _Optional[int] = ..., stats: _Optional[_Mapping[str, float]] = ..., adapters: _Optional[_Mapping[str, str]] = ...) -> None: ...
