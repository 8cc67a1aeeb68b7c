from protos.hypic.v1 import router_pb2 as _router_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SegmentSource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SOURCE_SEGCACHE: _ClassVar[SegmentSource]
    SOURCE_SCATTER: _ClassVar[SegmentSource]
    SOURCE_LOCAL: _ClassVar[SegmentSource]
SOURCE_SEGCACHE: SegmentSource
SOURCE_SCATTER: SegmentSource
SOURCE_LOCAL: SegmentSource

class PlannedSegment(_message.Message):
    __slots__ = ("key", "token_ids", "source", "worker", "est_cost_s", "wait_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    EST_COST_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    source: SegmentSource
    worker: int
    est_cost_s: float
    wait_s: float
    def __init__(self, key: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., source: _Optional[_Union[SegmentSource, str]] = ..., worker: _Optional[int] = ..., est_cost_s: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class Plan(_message.Message):
    __slots__ = ("request_id", "segments", "query", "seam", "model_fingerprint", "dtype", "mode", "max_tokens", "temperature", "top_k", "seed", "return_logits", "stop_at_eos", "scatter_addresses", "segcache_address", "store_entries", "top_p", "shadow")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    SCATTER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGCACHE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STORE_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    segments: _containers.RepeatedCompositeFieldContainer[PlannedSegment]
    query: _containers.RepeatedScalarFieldContainer[int]
    seam: int
    model_fingerprint: str
    dtype: str
    mode: _router_pb2.PrefillMode
    max_tokens: int
    temperature: float
    top_k: int
    seed: int
    return_logits: bool
    stop_at_eos: bool
    scatter_addresses: _containers.RepeatedScalarFieldContainer[str]
    segcache_address: str
    store_entries: bool
    top_p: float
    shadow: bool
    def __init__(self, request_id: _Optional[str] = ..., segments: _Optional[_Iterable[_Union[PlannedSegment, _Mapping]]] = ..., query: _Optional[_Iterable[int]] = ..., seam: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., mode: _Optional[_Union[_router_pb2.PrefillMode, str]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., return_logits: _Optional[bool] = ..., stop_at_eos: _Optional[bool] = ..., scatter_addresses: _Optional[_Iterable[str]] = ..., segcache_address: _Optional[str] = ..., store_entries: _Optional[bool] = ..., top_p: _Optional[float] = ..., shadow: _Optional[bool] = ...) -> None: ...

class SegmentReady(_message.Message):
    __slots__ = ("index", "source", "tier", "fetch_s", "build_s", "tokens", "worker", "via_nixl")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    VIA_NIXL_FIELD_NUMBER: _ClassVar[int]
    index: int
    source: SegmentSource
    tier: str
    fetch_s: float
    build_s: float
    tokens: int
    worker: str
    via_nixl: bool
    def __init__(self, index: _Optional[int] = ..., source: _Optional[_Union[SegmentSource, str]] = ..., tier: _Optional[str] = ..., fetch_s: _Optional[float] = ..., build_s: _Optional[float] = ..., tokens: _Optional[int] = ..., worker: _Optional[str] = ..., via_nixl: _Optional[bool] = ...) -> None: ...

class CombineEvent(_message.Message):
    __slots__ = ("segment", "token", "timings")
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    segment: SegmentReady
    token: _router_pb2.TokenEvent
    timings: _router_pb2.Timings
    def __init__(self, segment: _Optional[_Union[SegmentReady, _Mapping]] = ..., token: _Optional[_Union[_router_pb2.TokenEvent, _Mapping]] = ..., timings: _Optional[_Union[_router_pb2.Timings, _Mapping]] = ...) -> None: ...

class CombineInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CombineInfoResponse(_message.Message):
    __slots__ = ("model_type", "model_fingerprint", "dtype", "in_flight", "entry_format")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    model_fingerprint: str
    dtype: str
    in_flight: int
    entry_format: str
    def __init__(self, model_type: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., dtype: _Optional[str] = ..., in_flight: _Optional[int] = ..., entry_format: _Optional[str] = ...) -> None: ...

class ShadowRequest(_message.Message):
    __slots__ = ("request_id", "model_fingerprint", "prompt", "generated", "hypic_argmax", "hypic_logits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    HYPIC_ARGMAX_FIELD_NUMBER: _ClassVar[int]
    HYPIC_LOGITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model_fingerprint: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    generated: _containers.RepeatedScalarFieldContainer[int]
    hypic_argmax: _containers.RepeatedScalarFieldContainer[int]
    hypic_logits: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, request_id: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., generated: _Optional[_Iterable[int]] = ..., hypic_argmax: _Optional[_Iterable[int]] = ..., hypic_logits: _Optional[_Iterable[float]] = ...) -> None: ...

class ShadowResult(_message.Message):
    __slots__ = ("kl", "top1_agree", "agreement", "steps", "compute_s")
    KL_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREE_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    kl: float
    top1_agree: bool
    agreement: float
    steps: int
    compute_s: float
    def __init__(self, kl: _Optional[float] = ..., top1_agree: _Optional[bool] = ..., agreement: _Optional[float] = ..., steps: _Optional[int] = ..., compute_s: _Optional[float] = ...) -> None: ...
