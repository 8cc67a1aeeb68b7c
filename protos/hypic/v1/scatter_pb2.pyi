from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class BuildRequest(_message.Message):
    __slots__ = ("key", "token_ids", "seam", "model_fingerprint", "dtype", "request_id", "store", "chunk_bytes")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    seam: int
    model_fingerprint: str
    dtype: str
    request_id: str
    store: bool
    chunk_bytes: int
    def __init__(self, key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., seam: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., request_id: _Optional[str] = ..., store: _Optional[bool] = ..., chunk_bytes: _Optional[int] = ...) -> None: ...

class BuildHeader(_message.Message):
    __slots__ = ("key", "size", "build_s", "shared", "worker", "checksum")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    key: str
    size: int
    build_s: float
    shared: bool
    worker: str
    checksum: bytes
    def __init__(self, key: _Optional[str] = ..., size: _Optional[int] = ..., build_s: _Optional[float] = ..., shared: _Optional[bool] = ..., worker: _Optional[str] = ..., checksum: _Optional[bytes] = ...) -> None: ...

class BuildResponse(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: BuildHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[BuildHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("in_flight", "queued_tokens", "worker", "model_fingerprint", "entry_format")
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    in_flight: int
    queued_tokens: float
    worker: str
    model_fingerprint: str
    entry_format: str
    def __init__(self, in_flight: _Optional[int] = ..., queued_tokens: _Optional[float] = ..., worker: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., entry_format: _Optional[str] = ...) -> None: ...
