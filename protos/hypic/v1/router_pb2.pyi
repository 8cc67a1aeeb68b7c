from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFILL_MODE_HYPIC: _ClassVar[PrefillMode]
    PREFILL_MODE_FULL: _ClassVar[PrefillMode]
    PREFILL_MODE_PREFIX: _ClassVar[PrefillMode]
    PREFILL_MODE_ADDITIVE: _ClassVar[PrefillMode]
    PREFILL_MODE_NAIVE: _ClassVar[PrefillMode]
PREFILL_MODE_HYPIC: PrefillMode
PREFILL_MODE_FULL: PrefillMode
PREFILL_MODE_PREFIX: PrefillMode
PREFILL_MODE_ADDITIVE: PrefillMode
PREFILL_MODE_NAIVE: PrefillMode

class Segment(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("segments", "query", "max_tokens", "temperature", "top_k", "seed", "mode", "return_logits", "stop_at_eos", "request_id", "top_p", "keep_whole")
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    RETURN_LOGITS_FIELD_NUMBER: _ClassVar[int]
    STOP_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    KEEP_WHOLE_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedCompositeFieldContainer[Segment]
    query: Segment
    max_tokens: int
    temperature: float
    top_k: int
    seed: int
    mode: PrefillMode
    return_logits: bool
    stop_at_eos: bool
    request_id: str
    top_p: float
    keep_whole: bool
    def __init__(self, segments: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., query: _Optional[_Union[Segment, _Mapping]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., mode: _Optional[_Union[PrefillMode, str]] = ..., return_logits: _Optional[bool] = ..., stop_at_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., top_p: _Optional[float] = ..., keep_whole: _Optional[bool] = ...) -> None: ...

class SegmentTrace(_message.Message):
    __slots__ = ("index", "source", "worker", "tier", "fetch_s", "build_s", "tokens", "via_nixl")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    FETCH_S_FIELD_NUMBER: _ClassVar[int]
    BUILD_S_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    VIA_NIXL_FIELD_NUMBER: _ClassVar[int]
    index: int
    source: str
    worker: str
    tier: str
    fetch_s: float
    build_s: float
    tokens: int
    via_nixl: bool
    def __init__(self, index: _Optional[int] = ..., source: _Optional[str] = ..., worker: _Optional[str] = ..., tier: _Optional[str] = ..., fetch_s: _Optional[float] = ..., build_s: _Optional[float] = ..., tokens: _Optional[int] = ..., via_nixl: _Optional[bool] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("tokenize_s", "lookup_s", "scatter_s", "transfer_s", "compose_s", "seams_s", "query_prefill_s", "ttft_s", "total_s", "segments", "hits", "misses", "prompt_tokens", "hits_by_tier", "trace", "cached_tokens", "cached_tokens_by_tier", "recomputed", "seam", "served_mode", "shadowed")
    class HitsByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CachedTokensByTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TOKENIZE_S_FIELD_NUMBER: _ClassVar[int]
    LOOKUP_S_FIELD_NUMBER: _ClassVar[int]
    SCATTER_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    COMPOSE_S_FIELD_NUMBER: _ClassVar[int]
    SEAMS_S_FIELD_NUMBER: _ClassVar[int]
    QUERY_PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TTFT_S_FIELD_NUMBER: _ClassVar[int]
    TOTAL_S_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HITS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    TRACE_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_BY_TIER_FIELD_NUMBER: _ClassVar[int]
    RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    SERVED_MODE_FIELD_NUMBER: _ClassVar[int]
    SHADOWED_FIELD_NUMBER: _ClassVar[int]
    tokenize_s: float
    lookup_s: float
    scatter_s: float
    transfer_s: float
    compose_s: float
    seams_s: float
    query_prefill_s: float
    ttft_s: float
    total_s: float
    segments: int
    hits: int
    misses: int
    prompt_tokens: int
    hits_by_tier: _containers.ScalarMap[str, int]
    trace: _containers.RepeatedCompositeFieldContainer[SegmentTrace]
    cached_tokens: int
    cached_tokens_by_tier: _containers.ScalarMap[str, int]
    recomputed: int
    seam: int
    served_mode: PrefillMode
    shadowed: bool
    def __init__(self, tokenize_s: _Optional[float] = ..., lookup_s: _Optional[float] = ..., scatter_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., compose_s: _Optional[float] = ..., seams_s: _Optional[float] = ..., query_prefill_s: _Optional[float] = ..., ttft_s: _Optional[float] = ..., total_s: _Optional[float] = ..., segments: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., hits_by_tier: _Optional[_Mapping[str, int]] = ..., trace: _Optional[_Iterable[_Union[SegmentTrace, _Mapping]]] = ..., cached_tokens: _Optional[int] = ..., cached_tokens_by_tier: _Optional[_Mapping[str, int]] = ..., recomputed: _Optional[int] = ..., seam: _Optional[int] = ..., served_mode: _Optional[_Union[PrefillMode, str]] = ..., shadowed: _Optional[bool] = ...) -> None: ...

class TokenEvent(_message.Message):
    __slots__ = ("token_id", "text", "index", "logits", "argmax_id")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    LOGITS_FIELD_NUMBER: _ClassVar[int]
    ARGMAX_ID_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    index: int
    logits: _containers.RepeatedScalarFieldContainer[float]
    argmax_id: int
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., index: _Optional[int] = ..., logits: _Optional[_Iterable[float]] = ..., argmax_id: _Optional[int] = ...) -> None: ...

class GenerateEvent(_message.Message):
    __slots__ = ("request_id", "token", "timings", "done")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token: TokenEvent
    timings: Timings
    done: bool
    def __init__(self, request_id: _Optional[str] = ..., token: _Optional[_Union[TokenEvent, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., done: _Optional[bool] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_type", "model_fingerprint", "vocab_size", "seam", "dtype", "max_prompt_tokens", "scatter_addresses", "combine_addresses", "segcache_address", "model_path", "drift")
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SCATTER_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    COMBINE_ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    SEGCACHE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    DRIFT_FIELD_NUMBER: _ClassVar[int]
    model_type: str
    model_fingerprint: str
    vocab_size: int
    seam: int
    dtype: str
    max_prompt_tokens: int
    scatter_addresses: _containers.RepeatedScalarFieldContainer[str]
    combine_addresses: _containers.RepeatedScalarFieldContainer[str]
    segcache_address: str
    model_path: str
    drift: DriftSummary
    def __init__(self, model_type: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., vocab_size: _Optional[int] = ..., seam: _Optional[int] = ..., dtype: _Optional[str] = ..., max_prompt_tokens: _Optional[int] = ..., scatter_addresses: _Optional[_Iterable[str]] = ..., combine_addresses: _Optional[_Iterable[str]] = ..., segcache_address: _Optional[str] = ..., model_path: _Optional[str] = ..., drift: _Optional[_Union[DriftSummary, _Mapping]] = ...) -> None: ...

class DriftSummary(_message.Message):
    __slots__ = ("sample_rate", "sampled", "shadowed", "dropped", "over_threshold", "window", "kl_mean", "top1_rate", "agreement_mean", "guard_enabled", "guard_seam", "guard_full", "histograms")
    SAMPLE_RATE_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    SHADOWED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    OVER_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    KL_MEAN_FIELD_NUMBER: _ClassVar[int]
    TOP1_RATE_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_MEAN_FIELD_NUMBER: _ClassVar[int]
    GUARD_ENABLED_FIELD_NUMBER: _ClassVar[int]
    GUARD_SEAM_FIELD_NUMBER: _ClassVar[int]
    GUARD_FULL_FIELD_NUMBER: _ClassVar[int]
    HISTOGRAMS_FIELD_NUMBER: _ClassVar[int]
    sample_rate: float
    sampled: int
    shadowed: int
    dropped: int
    over_threshold: int
    window: int
    kl_mean: float
    top1_rate: float
    agreement_mean: float
    guard_enabled: bool
    guard_seam: int
    guard_full: bool
    histograms: _containers.RepeatedCompositeFieldContainer[DriftHistogram]
    def __init__(self, sample_rate: _Optional[float] = ..., sampled: _Optional[int] = ..., shadowed: _Optional[int] = ..., dropped: _Optional[int] = ..., over_threshold: _Optional[int] = ..., window: _Optional[int] = ..., kl_mean: _Optional[float] = ..., top1_rate: _Optional[float] = ..., agreement_mean: _Optional[float] = ..., guard_enabled: _Optional[bool] = ..., guard_seam: _Optional[int] = ..., guard_full: _Optional[bool] = ..., histograms: _Optional[_Iterable[_Union[DriftHistogram, _Mapping]]] = ...) -> None: ...

class DriftHistogram(_message.Message):
    __slots__ = ("figure", "seam", "upper_bounds", "counts", "sum")
    FIGURE_FIELD_NUMBER: _ClassVar[int]
    SEAM_FIELD_NUMBER: _ClassVar[int]
    UPPER_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    figure: str
    seam: int
    upper_bounds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    sum: float
    def __init__(self, figure: _Optional[str] = ..., seam: _Optional[int] = ..., upper_bounds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., sum: _Optional[float] = ...) -> None: ...
